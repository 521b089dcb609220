"""`linear_token_logprobs`: per-token log-probs and entropy from hidden states (docs/design.md §4).

`token_logprobs(hidden @ weight.T + bias, targets)` without an `(N, V)` logits tensor: rows go
through in chunks, each chunk's logits are computed (`addmm`, in the hidden dtype) into ONE
reused buffer and read by the backend's kernels of the logits path. The forward keeps only
`lse_parts` (the row max and log-sum, kernels/__init__.py) and the entropy per row; the backward
recomputes each chunk's logits, lets the backend's backward kernel overwrite them with ∂logits,
and turns those into ∂hidden, ∂weight (summed in fp32 over chunks) and ∂bias. Extra memory: one
chunk (`_linear_head.default_rows`: ≤ 56 MiB on a CPU; on a GPU as large as the accumulator, at
least 4096 rows) plus, for half-precision weights, the fp32 ∂weight accumulator, plus O(N).

Vocabulary parallelism (`process_group`): each rank holds a slice of the rows of `weight` (and
of `bias`); targets are global ids. Each rank runs its kernels on its slice; the per-row
max and log-sum, the entropy sums and the target logit are merged with all-reduces of O(N)
numbers (docs/math.md §15).
The chunk buffer then has extra columns of −inf (`_linear_head.buffer_width`): the first is the
target of rows whose token lives on another rank, so the kernels need no notion of "no target
here"; the others pad the rows to a multiple of 16 elements.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._linear_head import HeadSpec, LinearHead, head_spec
from ._precomputed_grad import refuse_create_graph


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: HeadSpec, need_entropy: bool):
        logp, entropy, lse_parts = LinearHead(hidden, weight, bias, targets, spec).forward(need_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse_parts, entropy)
        ctx.spec, ctx.need_entropy = spec, need_entropy
        if not need_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_create_graph("linear_token_logprobs")
        hidden, weight, bias, targets, lse_parts, entropy = ctx.saved_tensors
        head = LinearHead(hidden, weight, bias, targets, ctx.spec)
        if grad_logp is None:
            grad_logp = lse_parts.new_zeros(lse_parts.shape[0])
        if not ctx.need_entropy:
            grad_entropy = None
        need = ctx.needs_input_grad
        grads = head.new_grads(need[0], need[1], need[2] and bias is not None)
        head.backward(lse_parts, entropy, grad_logp.reshape(-1), None if grad_entropy is None else grad_entropy.reshape(-1),
                      grads)
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
):
    """`token_logprobs(hidden @ weight.T + bias, targets, ...)` without materialising the logits.

    hidden `(..., H)`, weight `(V, H)` (may be the tied input embedding), bias `(V,)` or None,
    targets `(...)` integers in `[0, V)`, already aligned (the caller shifts). Returns fp32
    log-probs shaped like `targets`, or `(logp, entropy)` with `return_entropy`. Differentiable
    w.r.t. hidden, weight and bias. `softcap` c: the head applies a final-logit cap, the logits
    are c·tanh((hidden @ weight.T + bias)/c) (Gemma 2 and 3). `chunk_size`: rows per chunk (default:
    ≤ 56 MiB of logits on a CPU; on a GPU as many bytes as the fp32 ∂weight, at least 4096 rows).
    `process_group`: `weight`/`bias` hold this rank's slice of the vocabulary rows (slices in
    rank order), targets are global ids; the outputs are those of the whole vocabulary.
    """
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy: expected a bool, got {type(return_entropy).__name__}")
    spec = head_spec(hidden, weight, bias, targets, temperature, softcap, backend, chunk_size, process_group)
    logp, entropy = logprobs_of_head(hidden, weight, bias, targets, spec, return_entropy)
    return (logp, entropy) if return_entropy else logp


def logprobs_of_head(hidden, weight, bias, targets, spec: HeadSpec, need_entropy: bool):
    """(ℓ, H) shaped like `targets` of inputs `head_spec` has validated into `spec` (H: only with `need_entropy`)."""
    logp, entropy = _LinearTokenLogprobs.apply(hidden, weight, bias, targets, spec, need_entropy)
    return logp.view(targets.shape), entropy.view(targets.shape) if need_entropy else entropy
