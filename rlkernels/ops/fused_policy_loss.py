"""`fused_policy_loss`: from logits to the policy loss with ∂logits computed in the forward.

One pass reads the logits for log-probs, entropy and logsumexp; the loss of `losses/` runs on
those `(B, T)` values (its own autograd gives ∂loss/∂logp and ∂loss/∂H, a [B, T]-sized step
that also covers sequence-level ratios); one more pass writes ∂logits. The backward only
rescales by the incoming gradient. With `inplace=True` the gradient overwrites the logits, so
the loss head needs no second N × V buffer: the caller gives up the logits.

The loss formula lives only in `losses/`; the kernels know only the per-token derivative of
DESIGN.md §2. Under `torch.compile` the same values come from the composition
`policy_loss(token_logprobs(...))`, which traces through the registered ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _backend
from ..losses import LossOutput, PolicyLossConfig, policy_loss
from ._precomputed_grad import attach_grads
from .token_logprobs import check_token_logprobs_args, row_blocks, token_logprobs


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
    temperature: float = 1.0,
    inplace: bool = False,
    backend: Optional[str] = None,
) -> LossOutput:
    """`policy_loss(token_logprobs(logits, targets), ...)` in one call, without its N × V temporaries.

    logits `(B, T, V)`, targets `(B, T)`; the other arguments are those of `policy_loss`. The
    entropy is always computed (the `entropy` metric, and the bonus when `entropy_coef != 0`).
    """
    loss_kwargs = dict(old_logp=old_logp, ref_logp=ref_logp, group_ids=group_ids, rewards=rewards,
                       num_items=num_items, num_seqs=num_seqs)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected a bool, got {type(inplace).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"logits: expected shape (B, T, V), got {tuple(logits.shape)}")
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and logits.requires_grad):
        logp, entropy = token_logprobs(logits, targets, temperature=temperature, return_entropy=True, backend=backend)
        return policy_loss(logp, advantages, mask, config, entropy=entropy, **loss_kwargs)

    temperature = check_token_logprobs_args(logits, targets, temperature)
    name = _backend.resolve(backend, logits.device)
    kernels = _backend.kernels(name)
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace: the gradient can only overwrite contiguous logits (got a strided view)")
    blocks = row_blocks(logits.detach())  # a (B, T, V) slice is read block by block, not copied
    flat_targets = targets.reshape(-1).to(torch.int64)
    fwd = [kernels.token_logprobs_fwd(block, flat_targets[s:e], temperature, True) for s, e, block in blocks]
    logp, entropy, lse = (torch.cat(parts) for parts in zip(*fwd))

    with torch.enable_grad():
        logp_leaf = logp.view(targets.shape).requires_grad_(True)
        entropy_leaf = entropy.view(targets.shape).requires_grad_(config.entropy_coef != 0)
        out = policy_loss(logp_leaf, advantages, mask, config, entropy=entropy_leaf, **loss_kwargs)
        leaves = (logp_leaf, entropy_leaf) if entropy_leaf.requires_grad else (logp_leaf,)
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    grad_logp = torch.zeros_like(logp) if grads[0] is None else grads[0].reshape(-1)
    grad_entropy = grads[1].reshape(-1) if len(grads) > 1 and grads[1] is not None else None
    grad = logits.detach() if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    grad_blocks = grad.view(-1, logits.shape[-1]).split([e - s for s, e, _ in blocks])
    grad_logp = grad_logp.contiguous()
    for (s, e, block), out_block in zip(blocks, grad_blocks):
        kernels.token_logprobs_bwd(block, flat_targets[s:e], lse[s:e], entropy[s:e], grad_logp[s:e],
                                   None if grad_entropy is None else grad_entropy[s:e], temperature, out=out_block)
    loss = attach_grads(out.loss.detach(), (logits,), (grad,))
    return LossOutput(loss, out.metrics)
