"""How it is measured: time, extra peak memory, and the machine's own bandwidth and matmul rate.

Time: CUDA — `triton.testing.do_bench` (gradients set to None between runs, L2 flushed);
CPU — the median of `reps` wall-clock runs after one warm-up. Extra peak memory: the high-water
mark above what was allocated before the step (the inputs), during one step: CUDA —
`max_memory_allocated`; CPU — the resident set's high-water mark (VmHWM, reset through
/proc/self/clear_refs), with glibc's mmap threshold fixed so that every freed large block goes
back to the system and the next step cannot hide its allocations in memory a previous one kept.

The hidden-state path's extra peak as a fraction of the logits it avoids (`hidden_path_extra`; run it in a
fresh process, as the command does):

    python -m benchmarks.measure --n 2048 --hidden 896 --dtype fp32
    python -m benchmarks.measure --n 2048 --hidden 2048 --dtype bf16 --memory-budget none
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from rlkernels._peak_memory import peak_since, reset_peak

_M_MMAP_THRESHOLD = -3
_malloc_fixed = False


def fix_malloc_threshold(nbytes: int = 1 << 20) -> None:
    """Setting the threshold once turns off glibc's dynamic raising of it (up to 32 MB), after
    which freed blocks of that size would stay in the heap and be reused unseen by VmHWM."""
    global _malloc_fixed
    if not _malloc_fixed and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes)
        _malloc_fixed = True


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(step, leaves, device, reps: int = 3) -> float:
    """Milliseconds per call of `step()`; `leaves` get their gradients cleared between calls."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, warmup=10, rep=max(25, 10 * reps), grad_to_none=leaves)
    times = []
    for i in range(reps + 1):  # the first is a warm-up (and compiles)
        for x in leaves:
            x.grad = None
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def extra_peak_bytes(step, leaves, device) -> int:
    """Peak memory of one call of `step()` above what was in use before it (gradients included)."""
    for x in leaves:
        x.grad = None
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    fix_malloc_threshold()
    start = reset_peak()
    step()
    return peak_since(start)


def read_bandwidth(device) -> float:
    """Bytes per second the device moves: CUDA — a 2 GiB device-to-device copy (read + write);
    CPU — a streaming read (a sum) of 1 GiB, the best of five."""
    if device.type == "cuda":
        import triton.testing

        x = torch.empty(1 << 29, dtype=torch.float32, device=device)
        ms = triton.testing.do_bench(lambda: x.clone(), warmup=25, rep=100)
        return 2 * x.numel() * 4 / (ms * 1e-3)
    x = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def matmul_rate(device, dtype, size: int = 2048) -> float:
    """FLOP/s of a square matmul in `dtype` (8192² on CUDA), the best of five."""
    size = 8192 if device.type == "cuda" else size
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    if device.type == "cuda":
        import triton.testing

        return 2 * size ** 3 / (triton.testing.do_bench(lambda: a @ b, warmup=10, rep=50) * 1e-3)
    a @ b
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def linear_step(n: int, hidden: int, vocab: int, dtype: torch.dtype, device="cpu", preset: str = "grpo",
                scale: float = 1.0, **design):
    """(step, h, w): one forward + backward of `fused_linear_policy_loss` on fresh inputs (B = 8 rows of n / 8
    tokens), its loss times `scale`; `design`: `memory_budget`, `chunk_size`."""
    import rlkernels
    from rlkernels import presets

    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    b, t = 8, n // 8
    h = torch.randn(b, t, hidden, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (b, t), generator=g).to(device)
    adv, old = torch.randn(b, generator=g).to(device), (-torch.rand(b, t, generator=g)).to(device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)

    def step():
        out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.get(preset), old_logp=old,
                                                 ref_logp=old, **design)
        (scale * out.loss).backward()

    return step, h, w


def hidden_path_extra(n: int, hidden: int, vocab: int, dtype: torch.dtype, preset: str = "grpo", device="cpu",
                      **design) -> float:
    """Extra peak of one forward + backward of `fused_linear_policy_loss` (`linear_step`, the loss scaled by 2.5
    so that stored gradients are scaled too) above its inputs and their gradients, over the n·V logits it avoids
    (in `dtype`). `design`: `memory_budget`, `chunk_size`."""
    fix_malloc_threshold()  # first: no freed block may stay in the heap, reused unseen
    step, h, w = linear_step(n, hidden, vocab, dtype, device, preset, scale=2.5, **design)
    step()  # lazy initialisation, outside the measurement
    grads = (h.numel() + w.numel()) * h.element_size()
    return (extra_peak_bytes(step, [h, w], torch.device(device)) - grads) / (n * vocab * h.element_size())


def main(argv=None):
    parser = argparse.ArgumentParser(description="the hidden-state path's extra peak over the logits it avoids")
    parser.add_argument("--n", type=int, default=2048, help="tokens (a multiple of 8)")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--preset", default="grpo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory-budget", default=None,
                        help="a fraction, or 'none' for speed first (default: the op's)")
    parser.add_argument("--chunk-size", type=int, default=None)
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    design = {}
    if args.memory_budget is not None:
        design["memory_budget"] = None if args.memory_budget == "none" else float(args.memory_budget)
    if args.chunk_size is not None:
        design["chunk_size"] = args.chunk_size
    extra = hidden_path_extra(args.n, args.hidden, args.vocab, dtype, args.preset, args.device, **design)
    print(f"N = {args.n}, H = {args.hidden}, V = {args.vocab}, {args.dtype}, {args.preset} {design or ''}: "
          f"extra peak {extra:.1%} of the logits")


if __name__ == "__main__":
    main()
