"""`fused_policy_loss`: from logits to the policy loss in one read of the logits forward and
one read + one write backward.

Token-level losses (`ratio="token"`: PPO, GRPO, DAPO, Dr. GRPO, CISPO, ...): the backend's
`policy_token_fwd` kernel reads each row once and, in the same program, evaluates the token's
loss, its derivatives w.r.t. log-prob and entropy and the token's statistics; a few ops reduce
those to the loss and the metrics. Other ratios couple the tokens of a row or group: the forward
kernel gives log-probs and entropy, then the loss and its derivatives come from the backend's
`policy_token_loss` (`_sequence_step`) or, for the rest, from `losses/` (the spec) and its
autograd on `(B, T)` tensors. Either way the backward is one kernel over the logits from the
per-token derivatives times the incoming gradient (an `(N,)` product, no N × V pass), written
into a new buffer or, with `inplace=True`, into the logits themselves.

Under `torch.compile` (and without autograd) the value is the composition
`policy_loss(token_logprobs(...))`, which traces through the registered ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _backend
from ..kernels.softcap import with_softcap
from ..losses import LossOutput, PolicyLossConfig, policy_loss
from ..losses.spec import LossInputs
from ._logits_grad import deferred_logits_grad
from ._loss_step import kernel_inputs, row_grads, with_entropy_bonus
from ._token_stats import loss_from_stats
from .._checks import check_softcap
from .._dtypes import acc_dtype
from ._rows import check_logits_args, logits_rows, run_blocks
from .token_logprobs import token_logprobs
from ._plan import Step, plan, warn_general_path

def fused_policy_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Optional[Tensor],
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    old_logp: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    group_ids: Optional[Tensor] = None,
    rewards: Optional[Tensor] = None,
    num_items: Optional[float] = None,
    num_seqs: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    rollout_logp: Optional[Tensor] = None,
    entropy_quantile_group=None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    inplace: bool = False,
    backend: Optional[str] = None,
) -> LossOutput:
    """`policy_loss(token_logprobs(logits, targets), ...)` in one call, without its N × V temporaries.

    logits `(B, T, V)`, targets `(B, T)`; the other arguments are those of `policy_loss`. The
    entropy is always computed (the `entropy` metric, and the bonus when `entropy_coef != 0`).
    `softcap` c: the logits are the head's output before a final-logit cap c·tanh(z/c) (as
    `token_logprobs`). `inplace=True`: the backward writes ∂logits over the logits (the caller
    gives them up).
    """
    loss_kwargs = dict(old_logp=old_logp, ref_logp=ref_logp, group_ids=group_ids, rewards=rewards,
                       num_items=num_items, num_seqs=num_seqs, is_weights=is_weights,
                       rollout_logp=rollout_logp, entropy_quantile_group=entropy_quantile_group)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected a bool, got {type(inplace).__name__}")
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(f"logits: expected a tensor of shape (B, T, V), got {_describe(logits)}")
    if torch.compiler.is_compiling():
        return _composed(logits, targets, advantages, mask, config, temperature, softcap, backend, loss_kwargs)

    name = _backend.resolve(backend, logits.device)
    temperature = check_logits_args(logits, targets, temperature, name)
    kernels = with_softcap(_backend.kernels(name), check_softcap(softcap))
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    decided = plan(config, kernels)
    warn_general_path(decided, name)
    in_kernel = decided.step is Step.FORWARD
    # Without a gradient the fused kernel still pays: its statistics are the loss and the metrics,
    # one launch where the composition makes ~60 (on a GPU the forward was host-bound).
    if not needs_grad and not in_kernel:
        return _composed(logits, targets, advantages, mask, config, temperature, softcap, backend, loss_kwargs)
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace: the gradient can only overwrite contiguous logits (got a strided view)")
    acc = acc_dtype(logits)
    inputs = LossInputs.build(config, shape=tuple(targets.shape), dtype=acc, device=logits.device, mask=mask,
                              advantages=advantages, what="logits (B, T, V)", **loss_kwargs)
    rows = logits_rows(logits, to_parent=needs_grad and not inplace)  # a (B, T, V) slice is read where it lies, not copied
    blocks = rows.blocks
    flat_targets = targets.reshape(-1).to(torch.int64)
    if in_kernel:
        out, logp, per_row = _kernel_loss(kernels, blocks, flat_targets, inputs, config, temperature)
    else:
        out, logp, per_row = _general_loss(kernels, blocks, flat_targets, inputs, config, temperature)
    loss = out.loss
    if needs_grad:
        loss = deferred_logits_grad(loss, rows, flat_targets, per_row, temperature, kernels, inplace)
    return LossOutput(loss, out.metrics, logp.view(targets.shape), per_row[1].view(targets.shape))


def _composed(logits, targets, advantages, mask, config, temperature, softcap, backend, loss_kwargs):
    """The definition, `policy_loss(token_logprobs(...))`: under torch.compile (the custom ops
    trace; the deferred backward does not) and without a gradient where the kernel lacks the loss."""
    logp, entropy = token_logprobs(logits, targets, temperature=temperature, softcap=softcap, return_entropy=True,
                                   backend=backend)
    out = policy_loss(logp, advantages, mask, config, entropy=entropy, **loss_kwargs)
    return LossOutput(out.loss, out.metrics, logp.detach(), entropy.detach())


def _kernel_loss(kernels, blocks, targets, inputs: LossInputs, config, temperature):
    """Token-level: the loss, its derivatives and the statistics from the forward kernel."""
    per_row, params = kernel_inputs(inputs, config)
    logp, entropy, lse_parts, grad_logp, grad_entropy, stats = run_blocks(
        kernels.policy_token_fwd, blocks, [targets, *per_row], temperature, params)
    out, grad_entropy = with_entropy_bonus(loss_from_stats(stats, inputs), grad_entropy, entropy, inputs, config)
    rows = (lse_parts, entropy, grad_logp, grad_entropy if config.entropy_coef != 0 else None)
    return out, logp, rows


def _general_loss(kernels, blocks, targets, inputs: LossInputs, config, temperature):
    """Any ratio: log-probs and entropy from the kernel, then `losses/` and its autograd on (B, T)."""
    logp, entropy, lse_parts = run_blocks(kernels.token_logprobs_fwd, blocks, [targets], temperature, True)
    out, grad_logp, grad_entropy = row_grads(kernels, logp, entropy, inputs, config)
    return out, logp, (lse_parts, entropy, grad_logp, grad_entropy)


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
