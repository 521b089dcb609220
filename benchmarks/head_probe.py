"""On a GPU: whether the matmul takes half-precision operands with an fp32 result, and which design the
hidden-state path ran, with its extra memory and time.

    python -m benchmarks.head_probe [--n 8192 --vocab 151936 --hidden 4096 --dtype bf16]

1. `torch.mm(a, b, out_dtype=torch.float32)` and `torch.addmm(acc, a.t(), a, out_dtype=..., out=acc)` on
   half-precision operands (the ∂W / ∂hidden GEMMs' fp32 accumulation without an fp32 copy of a chunk):
   accepted or refused (the exception), and its largest error against the product of the fp32 images.
2. `fused_linear_policy_loss` (GRPO, forward + backward) by default and with `memory_budget=None` (speed
   first): the design each ran, read from its GEMMs (recorded by a TorchDispatchMode; the first GEMM of a
   call computes logits: its output is (rows, ≥ V) for row chunks, (N, columns < V) for vocabulary
   blocks), the dtypes of the ∂W GEMMs, the extra peak above the inputs and their gradients as a fraction
   of the N·V logits the path avoids, and the time (`benchmarks.measure`: do_bench on CUDA).
Runs on CPU too (`--device cpu`, small sizes), where the GPU's choices are not taken.
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkernels.ops import _linear_head

GEMMS = ("mm", "addmm", "bmm", "baddbmm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def probe_out_dtype(dtype, device) -> list:
    """Lines saying whether mm / addmm take `dtype` operands with an fp32 result on `device`."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(256, 128, device=device, generator=g).to(dtype)
    b = torch.randn(128, 192, device=device, generator=g).to(dtype)
    exact = a.float() @ b.float()
    lines = []
    for name, run in (("mm(a, b, out_dtype=float32)", lambda: torch.mm(a, b, out_dtype=torch.float32)),
                      ("addmm(acc, a.t(), a, out_dtype=float32, out=acc)", lambda: _addmm_into(a))):
        try:
            got = run()
        except Exception as e:  # the answer is which exception, if any
            lines.append(f"{name}: refused: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}")
            continue
        want = exact if name.startswith("mm") else 2 * (a.float().t() @ a.float())
        err = (got.double() - want.double()).abs().max().item()
        lines.append(f"{name}: ran, result {str(got.dtype).replace('torch.', '')}, max |error| {err:.3g} "
                     f"against the fp32 product")
    return lines


def _addmm_into(a):
    acc = torch.empty(a.shape[1], a.shape[1], dtype=torch.float32, device=a.device)
    torch.mm(a.t(), a, out_dtype=torch.float32, out=acc)
    torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
    return acc


class GemmLog(TorchDispatchMode):
    """(op, output shape, operand dtype, output dtype) of every GEMM, in order."""

    def __init__(self):
        super().__init__()
        self.gemms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__.rstrip("_")
        if func.namespace == "aten" and name in GEMMS:
            operand = args[0] if name in ("mm", "bmm") else args[1]
            self.gemms.append((name, tuple(out.shape), operand.dtype, out.dtype))
        return out


def design(gemms, n, vocab, hidden) -> str:
    """The design of one call, read from its GEMMs (the first computes logits)."""
    if not gemms:
        return "no GEMM (not the hidden-state path?)"
    rows, cols = gemms[0][1][-2:]
    if cols >= vocab:
        kind = f"row chunks: {rows} rows × {cols} columns, {-(-n // rows)} chunk(s)"
    else:
        kind = f"vocabulary blocks: {rows} rows × {cols} columns"
    # ∂W: outputs shaped like W (row chunks; its width may be padded) or like a block of its rows (blocks)
    dw = [g for g in gemms if g[1][-1] == hidden and len(g[1]) == 2
          and (g[1][0] >= vocab if cols >= vocab else g[1][0] <= cols and g[1][0] != n)]
    dw_types = collections.Counter(f"{str(g[2]).replace('torch.', '')}→{str(g[3]).replace('torch.', '')}"
                                   for g in dw)
    return f"{kind}; {len(gemms)} GEMMs per call; ∂W GEMMs (operands→output) {dict(dw_types) or 'none seen'}"


def run_variant(n, vocab, hidden, dtype, device, **kw) -> str:
    """One line: the design `fused_linear_policy_loss(..., **kw)` ran (GRPO, forward + backward, 8 rows of n / 8
    tokens), its extra peak above the inputs and their gradients over the n·V logits, and its time."""
    from . import measure

    step, h, w = measure.linear_step(n, hidden, vocab, dtype, device, **kw)
    step()  # compiles, registers, warms the allocator
    h.grad = w.grad = None
    with GemmLog() as log:
        step()
    grads = (h.numel() + w.numel()) * h.element_size()
    extra = (measure.extra_peak_bytes(step, [h, w], device) - grads) / (n * vocab * h.element_size())
    ms = measure.time_ms(step, [h, w], device, reps=5)
    return f"{design(log.gemms, n, vocab, hidden)}; extra peak {extra:.1%} of the logits; {ms:.2f} ms fwd+bwd"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192, help="tokens, a multiple of 8")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    status = 0
    for line in probe_out_dtype(dtype, device):
        print(f"out_dtype GEMM, {args.dtype} on {device}: {line}")
    try:  # the path's own probe: a value it finds wrong raises
        print(f"hidden-state path's GEMM, {args.dtype} on {device}: "
              f"{_linear_head.head_gemm(torch.empty(1, dtype=dtype, device=device))}")
    except RuntimeError as e:
        print(f"hidden-state path's GEMM, {args.dtype} on {device}: FAILED: {e}")
        status = 1
    print(f"hidden-state path, N = {args.n}, V = {args.vocab}, H = {args.hidden}, {args.dtype} on {device}, "
          "GRPO forward + backward:")
    for label, kw in (("default", {}), ("memory_budget=None (speed)", {"memory_budget": None})):
        try:
            print(f"  {label}: {run_variant(args.n, args.vocab, args.hidden, dtype, device, **kw)}")
        except Exception as e:  # report and go on: the other variant still answers
            print(f"  {label}: failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            status = 1
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
