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

from .. import _backend
from .._dtypes import acc_dtype
from ..kernels.token_loss_params import NUM_STATS
from ..losses import LossOutput, PolicyLossConfig
from ..losses.spec import LossInputs, takes_loss_args
from ._linear_head import HeadGrads, LinearHead, head_spec
from ._loss_step import TokenForward, composed, run_step
from ._plan import Step, plan, warn_general_path
from ._precomputed_grad import attach_grads
from .linear_token_logprobs import logprobs_of_head


@takes_loss_args
def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Optional[Tensor],
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
    chunk_size: Optional[int] = None,
    process_group=None,
    **loss_args,
) -> LossOutput:
    """`policy_loss(linear_token_logprobs(hidden, weight, targets, bias=bias), ...)` with the
    gradients for hidden, weight and bias computed in the forward.

    hidden `(B, T, H)`, weight `(V, H)`, bias `(V,)` or None, targets `(B, T)`; the other
    arguments are those of `policy_loss` and `linear_token_logprobs`. The entropy is always
    computed (the `entropy` metric, and the bonus when `entropy_coef != 0`).
    """
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden: expected shape (B, T, H), got {tuple(getattr(hidden, 'shape', ()))}")
    spec = head_spec(hidden, weight, bias, targets, temperature, softcap, backend, chunk_size, process_group)
    grad_on = torch.is_grad_enabled()
    need = [grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias)]
    decided = plan(config, _backend.kernels(spec.backend), forward=process_group is None)  # sharded: ℓ first
    warn_general_path(decided, spec.backend)
    # As `fused_policy_loss`: without a gradient, the forward kernel where it has the loss, else the definition;
    # under torch.compile the definition too (the gradients computed in the forward do not trace).
    if torch.compiler.is_compiling() or (not any(need) and decided.step is not Step.FORWARD):
        return composed(lambda: logprobs_of_head(hidden, weight, bias, targets, spec, True), advantages, mask, config,
                        loss_args)

    head = LinearHead(hidden, weight, bias, targets, spec)
    inputs = LossInputs.build(config, shape=tuple(targets.shape), dtype=acc_dtype(hidden), device=hidden.device,
                              mask=mask, advantages=advantages, what="hidden (B, T, H)", **loss_args)
    chunk_loop = _ChunkLoop(head, head.new_grads(*need) if any(need) else None)
    out, logp, entropy = run_step(chunk_loop, decided.step, inputs, config)
    loss = out.loss
    if chunk_loop.grads is not None:
        grads = head.finish(chunk_loop.grads)
        grad_hidden = None if grads.hidden is None else grads.hidden.view(hidden.shape)
        loss = attach_grads(loss, (hidden, weight, bias), (grad_hidden, grads.weight, grads.bias))
    return LossOutput(loss, out.metrics, logp.view(targets.shape), entropy.view(targets.shape))


class _ChunkLoop:
    """The pass over the head's logits, chunk by chunk through one buffer (`_loss_step.LogitsPass`); the
    gradients (`grads`, None without one) are accumulated as the pass goes."""

    def __init__(self, head: LinearHead, grads: Optional[HeadGrads]):
        self.head, self.kernels, self.grads = head, head.kernels, grads
        self.lse_parts = self.entropy = None

    def fused(self, forward: TokenForward):
        """Per chunk: the fused forward kernel, then (with a gradient) the backward kernel in place: each
        token's loss depends on that token alone, so the kernel's per-token derivatives are final."""
        head = self.head
        stats = torch.empty(head.n, NUM_STATS, dtype=forward.dtype, device=head.hidden.device)
        logps, entropies = [], []  # the chunks' own outputs, joined once at the end (not a copy per chunk)
        for s, e in head.chunks():
            buf = head.logits(s, e)
            logp, entropy, lse_parts, grad_logp, grad_entropy, stats[s:e] = head.policy_chunk(
                buf, s, e, forward.per_row, forward.params)
            if self.grads is not None:
                head.backward_chunk(buf, s, e, lse_parts, entropy, grad_logp, forward.entropy_grad(grad_entropy, s, e),
                                    self.grads)
            logps.append(logp)
            entropies.append(entropy)
        return _joined(logps, stats), _joined(entropies, stats), stats

    def logprobs(self):
        logp, self.entropy, self.lse_parts = self.head.forward(True)
        return logp, self.entropy

    def backward(self, grad_logp, grad_entropy):
        """The second pass: each chunk's logits again, for the gradients."""
        if self.grads is not None:
            self.head.backward(self.lse_parts, self.entropy, grad_logp, grad_entropy, self.grads)


def _joined(chunks, like: Tensor) -> Tensor:
    return torch.cat(chunks) if chunks else like.new_empty(0)
