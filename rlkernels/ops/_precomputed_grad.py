"""`attach_grads`: a loss value whose gradients were already computed in the forward.

The fused losses (logits path and hidden-state path) run the backward passes over the logits
inside their forward; autograd only has to hand the stored gradients to the inputs, rescaled
by the incoming gradient of the loss.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


class _PrecomputedGrad(torch.autograd.Function):
    """Returns `loss`; its gradient w.r.t. each of the k inputs is the matching precomputed one
    times the incoming gradient. Arguments: `loss, *inputs, *grads` (k of each)."""

    @staticmethod
    def forward(ctx, loss, *inputs_and_grads):
        k = len(inputs_and_grads) // 2
        ctx.save_for_backward(*inputs_and_grads[k:])
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.saved_tensors
        if not bool(grad_out == 1):  # the usual case (loss.backward()) needs no product of the size of the inputs
            grads = tuple(g * grad_out.to(g.dtype) for g in grads)
        return (None, *grads, *(None,) * len(grads))


def attach_grads(loss: Tensor, inputs: Sequence[Optional[Tensor]], grads: Sequence[Optional[Tensor]]) -> Tensor:
    """`loss` (detached) as a differentiable function of `inputs` whose gradients are `grads`.

    Pairs with a `None` input or gradient are skipped (an input that needs no gradient)."""
    pairs = [(x, g) for x, g in zip(inputs, grads) if x is not None and g is not None]
    return _PrecomputedGrad.apply(loss, *(x for x, _ in pairs), *(g for _, g in pairs))
