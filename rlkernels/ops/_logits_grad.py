"""The backward over logits shared by the ops on logits: `logits_grad` writes ∂logits with the backend's
kernel, one launch per block of `_rows.LogitsRows` (one for any view that the kernels' batch stride
expresses), into a new buffer (of the parent's shape for a box view, `_rows.LogitsRows`) or
over the logits themselves (`grad_buffers`); `deferred_logits_grad` is the loss of the fused logits path,
whose backward is that one kernel pass.

The fused forward has computed, per row, the derivatives g = ∂loss/∂logp and h = ∂loss/∂H. The
backward scales them by the incoming gradient (an `(N,)` product on the device: no host sync,
no N × V rescaling) and runs the backward kernel over the logits.

The two-pass path (docs/design.md §2) writes ∂logits in the forward, for an incoming gradient it assumes;
`written_logits_grad` is its loss, whose backward hands that gradient to autograd, scaled in one pass
(`scale_grad_`) only when the incoming gradient differs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_on_device
from ._precomputed_grad import refuse_create_graph
from ._rows import LogitsRows


def logits_grad(rows: LogitsRows, kernels, targets: Tensor, lse_parts: Tensor, entropy: Tensor, g: Tensor,
                h: Optional[Tensor], temperature: float, inplace: bool = False) -> Tensor:
    """∂ of `rows.grad_input` from the per-row derivatives `g` (w.r.t. logp) and `h` (w.r.t. H, or None)
    of the rows of `rows.blocks`. `inplace`: written over the (contiguous) logits."""
    grad, outs = grad_buffers(rows, inplace)
    for (s, e, block), out in zip(rows.blocks, outs):
        written = kernels.token_logprobs_bwd(block, targets[s:e], lse_parts[s:e], entropy[s:e], g[s:e],
                                             None if h is None else h[s:e], temperature, out=out)
    return written.view(rows.grad_input.shape) if grad is None else grad


def grad_buffers(rows: LogitsRows, inplace: bool):
    """(the gradient of `rows.grad_input`, where each block's rows go): (None, [None]) when the backend's kernel
    allocates it (one contiguous block; the CPU one asks for huge pages), the logits themselves with `inplace`,
    else a new buffer (`LogitsRows.new_grad`)."""
    if not inplace and rows.box is None and len(rows.blocks) == 1 and rows.blocks[0][2].is_contiguous():
        return None, [None]
    if inplace:
        # a new tensor object: autograd hands it to .grad without a copy
        return rows.logits.detach(), [block for _, _, block in rows.blocks]
    return rows.new_grad()


class _LogitsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits, parent, probe, state):
        ctx.save_for_backward(logits, parent)  # autograd then refuses a backward after the logits were modified
        ctx.state = state
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        rows = ctx.state.rows
        target = rows.in_backward()
        grad = ctx.state.grad(target, grad_out)
        return (None, *rows.returned(target, grad), None)


class _State:
    """What the backward needs besides the logits: their rows, the targets and the per-row values."""

    def __init__(self, rows, targets, per_row, temperature, kernels, inplace):
        self.rows, self.targets, self.temperature, self.kernels, self.inplace = (
            rows, targets, temperature, kernels, inplace)
        self.lse_parts, self.entropy, self.grad_logp, self.grad_entropy = per_row

    def grad(self, rows: LogitsRows, grad_out: Tensor) -> Tensor:
        """∂ of `rows.grad_input` (these rows, or as `LogitsRows.in_backward` writes them)."""
        scale = grad_out.to(self.grad_logp.dtype)
        g = self.grad_logp * scale
        h = None if self.grad_entropy is None else self.grad_entropy * scale
        grad = logits_grad(rows, self.kernels, self.targets, self.lse_parts, self.entropy, g, h,
                           self.temperature, self.inplace)
        if self.inplace:  # so that autograd refuses any node that saved the logits (they now hold ∂logits)
            torch.autograd.graph.increment_version(rows.grad_input)
        return grad


def deferred_logits_grad(loss: Tensor, rows: LogitsRows, targets: Tensor, per_row, temperature: float,
                         kernels, inplace: bool) -> Tensor:
    """`loss` (detached, 0-d) as a function of `rows.grad_input` whose backward is the backend's kernel.

    `per_row = (lse_parts, entropy, grad_logp, grad_entropy or None)` over the rows of `rows.blocks`:
    `(N, 2)`, the others `(N,)`."""
    return _LogitsGrad.apply(loss, *rows.inputs(), _State(rows, targets, per_row, temperature, kernels, inplace))


class _WrittenGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits, parent, probe, state):
        ctx.state = state  # the logits are not read again: nothing of theirs is saved
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph()
        rows = ctx.state.rows
        target = rows.in_backward()
        grad = ctx.state.hand_over(grad_out)  # of rows.grad_input: the parent's shape for a box view
        if target is not rows:  # observed: the view's own gradient (its rows of the parent-shaped one)
            grad = grad[rows.box].view(rows.view.shape)
        return (None, *rows.returned(target, grad), None)


class _Written:
    """A gradient written by the forward for the incoming gradient `scale`, until the backward takes it."""

    def __init__(self, rows: LogitsRows, grad: Tensor, scale: float, kernels):
        self.rows, self.grad, self.scale, self.kernels = rows, grad, scale, kernels

    def hand_over(self, grad_out: Tensor) -> Tensor:
        if self.grad is None:
            raise RuntimeError("fused_policy_loss: a second backward through the same graph (retain_graph=True) is "
                               "not supported on the two-pass path: the first took the gradient its forward wrote "
                               "(no copy is kept); call fused_policy_loss again, or pass two_pass=False")
        if self.grad.element_size() == 2:
            _check_exact_rescale(self.grad.dtype, grad_out, self.scale)
        # not ours any more: autograd's .grad takes the tensor itself
        grad, self.grad = self.grad, None
        self.kernels.scale_grad_(grad, grad_out, self.scale)  # reads nothing of grad when grad_out == scale
        return grad


def _check_exact_rescale(dtype: torch.dtype, grad_out: Tensor, scale: float) -> None:
    """A 16-bit gradient written at `scale` is the three-pass one at `grad_out` only if rescaling it rounds
    nothing: bf16 by a power of two (it has fp32's exponents), fp16 by 1 (a smaller scale flushed entries the
    larger one keeps, a power of two below 1 can round subnormals again). Checked on the device, no sync."""
    ratio = grad_out.to(torch.float32) / float(torch.tensor(scale, dtype=torch.float32))
    exact = ratio == 1 if dtype == torch.float16 else torch.frexp(ratio).mantissa.abs() == 0.5
    check_on_device(exact, f"fused_policy_loss: the incoming gradient is not grad_scale={scale!r}"
                    + (" " if dtype == torch.float16 else " times a power of two ")
                    + f"and the two-pass path wrote a {dtype} gradient at grad_scale: rescaling it would round it "
                    "twice. Pass grad_scale equal to the incoming gradient (e.g. 1/k for (loss / k).backward()), "
                    "or two_pass=False", error=RuntimeError)


def written_logits_grad(loss: Tensor, rows: LogitsRows, grad: Tensor, scale: float, kernels) -> Tensor:
    """`loss` (detached, 0-d) as a function of `rows.grad_input`, whose gradient `grad` (contiguous, its shape)
    the forward wrote for an incoming gradient `scale`; any other incoming gradient g scales it by g / scale,
    one pass over it."""
    return _WrittenGrad.apply(loss, *rows.inputs(), _Written(rows, grad, scale, kernels))
