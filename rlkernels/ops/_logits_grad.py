"""`deferred_logits_grad`: the loss of the fused logits path, whose backward is one kernel pass.

The forward has computed, per row, the derivatives g = ∂loss/∂logp and h = ∂loss/∂H. The
backward scales them by the incoming gradient (an `(N,)` product on the device: no host sync,
no N × V rescaling) and runs the backend's backward kernel over the logits, writing ∂logits into
a new buffer or, in place, over the logits themselves.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._precomputed_grad import refuse_create_graph


class _LogitsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits, state):
        ctx.save_for_backward(logits)  # autograd then refuses a backward after the logits were modified
        ctx.state = state
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        (logits,) = ctx.saved_tensors
        return None, ctx.state.grad(logits, grad_out), None


class _State:
    """What the backward needs besides the logits: the row blocks, targets and per-row values."""

    def __init__(self, blocks, targets, rows, temperature, kernels, inplace):
        self.blocks, self.targets, self.temperature, self.kernels, self.inplace = (
            blocks, targets, temperature, kernels, inplace)
        self.lse_parts, self.entropy, self.grad_logp, self.grad_entropy = rows

    def grad(self, logits: Tensor, grad_out: Tensor) -> Tensor:
        scale = grad_out.to(self.grad_logp.dtype)
        g = self.grad_logp * scale
        h = None if self.grad_entropy is None else self.grad_entropy * scale
        if not self.inplace and len(self.blocks) == 1:  # the backend allocates (the CPU one asks for huge pages)
            block = self.blocks[0][2]
            return self.kernels.token_logprobs_bwd(block, self.targets, self.lse_parts, self.entropy, g, h,
                                                   self.temperature).view(logits.shape)
        grad = logits.detach() if self.inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        out = grad.view(-1, logits.shape[-1])
        for s, e, block in self.blocks:
            self.kernels.token_logprobs_bwd(block, self.targets[s:e], self.lse_parts[s:e], self.entropy[s:e], g[s:e],
                                            None if h is None else h[s:e], self.temperature, out=out[s:e])
        if self.inplace:  # so that autograd refuses any node that saved the logits (they now hold ∂logits)
            torch.autograd.graph.increment_version(logits)
        return grad


def deferred_logits_grad(loss: Tensor, logits: Tensor, blocks, targets: Tensor, rows, temperature: float,
                         kernels, inplace: bool) -> Tensor:
    """`loss` (detached, 0-d) as a function of `logits` whose backward is the backend's kernel.

    `rows = (lse_parts, entropy, grad_logp, grad_entropy or None)` over the rows of `blocks`: `(N, 2)`, the
    others `(N,)`."""
    return _LogitsGrad.apply(loss, logits, _State(blocks, targets, rows, temperature, kernels, inplace))
