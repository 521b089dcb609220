"""`attach_grads`: a loss value whose gradients were already computed in the forward.

The hidden-state path runs the backward passes over each chunk's logits inside its forward
(recomputing the logits would cost another matmul); autograd only has to hand the stored
gradients of hidden, weight and bias to the inputs, rescaled by the incoming gradient of the
loss: products of their sizes (N × H, V × H), never of N × V, on the device without a sync.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def refuse_create_graph():
    """Called in a fused loss's backward: its gradients come from kernels, which are not
    differentiable again, so a double backward must fail loudly rather than return zeros."""
    if torch.is_grad_enabled():
        raise RuntimeError("create_graph=True is not supported by the fused losses (their gradients come from "
                           "kernels, not differentiable again); compose policy_loss with token_logprobs / "
                           "linear_token_logprobs for higher-order gradients")


class _PrecomputedGrad(torch.autograd.Function):
    """Returns `loss`; its gradient w.r.t. each of the k inputs is the matching precomputed one
    times the incoming gradient. Arguments: `loss, *inputs, *grads` (k of each)."""

    @staticmethod
    def forward(ctx, loss, *inputs_and_grads):
        k = len(inputs_and_grads) // 2
        # Scaled out of place in the backward: in place would break a second backward (gradcheck,
        # retain_graph) and could rescale a gradient autograd already handed to a leaf's .grad.
        ctx.save_for_backward(*inputs_and_grads[k:])
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        grads = tuple(g * grad_out.to(g.dtype) for g in ctx.saved_tensors)
        return (None, *grads, *(None,) * len(grads))


def attach_grads(loss: Tensor, inputs: Sequence[Optional[Tensor]], grads: Sequence[Optional[Tensor]]) -> Tensor:
    """`loss` (detached) as a differentiable function of `inputs` whose gradients are `grads`.

    Pairs with a `None` input or gradient are skipped (an input that needs no gradient)."""
    pairs = [(x, g) for x, g in zip(inputs, grads) if x is not None and g is not None]
    return _PrecomputedGrad.apply(loss, *(x for x, _ in pairs), *(g for _, g in pairs))
