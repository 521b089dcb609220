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
from .._checks import check_softcap
from .._dtypes import acc_dtype
from ..kernels.softcap import with_softcap
from ..losses import LossOutput, PolicyLossConfig
from ..losses.spec import LossInputs, takes_loss_args
from ._logits_grad import deferred_logits_grad
from ._loss_step import TokenForward, composed, run_step
from ._plan import Step, plan, warn_general_path
from ._rows import check_logits_args, logits_rows, run_blocks
from .token_logprobs import token_logprobs


@takes_loss_args
def fused_policy_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Optional[Tensor],
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    inplace: bool = False,
    backend: Optional[str] = None,
    **loss_args,
) -> LossOutput:
    """`policy_loss(token_logprobs(logits, targets), ...)` in one call, without its N × V temporaries.

    logits `(B, T, V)`, targets `(B, T)`; the other arguments are those of `policy_loss`. The
    entropy is always computed (the `entropy` metric, and the bonus when `entropy_coef != 0`).
    `softcap` c: the logits are the head's output before a final-logit cap c·tanh(z/c) (as
    `token_logprobs`). `inplace=True`: the backward writes ∂logits over the logits (the caller
    gives them up).
    """
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected a bool, got {type(inplace).__name__}")
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(f"logits: expected a tensor of shape (B, T, V), got {_describe(logits)}")

    def logprobs():
        return token_logprobs(logits, targets, temperature=temperature, softcap=softcap, return_entropy=True,
                              backend=backend)

    if torch.compiler.is_compiling():  # the custom ops trace; the deferred backward does not
        return composed(logprobs, advantages, mask, config, loss_args)
    name = _backend.resolve(backend, logits.device)
    temperature = check_logits_args(logits, targets, temperature, name)
    kernels = with_softcap(_backend.kernels(name), check_softcap(softcap))
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    decided = plan(config, kernels)
    warn_general_path(decided, name)
    # Without a gradient the fused kernel still pays: its statistics are the loss and the metrics,
    # one launch where the composition makes ~60 (on a GPU the forward was host-bound).
    if not needs_grad and decided.step is not Step.FORWARD:
        return composed(logprobs, advantages, mask, config, loss_args)
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace: the gradient can only overwrite contiguous logits (got a strided view)")
    inputs = LossInputs.build(config, shape=tuple(targets.shape), dtype=acc_dtype(logits), device=logits.device,
                              mask=mask, advantages=advantages, what="logits (B, T, V)", **loss_args)
    rows = logits_rows(logits, to_parent=needs_grad and not inplace)  # a (B, T, V) slice is read where it lies, not copied
    logits_pass = _OneTensor(kernels, rows.blocks, targets.reshape(-1).to(torch.int64), temperature)
    out, logp, entropy = run_step(logits_pass, decided.step, inputs, config)
    loss = out.loss
    if needs_grad:
        loss = deferred_logits_grad(loss, rows, logits_pass.targets, logits_pass.per_row, temperature, kernels, inplace)
    return LossOutput(loss, out.metrics, logp.view(targets.shape), entropy.view(targets.shape))


class _OneTensor:
    """The pass over one logits tensor, one launch per kernel (`_loss_step.LogitsPass`; per block only for a
    view whose dims do not collapse into two strides, `_rows.logits_rows`). Its gradient is deferred to
    the backward, one kernel pass over the logits from `per_row` = (lse_parts, H, ∂loss/∂ℓ, ∂loss/∂H or None)."""

    def __init__(self, kernels, blocks, targets: Tensor, temperature: float):
        self.kernels, self.blocks, self.targets, self.temperature = kernels, blocks, targets, temperature
        self.lse_parts = self.entropy = self.per_row = None

    def fused(self, forward: TokenForward):
        logp, entropy, lse_parts, grad_logp, grad_entropy, stats = run_blocks(
            self.kernels.policy_token_fwd, self.blocks, [self.targets, *forward.per_row], self.temperature,
            forward.params)
        self.per_row = (lse_parts, entropy, grad_logp, forward.entropy_grad(grad_entropy))
        return logp, entropy, stats

    def logprobs(self):
        logp, self.entropy, self.lse_parts = run_blocks(self.kernels.token_logprobs_fwd, self.blocks, [self.targets],
                                                        self.temperature, True)
        return logp, self.entropy

    def backward(self, grad_logp, grad_entropy):
        self.per_row = (self.lse_parts, self.entropy, grad_logp, grad_entropy)


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
