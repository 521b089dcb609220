"""`linear_token_logprobs`: per-token log-probs and entropy from hidden states (docs/design.md §4).

`token_logprobs(hidden @ weight.T + bias, targets)` without an `(N, V)` logits tensor. The logits are
formed a piece at a time (`matmul`, in the hidden dtype) into ONE reused buffer and read by the
backend's kernels of the logits path; the pieces are row chunks or vocabulary blocks, whichever design
`_head_design.choose` takes within `memory_budget`. The forward keeps only `lse_parts` (the row max and
log-sum, kernels/__init__.py) and the entropy per row, and leaves its last piece's logits in the buffer;
the backward starts from those, recomputes the others, lets the backend's backward kernel overwrite them
with ∂logits, and turns those into ∂hidden, ∂weight and ∂bias (row chunks: ∂weight summed in fp32 over
several chunks; vocabulary blocks: ∂hidden summed in fp32, each block's ∂weight rows written once).

Vocabulary parallelism (`process_group`): each rank holds a slice of the rows of `weight` (and
of `bias`); targets are global ids. Each rank runs its kernels on its slice; the per-row
max and log-sum, the entropy sums and the target logit are merged with all-reduces of O(N)
numbers (docs/math.md §15).
The buffer then has extra columns of −inf (`_head_design.buffer_width`): the first is the
target of rows whose token lives on another rank, so the kernels need no notion of "no target
here"; the others pad the rows to a multiple of 16 elements (as they do for any V).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._head_design import MEMORY_BUDGET
from ._heads import make_head
from ._linear_head import HeadSpec, head_spec
from ._precomputed_grad import refuse_create_graph


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: HeadSpec, need_entropy: bool):
        head = make_head(hidden, weight, bias, targets, spec)
        logp, entropy, lse_parts = head.forward(need_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse_parts, entropy)
        ctx.spec, ctx.need_entropy = spec, need_entropy
        # the head with its last piece's logits, for the backward (not under compile: a plain object on ctx)
        ctx.head = None if torch.compiler.is_compiling() else head
        if not need_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_create_graph("linear_token_logprobs")
        hidden, weight, bias, targets, lse_parts, entropy = ctx.saved_tensors  # raises if changed in place
        head = ctx.head or make_head(hidden, weight, bias, targets, ctx.spec)
        if grad_logp is None:
            grad_logp = lse_parts.new_zeros(lse_parts.shape[0])
        if not ctx.need_entropy:
            grad_entropy = None
        need = ctx.needs_input_grad
        grads = head.new_grads(need[0], need[1], need[2] and bias is not None)
        head.backward(lse_parts, entropy, grad_logp.reshape(-1), None if grad_entropy is None else grad_entropy.reshape(-1),
                      grads)
        head.drop_buffer()  # before the conversions; a second backward (retain_graph) computes every piece again
        grads = head.finish(grads).to(weight.dtype)
        grad_hidden = None if grads.hidden is None else grads.hidden.view(hidden.shape)
        return grad_hidden, grads.weight, grads.bias, None, None, None


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    return_entropy: bool = False,
    backend: Optional[str] = None,
    chunk_size: Optional[int] = None,
    process_group=None,
    memory_budget: Optional[float] = MEMORY_BUDGET,
):
    """`token_logprobs(hidden @ weight.T + bias, targets, ...)` without materialising the logits.

    hidden `(..., H)`, weight `(V, H)` (may be the tied input embedding), bias `(V,)` or None,
    targets `(...)` integers in `[0, V)`, already aligned (the caller shifts). Returns fp32
    log-probs shaped like `targets`, or `(logp, entropy)` with `return_entropy`. Differentiable
    w.r.t. hidden, weight and bias. `softcap` c: the head applies a final-logit cap, the logits
    are c·tanh((hidden @ weight.T + bias)/c) (Gemma 2 and 3).
    `memory_budget`: the extra memory the call may take (beyond its inputs, outputs and gradients), as a
    fraction of the `(N, V)` logits it avoids (in hidden's dtype; 16 MiB is allowed whatever the
    fraction). Within it the fastest design: row chunks (3 GEMMs) where they fit, else vocabulary blocks
    as wide as fit (4 GEMMs; at N = 8192, H = 4096, V = 151936 in bf16 row chunks take 100% or more,
    blocks 10%). `memory_budget=None` chooses speed: row chunks, whatever their memory.
    `chunk_size`: row chunks of that many rows, whatever the budget.
    `process_group`: `weight`/`bias` hold this rank's slice of the vocabulary rows (slices in
    rank order), targets are global ids; the outputs are those of the whole vocabulary.
    """
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy: expected a bool, got {type(return_entropy).__name__}")
    spec = head_spec(hidden, weight, bias, targets, temperature, softcap, backend, chunk_size, process_group,
                     memory_budget)
    logp, entropy = logprobs_of_head(hidden, weight, bias, targets, spec, return_entropy)
    return (logp, entropy) if return_entropy else logp


def logprobs_of_head(hidden, weight, bias, targets, spec: HeadSpec, need_entropy: bool):
    """(ℓ, H) shaped like `targets` of inputs `head_spec` has validated into `spec` (H: only with `need_entropy`)."""
    logp, entropy = _LinearTokenLogprobs.apply(hidden, weight, bias, targets, spec, need_entropy)
    return logp.view(targets.shape), entropy.view(targets.shape) if need_entropy else entropy
