"""`fused_linear_policy_loss`: from hidden states to the policy loss, never holding `(N, V)` logits.

Token-level losses (`config.ratio == "token"`: PPO, GRPO, DAPO, CISPO, ...) take ONE pass over
the rows, a handful of launches per chunk: logits = hidden_c @ weightᵀ (one matmul into a reused
buffer) → the backend's fused forward kernel (`policy_token_fwd`: log-probs, the token's loss,
its derivatives and statistics) → the backward kernel over the same buffer, in place →
∂hidden_c and ∂weight by matmuls. No autograd graph per chunk: each token's loss depends on that
token alone and every aggregation is a weighted sum, so the kernel's per-token derivatives are
final.

Other ratios couple the tokens of a row or group (and vocabulary-parallel heads merge per-row
statistics across ranks), so they take two passes: log-probs and entropy of all rows, the
`(B, T)` loss of `losses/` and its autograd step, then a second pass that recomputes the logits
for the gradients.

The gradients are attached to the loss (`attach_grads`); the backward only scales them by the
incoming gradient, ∂weight and ∂bias in the same pass that converts their fp32 accumulators.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.token_loss_params import NUM_STATS
from ..losses import LossOutput, PolicyLossConfig, policy_loss
from ..losses.spec import LossInputs
from ._loss_step import add_entropy_bonus, entropy_bonus_grad, kernel_inputs, row_grads
from ._token_stats import loss_from_stats
from ._precomputed_grad import attach_grads
from .._dtypes import acc_dtype
from ._linear_head import LinearHead, head_spec
from .linear_token_logprobs import linear_token_logprobs
from ._plan import Step, plan, warn_general_path


def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Optional[Tensor],
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    bias: Optional[Tensor] = None,
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
    backend: Optional[str] = None,
    chunk_size: Optional[int] = None,
    process_group=None,
) -> LossOutput:
    """`policy_loss(linear_token_logprobs(hidden, weight, targets, bias=bias), ...)` with the
    gradients for hidden, weight and bias computed in the forward.

    hidden `(B, T, H)`, weight `(V, H)`, bias `(V,)` or None, targets `(B, T)`; the other
    arguments are those of `policy_loss` and `linear_token_logprobs`. The entropy is always
    computed (the `entropy` metric, and the bonus when `entropy_coef != 0`).
    """
    loss_kwargs = dict(old_logp=old_logp, ref_logp=ref_logp, group_ids=group_ids, rewards=rewards,
                       num_items=num_items, num_seqs=num_seqs, is_weights=is_weights,
                       rollout_logp=rollout_logp, entropy_quantile_group=entropy_quantile_group)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden: expected shape (B, T, H), got {tuple(getattr(hidden, 'shape', ()))}")
    grad_on = torch.is_grad_enabled()
    need = [grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias)]
    if not any(need):  # nothing to differentiate: the plain composition, one pass
        logp, entropy = linear_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                              softcap=softcap, return_entropy=True, backend=backend, chunk_size=chunk_size,
                                              process_group=process_group)
        out = policy_loss(logp, advantages, mask, config, entropy=entropy, **loss_kwargs)
        return LossOutput(out.loss, out.metrics, logp, entropy)

    spec = head_spec(hidden, weight, bias, targets, temperature, softcap, backend, chunk_size, process_group)
    head = LinearHead(hidden, weight, bias, targets, spec)
    inputs = LossInputs.build(config, shape=tuple(targets.shape), dtype=acc_dtype(hidden), device=hidden.device,
                              mask=mask, advantages=advantages, what="hidden (B, T, H)", **loss_kwargs)
    grads = head.new_grads(*need)
    decided = plan(config, head.kernels, forward=process_group is None)  # a sharded head: the log-probs first
    warn_general_path(decided, spec.backend)
    if decided.step is Step.FORWARD:
        out, logp, entropy, grads = _one_pass(head, grads, inputs, config)
    else:
        out, logp, entropy, grads = _two_passes(head, grads, inputs, config)
    grad_hidden = None if grads.hidden is None else grads.hidden.view(hidden.shape)
    loss = attach_grads(out.loss, (hidden, weight, bias), (grad_hidden, grads.weight, grads.bias))
    return LossOutput(loss, out.metrics, logp.view(targets.shape), entropy.view(targets.shape))


def _one_pass(head: LinearHead, grads, inputs: LossInputs, config):
    """Token-level: per chunk, the fused forward kernel, then the backward kernel in place."""
    per_row, params = kernel_inputs(inputs, config)
    need_h = config.entropy_coef != 0
    bonus_grad = entropy_bonus_grad(inputs, config, inputs.dtype)  # a bonus apart from the loss: known up front
    stats = torch.empty(head.n, NUM_STATS, dtype=inputs.dtype, device=head.hidden.device)
    logps, entropies = [], []  # the chunks' own outputs, joined once at the end (not a copy per chunk)
    for s, e in head.chunks():
        buf = head.logits(s, e)
        logp, entropy, lse_parts, grad_logp, grad_entropy, stats[s:e] = head.policy_chunk(buf, s, e, per_row, params)
        if bonus_grad is not None:
            grad_entropy = bonus_grad[s:e]
        head.backward_chunk(buf, s, e, lse_parts, entropy, grad_logp, grad_entropy if need_h else None, grads)
        logps.append(logp)
        entropies.append(entropy)
    entropy = _joined(entropies, stats)
    out = loss_from_stats(stats, inputs)
    if bonus_grad is not None:
        out = add_entropy_bonus(out, bonus_grad, entropy, inputs)
    return out, _joined(logps, stats), entropy, head.finish(grads)


def _joined(chunks, like: Tensor) -> Tensor:
    return torch.cat(chunks) if chunks else like.new_empty(0)


def _two_passes(head: LinearHead, grads, inputs: LossInputs, config):
    """Any ratio: log-probs and entropy of all rows, the loss by `losses/`, then the gradient pass."""
    logp, entropy, lse_parts = head.forward(True)
    out, grad_logp, grad_entropy = row_grads(head.kernels, logp, entropy, inputs, config)
    return out, logp, entropy, head.backward(lse_parts, entropy, grad_logp, grad_entropy, grads)
