"""The backward over logits shared by the ops on logits: `logits_grad` writes ∂logits with the backend's
kernel, one launch per block of `_rows.LogitsRows` (one for any view that the kernels' batch stride
expresses), into a new buffer (of the parent's shape for a box view, `_rows.LogitsRows`) or
over the logits themselves; `deferred_logits_grad` is the loss of the fused logits path, whose backward
is that one kernel pass.

The fused forward has computed, per row, the derivatives g = ∂loss/∂logp and h = ∂loss/∂H. The
backward scales them by the incoming gradient (an `(N,)` product on the device: no host sync,
no N × V rescaling) and runs the backward kernel over the logits.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._precomputed_grad import refuse_create_graph
from ._rows import LogitsRows


def logits_grad(rows: LogitsRows, kernels, targets: Tensor, lse_parts: Tensor, entropy: Tensor, g: Tensor,
                h: Optional[Tensor], temperature: float, inplace: bool = False) -> Tensor:
    """∂ of `rows.grad_input` from the per-row derivatives `g` (w.r.t. logp) and `h` (w.r.t. H, or None)
    of the rows of `rows.blocks`. `inplace`: written over the (contiguous) logits."""
    block = rows.blocks[0][2]
    if not inplace and rows.box is None and len(rows.blocks) == 1 and block.is_contiguous():
        # the backend allocates (the CPU one asks for huge pages)
        return kernels.token_logprobs_bwd(block, targets, lse_parts, entropy, g, h,
                                          temperature).view(rows.grad_input.shape)
    if inplace:
        grad = rows.logits.detach()  # a new tensor object: autograd hands it to .grad without a copy
        outs = [block for _, _, block in rows.blocks]
    else:
        grad, outs = rows.new_grad()
    for (s, e, block), out in zip(rows.blocks, outs):
        kernels.token_logprobs_bwd(block, targets[s:e], lse_parts[s:e], entropy[s:e], g[s:e],
                                   None if h is None else h[s:e], temperature, out=out)
    return grad


class _LogitsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, grad_input, state):
        ctx.save_for_backward(grad_input)  # autograd then refuses a backward after the logits were modified
        ctx.state = state
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        (grad_input,) = ctx.saved_tensors
        return None, ctx.state.grad(grad_input, grad_out), None


class _State:
    """What the backward needs besides the logits: their rows, the targets and the per-row values."""

    def __init__(self, rows, targets, per_row, temperature, kernels, inplace):
        self.rows, self.targets, self.temperature, self.kernels, self.inplace = (
            rows, targets, temperature, kernels, inplace)
        self.lse_parts, self.entropy, self.grad_logp, self.grad_entropy = per_row

    def grad(self, grad_input: Tensor, grad_out: Tensor) -> Tensor:
        scale = grad_out.to(self.grad_logp.dtype)
        g = self.grad_logp * scale
        h = None if self.grad_entropy is None else self.grad_entropy * scale
        grad = logits_grad(self.rows, self.kernels, self.targets, self.lse_parts, self.entropy, g, h,
                           self.temperature, self.inplace)
        if self.inplace:  # so that autograd refuses any node that saved the logits (they now hold ∂logits)
            torch.autograd.graph.increment_version(grad_input)
        return grad


def deferred_logits_grad(loss: Tensor, rows: LogitsRows, targets: Tensor, per_row, temperature: float,
                         kernels, inplace: bool) -> Tensor:
    """`loss` (detached, 0-d) as a function of `rows.grad_input` whose backward is the backend's kernel.

    `per_row = (lse_parts, entropy, grad_logp, grad_entropy or None)` over the rows of `rows.blocks`:
    `(N, 2)`, the others `(N,)`."""
    return _LogitsGrad.apply(loss, rows.grad_input, _State(rows, targets, per_row, temperature, kernels, inplace))
