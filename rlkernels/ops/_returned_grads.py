"""The per-token tensors a fused loss returns (`LossOutput.logp`, `.entropy`) as differentiable outputs.

The fused forward computes ℓ and H on the way and the loss's gradient without autograd, so they come out of the
kernels detached. `differentiable` gives them a node whose backward, only when an incoming gradient reaches them
(a term on `out.entropy` or `out.logp`), evaluates the op's own differentiable log-probs again (`recompute`,
e.g. `token_logprobs` or `linear_token_logprobs` of the same inputs) and hands their gradient to the inputs: one
more forward and backward of the log-probs, the cost of calling them apart. Unused, it costs nothing (no incoming
gradient is materialised, nothing runs). The inputs are saved, so a backward after they were overwritten (the
logits given with `inplace=True`) is refused by autograd rather than wrong.
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch
from torch import Tensor

from ._precomputed_grad import refuse_create_graph


class _Returned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recompute, logp, entropy, *inputs):
        ctx.set_materialize_grads(False)
        ctx.recompute = recompute
        ctx.save_for_backward(*inputs)
        return logp.view_as(logp), entropy.view_as(entropy)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        inputs = ctx.saved_tensors
        nothing = (None, None, None) + (None,) * len(inputs)
        if grad_logp is None and grad_entropy is None:
            return nothing
        refuse_create_graph("the log-probs and entropy a fused loss returns")
        wanted = [i for i, x in enumerate(inputs) if ctx.needs_input_grad[3 + i]]
        with torch.enable_grad():
            again = [x.detach().requires_grad_(i in wanted) for i, x in enumerate(inputs)]
            logp, entropy = ctx.recompute(*again)
            pairs = [(y, g) for y, g in ((logp, grad_logp), (entropy, grad_entropy)) if g is not None]
            grads = torch.autograd.grad([y for y, _ in pairs], [again[i] for i in wanted], [g for _, g in pairs],
                                        allow_unused=True)
        out = list(nothing)
        for i, g in zip(wanted, grads):
            out[3 + i] = g
        return tuple(out)


def differentiable(logp: Tensor, entropy: Tensor, inputs: Sequence[Tensor],
                   recompute: Callable[..., Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    """(ℓ, H) carrying the gradient `recompute(*inputs) -> (ℓ, H)` gives them w.r.t. `inputs` (None entries are
    not inputs); as they are when no input needs a gradient or grad mode is off."""
    given = [x for x in inputs if x is not None]
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in given)):
        return logp, entropy
    positions = [i for i, x in enumerate(inputs) if x is not None]

    def again(*xs):
        full = [None] * len(inputs)
        for i, x in zip(positions, xs):
            full[i] = x
        return recompute(*full)

    return _Returned.apply(again, logp, entropy, *given)
