"""On a GPU: whether the matmul takes half-precision operands with an fp32 result, and which design the
hidden-state path ran, with its extra memory and time.

    python -m benchmarks.head_probe [--n 8192 --vocab 151936 --hidden 4096 --dtype bf16]

1. `torch.mm(a, b, out_dtype=torch.float32)` and `torch.addmm(acc, a.t(), a, out_dtype=..., out=acc)` on
   half-precision operands (the ∂W / ∂hidden GEMMs' fp32 accumulation without an fp32 copy of a chunk):
   accepted or refused (the exception), and its largest error against the product of the fp32 images.
2. `fused_linear_policy_loss` (GRPO, forward + backward) by default and with `memory_budget=None` (speed
   first): the design each ran, read from its GEMMs (recorded by a TorchDispatchMode; the first GEMM of the
   forward computes logits: its output is (rows, ≥ V) for row chunks, (N, columns < V) for vocabulary
   blocks), the dtype of the ∂W GEMMs' output, the extra peak (`max_memory_allocated` above the inputs,
   less the gradients) as a fraction of the N·V logits the path avoids, and the median time of 5 calls.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def design(forward, backward, n, vocab, hidden) -> str:
    """The design, read from the GEMMs of the forward and of the backward."""
    if not forward:
        return "no GEMM in the forward (not the hidden-state path?)"
    rows, cols = forward[0][1][-2:]
    if cols >= vocab:
        kind = f"row chunks: {rows} rows × {cols} columns, {-(-n // rows)} chunk(s)"
    else:
        kind = f"vocabulary blocks: {rows} rows × {cols} columns, {sum(1 for g in forward if g[1][-1] < vocab)} GEMMs"
    # ∂W: outputs shaped like W (row chunks; its width may be padded) or like a block of its rows (blocks).
    # Forward and backward both: the forward may compute the gradients.
    dw = [g for g in forward + backward if g[1][-1] == hidden and len(g[1]) == 2
          and (g[1][0] >= vocab if cols >= vocab else g[1][0] <= cols and g[1][0] != n)]
    dw_types = collections.Counter(f"{str(g[2]).replace('torch.', '')}→{str(g[3]).replace('torch.', '')}"
                                   for g in dw)
    return (f"{kind}; forward {len(forward)} GEMMs, backward {len(backward)}; ∂W GEMMs "
            f"(operands→output) {dict(dw_types) or 'none seen'}")


def run_variant(n, vocab, hidden, dtype, device, **kw) -> str:
    import rlkernels
    from rlkernels import presets

    B = max(1, n // 512)
    T = n // B
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(B, T, hidden, device=device, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=device, generator=g) / hidden ** 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (B, T), device=device, generator=g)
    adv, mask = torch.randn(B, device=device, generator=g), torch.ones(B, T, dtype=torch.bool, device=device)
    old = -torch.rand(B, T, device=device, generator=g)

    def forward():
        return rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.grpo(), old_logp=old,
                                                  ref_logp=old, **kw).loss

    loss = forward()  # compiles, and warms the allocator
    loss.backward()
    h.grad = w.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with GemmLog() as fwd_log:
        loss = forward()
    with GemmLog() as bwd_log:
        loss.backward()
    torch.cuda.synchronize(device)
    grads = sum(x.grad.numel() * x.grad.element_size() for x in (h, w))
    extra = (torch.cuda.max_memory_allocated(device) - base - grads) / (n * vocab * dtype.itemsize)
    times = []
    for _ in range(5):
        h.grad = w.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward().backward()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return (f"{design(fwd_log.gemms, bwd_log.gemms, n, vocab, hidden)}; extra peak {extra:.1%} of the logits; "
            f"{statistics.median(times):.2f} ms forward + backward (median of 5)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("head_probe: no CUDA device: nothing to probe")
        return 1
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    status = 0
    for line in probe_out_dtype(dtype, device):
        print(f"out_dtype GEMM, {args.dtype}: {line}")
    print(f"hidden-state path, N = {args.n}, V = {args.vocab}, H = {args.hidden}, {args.dtype}, GRPO fwd+bwd:")
    for label, kw in (("default", {}), ("memory_budget=None (speed)", {"memory_budget": None})):
        try:
            print(f"  {label}: {run_variant(args.n, args.vocab, args.hidden, dtype, device, **kw)}")
        except Exception as e:  # report and go on: the other variant still answers
            print(f"  {label}: failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            status = 1
        torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
