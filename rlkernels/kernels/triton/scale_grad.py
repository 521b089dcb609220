"""Triton ``scale_grad_`` (kernels/__init__.py): the two-pass path's backward, grad ×= incoming / assumed."""

import math

import torch
import triton
import triton.language as tl

from .launch import on_device

SCALE_BLOCK = 4096  # elements per program


@triton.jit
def _scale_grad_kernel(grad_ptr, grad_out_ptr, assumed_ptr, n, BLOCK: tl.constexpr):
    # read on the device (no host sync); every program returns at once when it is the assumed gradient
    incoming = tl.load(grad_out_ptr).to(tl.float64)
    assumed = tl.load(assumed_ptr)
    if incoming != assumed.to(grad_out_ptr.dtype.element_ty).to(tl.float64):
        ratio = (incoming / assumed).to(tl.float32)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        g = tl.load(grad_ptr + i, mask=inside).to(tl.float32)
        tl.store(grad_ptr + i, (g * ratio).to(grad_ptr.dtype.element_ty), mask=inside)


def scale_grad_(grad, grad_out, assumed):
    """``grad ×= grad_out / assumed`` in fp32 (contiguous fp32/bf16/fp16 ``grad``, ``grad_out`` one fp32 or fp64
    number on its device), unless ``grad_out`` equals ``assumed`` rounded to its dtype."""
    if not grad.is_contiguous():
        raise ValueError(f"grad: expected a contiguous tensor, got strides {grad.stride()}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"grad: expected dtype float32, bfloat16 or float16, got {grad.dtype}")
    if grad_out.numel() != 1 or grad_out.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"grad_out: expected one float32 or float64 number, got {tuple(grad_out.shape)} "
                         f"{grad_out.dtype}")
    if isinstance(assumed, bool) or not math.isfinite(assumed) or assumed == 0:
        raise ValueError(f"assumed: expected a finite nonzero number, got {assumed!r}")
    if grad.numel() == 0:
        return
    dev = grad.device
    with on_device(dev):
        _scale_grad_kernel[(triton.cdiv(grad.numel(), SCALE_BLOCK),)](
            grad, grad_out.to(dev), torch.full((), float(assumed), dtype=torch.float64, device=dev), grad.numel(),
            BLOCK=SCALE_BLOCK)
