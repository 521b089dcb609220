"""Two passes against three: forward + backward of `fused_policy_loss` with `two_pass=True` and `two_pass=False`,
interleaved A/B (so that the load of a shared machine falls on both alike), the median of each.

    python -m benchmarks.two_pass                         # N = 4096, V = 151936, grpo and dapo, fp32 and bf16, cpu
    python -m benchmarks.two_pass --n 1024 --rounds 3 --presets grpo --dtypes bf16

Each round times one call of each path (gradients cleared, `loss.backward()`, the incoming gradient 1); the report
is the median of the rounds and the ratio of the medians, the best round of each and their ratio (on a loaded
machine the least disturbed), and every round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import rlkernels
from rlkernels import presets

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(n, vocab, dtype, seed=0, batch=8):
    g = torch.Generator().manual_seed(seed)
    t = n // batch
    logits = (torch.randn(batch, t, vocab, generator=g, dtype=torch.float32) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (batch, t), generator=g)
    mask = torch.rand(batch, t, generator=g) > 0.1
    old = -torch.rand(batch, t, generator=g) * 3
    return logits, targets, torch.randn(batch, t, generator=g), mask, dict(old_logp=old, ref_logp=old - 0.05)


def _step(logits, targets, adv, mask, kw, config, two_pass):
    logits.grad = None
    start = time.perf_counter()
    out = rlkernels.fused_policy_loss(logits, targets, adv, mask, config, backend="cpu", two_pass=two_pass, **kw)
    out.loss.backward()
    return time.perf_counter() - start


def compare(n, vocab, dtype, preset, rounds):
    """(median two-pass s, median three-pass s, the rounds' times of each)."""
    logits, targets, adv, mask, kw = _inputs(n, vocab, dtype)
    config = presets.get(preset)
    times = {True: [], False: []}
    for two_pass in (True, False):  # warm-up: first-use registration and page faults of the first gradient
        _step(logits, targets, adv, mask, kw, config, two_pass)
    for r in range(rounds):
        for two_pass in ((True, False) if r % 2 == 0 else (False, True)):
            times[two_pass].append(_step(logits, targets, adv, mask, kw, config, two_pass))
    return statistics.median(times[True]), statistics.median(times[False]), times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--presets", nargs="+", default=["grpo", "dapo"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    args = parser.parse_args(argv)
    print(f"N = {args.n}, V = {args.vocab}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f} at the start; {args.rounds} interleaved rounds")
    print("| preset | dtype | two passes (s) | three passes (s) | speed-up | best two / three (s) | best speed-up | "
          "rounds two / three (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for preset in args.presets:
            two, three, times = compare(args.n, args.vocab, DTYPES[dtype], preset, args.rounds)
            spread = " ".join(f"{t:.2f}" for t in times[True]) + " / " + " ".join(f"{t:.2f}" for t in times[False])
            best2, best3 = min(times[True]), min(times[False])
            print(f"| {preset} | {dtype} | {two:.3f} | {three:.3f} | {three / two:.2f}x | {best2:.3f} / {best3:.3f} | "
                  f"{best3 / best2:.2f}x | {spread} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
