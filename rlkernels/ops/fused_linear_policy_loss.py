"""`fused_linear_policy_loss`: from hidden states to the policy loss, never holding `(N, V)` logits.

Token-level losses (`config.ratio == "token"`: PPO, GRPO, DAPO, CISPO, ...) on row chunks take ONE
pass over the rows, a handful of launches per chunk: logits = hidden_c @ weightᵀ (one matmul into a
reused buffer) → the backend's fused forward kernel (`policy_token_fwd`: log-probs, the token's
loss, its derivatives and statistics) → the backward kernel over the same buffer, in place →
∂hidden_c and ∂weight by matmuls. No autograd graph per chunk: each token's loss depends on that
token alone and every aggregation is a weighted sum, so the kernel's per-token derivatives are
final. The gradients are attached to the loss (`attach_grads`); the backward only scales them by
the incoming gradient, ∂weight and ∂bias in the same pass that converts their fp32 accumulators.

Otherwise two passes: log-probs and entropy of all rows, the `(B, T)` loss and its per-row
derivatives (`_loss_step.row_grads`), and in autograd's backward a second pass that recomputes
the logits for the gradients, with those derivatives times the incoming gradient (`_SecondPass`).
So take other ratios (they couple the tokens of a row or group), vocabulary-parallel heads (they
merge per-row statistics across ranks) and vocabulary blocks (the design `memory_budget` chooses
where row chunks take too much memory: a row's statistics need every block first).
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
from ._head_design import MEMORY_BUDGET
from ._heads import make_head
from ._linear_head import HeadGrads, LinearHead, head_spec
from ._loss_step import TokenForward, composed, run_step
from ._plan import Step, plan, warn_general_path
from ._precomputed_grad import _known_one, attach_grads, refuse_create_graph
from ._returned_grads import differentiable
from .linear_token_logprobs import linear_token_logprobs, logprobs_of_head


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
    memory_budget: Optional[float] = MEMORY_BUDGET,
    **loss_args,
) -> LossOutput:
    """`policy_loss(linear_token_logprobs(hidden, weight, targets, bias=bias), ...)` with the
    gradients for hidden, weight and bias computed in the forward.

    hidden `(B, T, H)`, weight `(V, H)`, bias `(V,)` or None, targets `(B, T)`; the other
    arguments are those of `policy_loss` and `linear_token_logprobs`. The entropy is always
    computed (the `entropy` metric, and the bonus when `entropy_coef != 0`). `memory_budget` (the extra
    memory allowed as a fraction of the logits; None: speed first) and `chunk_size` choose the design as
    for `linear_token_logprobs`.
    """
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden: expected shape (B, T, H), got {tuple(getattr(hidden, 'shape', ()))}")
    spec = head_spec(hidden, weight, bias, targets, temperature, softcap, backend, chunk_size, process_group,
                     memory_budget)
    grad_on = torch.is_grad_enabled()
    need = [grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias)]
    fusable = process_group is None and spec.design.kind == "rows"  # sharded, vocabulary blocks: ℓ first
    decided = plan(config, _backend.kernels(spec.backend), forward=fusable)
    warn_general_path(decided, spec.backend)
    # As `fused_policy_loss`: without a gradient, the forward kernel where it has the loss, else the definition;
    # under torch.compile the definition too (the gradients computed in the forward do not trace).
    if torch.compiler.is_compiling() or (not any(need) and decided.step is not Step.FORWARD):
        return composed(lambda: logprobs_of_head(hidden, weight, bias, targets, spec, True), advantages, mask, config,
                        loss_args)

    head = make_head(hidden, weight, bias, targets, spec)
    inputs = LossInputs.build(config, shape=tuple(targets.shape), dtype=acc_dtype(hidden), device=hidden.device,
                              mask=mask, advantages=advantages, what="hidden (B, T, H)", **loss_args)
    one_pass = decided.step is Step.FORWARD
    chunk_loop = _ChunkLoop(head, head.new_grads(*need) if one_pass and any(need) else None)
    out, logp, entropy = run_step(chunk_loop, decided.step, inputs, config)
    loss = out.loss
    if chunk_loop.grads is not None:
        grads = head.finish(chunk_loop.grads)
        grad_hidden = None if grads.hidden is None else grads.hidden.view(hidden.shape)
        loss = attach_grads(loss, (hidden, weight, bias), (grad_hidden, grads.weight, grads.bias))
    elif not one_pass and any(need):
        loss = _SecondPass.apply(loss, chunk_loop, hidden, weight, bias)

    def logprobs_again(h, w, b):  # only when a gradient reaches the returned ℓ or H (`_returned_grads`)
        return linear_token_logprobs(h, w, targets, bias=b, temperature=temperature, softcap=softcap,
                                     return_entropy=True, backend=backend, chunk_size=chunk_size,
                                     process_group=process_group, memory_budget=memory_budget)

    logp, entropy = differentiable(logp.view(targets.shape), entropy.view(targets.shape), (hidden, weight, bias),
                                   logprobs_again)
    return LossOutput(loss, out.metrics, logp, entropy)


class _ChunkLoop:
    """The pass over the head's logits, piece by piece through one buffer (`_loss_step.LogitsPass`). One pass:
    the gradients (`grads`, None without one) are accumulated as it goes; two passes: the per-row derivatives
    are kept for `second_pass`, which autograd's backward runs."""

    def __init__(self, head: LinearHead, grads: Optional[HeadGrads]):
        self.head, self.kernels, self.grads = head, head.kernels, grads
        self.lse_parts = self.entropy = self.row_grads = None

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
                                    self.grads, first=s == 0)
            logps.append(logp)
            entropies.append(entropy)
        head.drop_buffer()
        return _joined(logps, stats), _joined(entropies, stats), stats

    def logprobs(self):
        logp, self.entropy, self.lse_parts = self.head.forward(True)
        return logp, self.entropy

    def backward(self, grad_logp, grad_entropy):
        """∂loss/∂ℓ and ∂loss/∂H per row, for the second pass."""
        self.row_grads = (grad_logp, grad_entropy)

    def second_pass(self, grad_out: Tensor, need_hidden: bool, need_weight: bool, need_bias: bool) -> HeadGrads:
        """The gradients of `grad_out` × the loss, in the parameters' dtype: each piece's logits again (the
        forward's last one is still in the buffer), with the per-row derivatives scaled first (O(N))."""
        head = self.head
        grad_logp, grad_entropy = self.row_grads
        if not _known_one(grad_out):
            grad_logp = grad_logp * grad_out
            grad_entropy = None if grad_entropy is None else grad_entropy * grad_out
        grads = head.new_grads(need_hidden, need_weight, need_bias)
        head.backward(self.lse_parts, self.entropy, grad_logp, grad_entropy, grads)
        head.drop_buffer()  # before the conversions; a second backward (retain_graph) computes every piece again
        return head.finish(grads).to(head.weight.dtype)


class _SecondPass(torch.autograd.Function):
    """Returns `loss`; its backward is the head's second pass (`_ChunkLoop.second_pass`) for hidden, weight
    and bias, the inputs after the loop."""

    @staticmethod
    def forward(ctx, loss, loop: _ChunkLoop, hidden, weight, bias):
        ctx.loop = loop
        ctx.save_for_backward(hidden, weight, bias)  # for autograd's check that none changed in place
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        hidden = ctx.saved_tensors[0]
        grads = ctx.loop.second_pass(grad_out, *ctx.needs_input_grad[2:])
        return None, None, None if grads.hidden is None else grads.hidden.view(hidden.shape), grads.weight, grads.bias


def _joined(chunks, like: Tensor) -> Tensor:
    return torch.cat(chunks) if chunks else like.new_empty(0)
