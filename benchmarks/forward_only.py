"""What the two-pass row costs a forward whose loss is never differentiated (issue 37): `fused_policy_loss` with grad
enabled and no backward (an evaluation loop outside `torch.no_grad()`, a loss computed for logging), and the peak of a
step with a large allocation between forward and backward, for `two_pass=True` against `two_pass=False` on the cpu
backend.

    python -m benchmarks.forward_only                     # B = 8, T = 256, V = 32768, fp32, grpo, 5 rounds
    python -m benchmarks.forward_only --b 2 --t 64 --v 4096 --rounds 3

Rows: `forward, grad enabled` (the call alone: its time, and the resident memory it still holds when it returns, the
graph alive); `forward, no_grad` (the same call under `torch.no_grad()`, the fix for callers); `step with an
allocation` (forward, then a temporary N × V fp32 tensor written and freed while the graph is alive, then
backward: the peak resident memory above the inputs). Times are medians of interleaved rounds; memory is the process's resident high-water mark
(`rlkernels._peak_memory`), so it counts the pages actually written.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import rlkernels
from rlkernels import presets
from rlkernels._peak_memory import peak_since, reset_peak

MIB = 2 ** 20


def _inputs(b, t, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)
    targets = torch.randint(0, v, (b, t), generator=g)
    logp = -torch.rand(b, t, generator=g)
    kw = dict(old_logp=logp, ref_logp=logp)
    return logits, targets, torch.randn(b, generator=g), torch.ones(b, t, dtype=torch.bool), kw


def _forward(x, inputs, two_pass, grad):
    _, targets, adv, mask, kw = inputs
    with torch.set_grad_enabled(grad):
        return rlkernels.fused_policy_loss(x, targets, adv, mask, presets.grpo(), backend="cpu", two_pass=two_pass,
                                           **kw)


def forward_only(inputs, two_pass, grad):
    """(seconds, bytes held when the call returns) of one forward, its output kept alive."""
    x = inputs[0].clone().requires_grad_(True)
    start = reset_peak()
    t0 = time.perf_counter()
    out = _forward(x, inputs, two_pass, grad)
    seconds = time.perf_counter() - t0
    held = peak_since(start)
    del out
    return seconds, held


def step_with_allocation(inputs, two_pass):
    """Peak bytes above the inputs of forward, a temporary N × V fp32 tensor written and freed while the graph is
    alive, backward."""
    x = inputs[0].clone().requires_grad_(True)
    start = reset_peak()
    out = _forward(x, inputs, two_pass, True)
    other = torch.ones(inputs[0].shape)  # e.g. a metric or a KL computed from other logits after the loss
    del other
    out.loss.backward()
    peak = peak_since(start)
    del out
    return peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--b", type=int, default=8)
    p.add_argument("--t", type=int, default=256)
    p.add_argument("--v", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    inputs = _inputs(args.b, args.t, args.v)
    n_v = inputs[0].numel() * 4 / MIB
    print(f"B = {args.b}, T = {args.t}, V = {args.v}, fp32 (N × V: {n_v:.0f} MiB), grpo, cpu, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    for two_pass in (True, False):  # warm-up: first-call set-up (op registration, the CPU row's scratch) not timed
        forward_only(inputs, two_pass, True)
    rows = {}
    for _ in range(args.rounds):  # interleaved: a shared machine's load falls on every path alike
        for two_pass in (True, False):
            for grad in (True, False):
                rows.setdefault(("forward, grad enabled" if grad else "forward, no_grad", two_pass), []).append(
                    forward_only(inputs, two_pass, grad))
            rows.setdefault(("step with an allocation", two_pass), []).append((None, step_with_allocation(inputs,
                                                                                                          two_pass)))
    print(f"{'':26} {'two_pass=True':>28} {'two_pass=False':>28}")
    for what in ("forward, grad enabled", "forward, no_grad", "step with an allocation"):
        cells = []
        for two_pass in (True, False):
            runs = rows[what, two_pass]
            mib = statistics.median(m for _, m in runs) / MIB
            ms = None if runs[0][0] is None else statistics.median(s for s, _ in runs) * 1e3
            cells.append(f"{mib:7.0f} MiB" + ("" if ms is None else f", {ms:8.1f} ms"))
        print(f"{what:26} {cells[0]:>28} {cells[1]:>28}")


if __name__ == "__main__":
    main()
