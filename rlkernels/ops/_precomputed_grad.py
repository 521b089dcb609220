"""`attach_grads`: a loss value whose gradients were already computed in the forward.

The hidden-state path runs the backward passes over each chunk's logits inside its forward
(recomputing the logits would cost another matmul); autograd only has to hand the stored
gradients of hidden, weight and bias to the inputs, times the incoming gradient of the loss, in
the inputs' dtypes. Nothing of their size is copied: a gradient stored in its input's dtype is
scaled where it lies (not at all when the scale is known to be 1), and a higher-precision
accumulator is converted and scaled in one pass. Products of sizes N × H and V × H, never of
N × V, on the device without a sync.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ._gpu_like import gpu_like


def refuse_create_graph(what: str = "the fused losses"):
    """Called in the backward of `what`, whose gradient comes from kernels, which are not differentiable
    again: a double backward must fail loudly rather than return zeros."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"create_graph=True is not supported by {what} (the gradient comes from kernels, not "
                           "differentiable again); for higher-order gradients take the log-probs from torch "
                           "(log_softmax(logits / temperature).gather(-1, targets)) and pass them to policy_loss")


def _known_one(scale: Tensor) -> bool:
    """Whether `scale` is 1 as far as the host knows without a copy: a plain CPU tensor is read where
    it lies (`tolist` runs no op); a device or fake one is not read. `loss.backward()` on a GPU
    therefore scales by its 1: N × H + V × H elements, against the path's N × V."""
    return type(scale) is Tensor and scale.device.type == "cpu" and scale.tolist() == 1


class _PrecomputedGrad(torch.autograd.Function):
    """Returns `loss`; its gradient w.r.t. each of the k inputs is the matching precomputed one
    times the incoming gradient, in the input's dtype. Arguments: `loss, *inputs, *grads` (k of each)."""

    @staticmethod
    def forward(ctx, loss, *inputs_and_grads):
        k = len(inputs_and_grads) // 2
        ctx.dtypes = [x.dtype for x in inputs_and_grads[:k]]
        ctx.scaled = False
        # Saved, not kept on ctx: autograd drops them right after this node's backward, so the
        # tensors it returns are the only references left and the leaves' .grad takes them as they are.
        ctx.save_for_backward(*inputs_and_grads[k:])
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        if ctx.scaled:
            raise RuntimeError("fused_linear_policy_loss: a second backward through the same graph (retain_graph=True) "
                               "is not supported: the first scaled the precomputed gradients in place (no copy of "
                               "them is kept); call fused_linear_policy_loss again")
        scale = None if _known_one(grad_out) else grad_out
        grads = []
        for stored, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            grad, in_place = _scaled(stored, dtype, scale)
            ctx.scaled |= in_place
            grads.append(grad)
        return (None, *grads, *(None,) * len(grads))


def _scaled(stored: Tensor, dtype: torch.dtype, scale: Optional[Tensor]):
    """(stored × scale in `dtype`, whether `stored` itself was scaled); `scale` None means 1."""
    if scale is None:
        return stored.to(dtype), False  # stored itself when it is in `dtype`
    if stored.dtype == dtype:
        return stored.mul_(scale), True
    if not gpu_like(stored):  # a CPU's mul into another dtype makes a temporary of stored's size
        return stored.mul_(scale).to(dtype), True
    # a GPU casts as it stores: the accumulator read once, the gradient written once
    return torch.mul(stored, scale, out=torch.empty_like(stored, dtype=dtype)), False


def attach_grads(loss: Tensor, inputs: Sequence[Optional[Tensor]], grads: Sequence[Optional[Tensor]]) -> Tensor:
    """`loss` (detached) as a differentiable function of `inputs` whose gradients are `grads`
    (in the inputs' dtypes or an accumulation dtype; the backward may scale them in place).

    Pairs with a `None` input or gradient are skipped (an input that needs no gradient)."""
    pairs = [(x, g) for x, g in zip(inputs, grads) if x is not None and g is not None]
    return _PrecomputedGrad.apply(loss, *(x for x, _ in pairs), *(g for _, g in pairs))
