"""`fused_linear_policy_loss`: from hidden states to the policy loss, never holding `(N, V)` logits.

Token-level losses (`config.ratio == "token"`: PPO, GRPO, DAPO, CISPO, ...) take ONE pass over
the rows: per chunk, logits = hidden_c @ weightᵀ → forward kernel (logp, H, lse) → the chunk's
per-token loss times its aggregation weights (`per_token_loss` and `aggregation_weights`, the
same code `policy_loss` runs) → ∂loss/∂logp, ∂loss/∂H by autograd on chunk-sized vectors →
backward kernel over the same logits → ∂hidden_c, ∂weight, ∂bias. This works because each
token's loss depends on that token alone and every aggregation is a weighted sum.

Other ratios couple the tokens of a row or group, so they take two passes: log-probs and
entropy of all rows, the `(B, T)` loss and its autograd step, then a second pass that
recomputes the logits for the gradients. Vocabulary-parallel heads also take two passes (their
per-row statistics are merged across ranks once, between the passes).

Either way the loss value and the metrics come from `policy_loss` on the final `(B, T)` log-probs
and entropy, so they have one formula; the gradients are attached like those of
`fused_policy_loss`, and the backward only rescales them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..losses import LossOutput, PolicyLossConfig, policy_loss
from ..losses.aggregation import aggregation_weights, masked_sum_rows
from ..losses.policy_loss import per_token_loss, prepare_batch
from ..losses.surrogates import Batch
from ._precomputed_grad import attach_grads
from .linear_token_logprobs import LinearHead, head_spec, linear_token_logprobs


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
    temperature: float = 1.0,
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
                       num_items=num_items, num_seqs=num_seqs)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden: expected shape (B, T, H), got {tuple(getattr(hidden, 'shape', ()))}")
    grad_on = torch.is_grad_enabled()
    need = [grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias)]
    if not any(need):  # nothing to differentiate: the plain composition, one pass
        logp, entropy = linear_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                              return_entropy=True, backend=backend, chunk_size=chunk_size,
                                              process_group=process_group)
        return policy_loss(logp, advantages, mask, config, entropy=entropy, **loss_kwargs)

    spec = head_spec(hidden, weight, bias, targets, temperature, backend, chunk_size, process_group)
    head = LinearHead(hidden, weight, bias, targets, spec)
    grads = head.new_grads(*need)
    if config.ratio == "token" and process_group is None:
        logp, entropy = _token_level_pass(head, grads, advantages, mask, config, loss_kwargs)
        grads = head.finish(grads)
    else:
        logp, entropy, lse = head.forward(True)
        with torch.enable_grad():
            logp_leaf = logp.view(targets.shape).requires_grad_(True)
            entropy_leaf = entropy.view(targets.shape).requires_grad_(config.entropy_coef != 0)
            out = policy_loss(logp_leaf, advantages, mask, config, entropy=entropy_leaf, **loss_kwargs)
            leaves = (logp_leaf, entropy_leaf) if entropy_leaf.requires_grad else (logp_leaf,)
            d = torch.autograd.grad(out.loss, leaves, allow_unused=True)
        grad_logp = torch.zeros_like(logp) if d[0] is None else d[0].reshape(-1)
        grad_entropy = d[1].reshape(-1) if len(d) > 1 and d[1] is not None else None
        grads = head.backward(lse, entropy, grad_logp, grad_entropy, grads)
    with torch.no_grad():
        out = policy_loss(logp.view(targets.shape), advantages, mask, config, entropy=entropy.view(targets.shape),
                          **loss_kwargs)
    grad_hidden = None if grads.hidden is None else grads.hidden.view(hidden.shape)
    loss = attach_grads(out.loss.detach(), (hidden, weight, bias), (grad_hidden, grads.weight, grads.bias))
    return LossOutput(loss, out.metrics)


def _token_level_pass(head: LinearHead, grads, advantages, mask, config, loss_kwargs):
    """The one pass of token-level losses; returns the flat (logp, entropy) and fills `grads`."""
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] * mask.shape[1] != head.n:
        raise ValueError(f"mask: expected shape (B, T) matching hidden's (B, T, H), got {tuple(getattr(mask, 'shape', ()))}")
    acc = torch.float64 if head.hidden.dtype == torch.float64 else torch.float32
    placeholder = torch.zeros(mask.shape, dtype=acc, device=head.hidden.device)
    # Validation, masking and broadcasting of the (B, T) inputs, once; the chunks slice the result.
    b, ref_logp, _ = prepare_batch(placeholder, advantages, mask, config, loss_kwargs["old_logp"], loss_kwargs["ref_logp"],
                                   placeholder if config.entropy_coef != 0 else None, loss_kwargs["group_ids"],
                                   loss_kwargs["rewards"], loss_kwargs["num_items"], loss_kwargs["num_seqs"])
    weights = aggregation_weights(b.mask, config.agg, num_items=loss_kwargs["num_items"],
                                  num_seqs=loss_kwargs["num_seqs"], norm_length=config.norm_length, dtype=acc)
    flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
    on_policy = loss_kwargs["old_logp"] is None
    mask_f, adv_f, old_f, ref_f, w_f = map(flat, (b.mask, b.adv, b.old_logp, ref_logp, weights))
    need_h = config.entropy_coef != 0
    zero = torch.zeros((), dtype=acc, device=placeholder.device)

    logp = torch.empty(head.n, dtype=acc, device=placeholder.device)
    entropy = torch.empty_like(logp)
    for s, e in head.chunks():
        buf = head.logits(s, e)
        lp, ent, lse = head.forward_chunk(buf, s, e, True)
        logp[s:e], entropy[s:e] = lp, ent
        m = mask_f[s:e][None]
        with torch.enable_grad():  # the chunk's share of the loss, as a (1, n) "batch"
            lp_leaf = lp[None].detach().requires_grad_(True)
            ent_leaf = ent[None].detach().requires_grad_(need_h)
            lp_m = torch.where(m, lp_leaf, zero)
            old = lp_m.detach() if on_policy else old_f[s:e][None]
            chunk = Batch(lp_m, old, m, None, adv_f[s:e][None], None, None, 0, None)
            per_token, _, _ = per_token_loss(chunk, config, None if ref_f is None else ref_f[s:e][None],
                                             torch.where(m, ent_leaf, zero) if need_h else None)
            share = masked_sum_rows(per_token * w_f[s:e][None], m).sum()
            leaves = (lp_leaf, ent_leaf) if need_h else (lp_leaf,)
            d = torch.autograd.grad(share, leaves, allow_unused=True)
        grad_logp = torch.zeros_like(lp) if d[0] is None else d[0].reshape(-1)
        grad_entropy = d[1].reshape(-1) if need_h and d[1] is not None else None
        head.backward_chunk(buf, s, e, lse, ent, grad_logp, grad_entropy, grads)
    return logp, entropy
