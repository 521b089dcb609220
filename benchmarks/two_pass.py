"""Two passes against three: forward + backward of `fused_policy_loss` with `two_pass=True` and `two_pass=False`,
interleaved A/B (so that the load of a shared machine falls on both alike), the median of each; on CUDA beside
Liger-Kernel's Triton GRPO loss (benchmarks/providers.py) and the Triton backend (three passes, and two: its split row),
contiguous logits and `logits[:, :-1]`; at N = 8192, V = 151936, bf16 GRPO it ends with the verdict against issue
38's goal (GOAL: 1.30 ms).

    python -m benchmarks.two_pass                         # N = 4096, V = 151936, grpo and dapo, fp32 and bf16, cpu
    python -m benchmarks.two_pass --n 1024 --rounds 3 --presets grpo --dtypes bf16
    python -m benchmarks.two_pass --device cuda           # N = 8192, V = 151936, grpo, bf16, with Liger
    python -m benchmarks.two_pass --inplace               # also each path with inplace=True

Each round times one call of each path (gradients cleared, `loss.backward()`, the incoming gradient 1; on CUDA
between two device synchronisations); the report is the median of the rounds and the ratio of the medians, the best
round of each and their ratio (on a loaded machine the least disturbed), and every round. On CUDA each layout is a
row: `contiguous` (logits (B, T, V)) and `sliced` (`logits[:, :-1]` of the model's (B, T + 1, V) output, its
gradient into the parent), and Liger's column takes the (B, T + 1, V) logits either way (it drops the last
position itself); Liger is timed where it is installed and the preset is grpo (the loss it computes).
`--inplace` adds a row `in place` (contiguous logits, `inplace=True`: the gradient over the logits, which are
restored outside the timing): no gradient is allocated, so on a CPU the page faults of a fresh N·V buffer, which both
paths pay alike and which a loaded machine's memory makes erratic, are out of the comparison.
"""
from __future__ import annotations

import argparse
import os
import sys
import statistics
import time

import torch

import rlkernels
from rlkernels import presets

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULTS = {"cpu": dict(n=4096, presets=["grpo", "dapo"], dtypes=["fp32", "bf16"]),
            "cuda": dict(n=8192, presets=["grpo"], dtypes=["bf16"])}


def _inputs(n, vocab, dtype, device, seed=0, batch=8, extra=0):
    """(logits (B, T + extra, V), targets, advantages, mask, old/ref log-probs), drawn on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = n // batch
    logits = (torch.randn(batch, t + extra, vocab, generator=g, device=device) * 2).to(dtype)
    targets = torch.randint(0, vocab, (batch, t), generator=g, device=device)
    mask = torch.rand(batch, t, generator=g, device=device) > 0.1
    old = -torch.rand(batch, t, generator=g, device=device) * 3
    adv = torch.randn(batch, t, generator=g, device=device)
    return logits.requires_grad_(True), targets, adv, mask, dict(old_logp=old, ref_logp=old - 0.05)


def _timed(device, fn):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rlkernels_step(backend, leaf, targets, adv, mask, kw, config, two_pass, sliced, inplace):
    """(prepare, step): what each round does before its timing (the gradient cleared; in place, the logits restored
    from a copy), and the timed forward + backward."""
    kept = leaf.detach().clone() if inplace else None

    def prepare():
        leaf.grad = None
        if inplace:
            with torch.no_grad():
                leaf.copy_(kept)

    def step():
        logits = leaf[:, :-1] if sliced else leaf
        rlkernels.fused_policy_loss(logits, targets, adv, mask, config, backend=backend, two_pass=two_pass,
                                    inplace=inplace, **kw).loss.backward()
    return prepare, step


def _liger_step(n, vocab, dtype_name, device):
    """Liger's Triton GRPO loss, fwd + bwd, as benchmarks.report times it; None where it cannot run."""
    from benchmarks import providers
    from benchmarks.workloads import Case

    liger = next(p for p in providers.all_providers() if p.name == "liger")
    case = Case("grpo", n, vocab, dtype_name, "fwd+bwd")
    why = liger.unavailable(torch.device(device), case.op)
    if why:
        print(f"no Liger column: {why}")
        return None
    step, leaves, _ = providers.prepare(case, liger, torch.device(device))

    def clear():
        for x in leaves:
            x.grad = None
    return clear, step


def compare(n, vocab, dtype_name, preset, rounds, device, sliced=False, liger=None, inplace=False):
    """(medians {path: s}, the rounds' times {path: [s]}) of the two-pass, three-pass (and Liger) paths; on CUDA
    also the Triton backend's (what a GPU user gets without the compiled extension: three passes) and its split row
    (`two_pass=True` on triton, kernels/triton/split_row.py)."""
    leaf, targets, adv, mask, kw = _inputs(n, vocab, DTYPES[dtype_name], device, extra=int(sliced))
    config = presets.get(preset)
    paths = [("two", device, True), ("three", device, False)]
    if device == "cuda":  # the Triton backend, three passes and the split row (two_pass=True, opt-in)
        paths += [("triton", "triton", False), ("triton_two", "triton", True)]
    steps = {name: _rlkernels_step(backend, leaf, targets, adv, mask, kw, config, two_pass, sliced, inplace)
             for name, backend, two_pass in paths}
    if liger is not None:
        steps["liger"] = liger
    times = {name: [] for name in steps}
    for prepare, step in steps.values():  # warm-up: first-use registration, compiles, page faults of the first gradient
        prepare()
        step()
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            prepare, step = steps[name]
            prepare()
            times[name].append(_timed(device, step))
    return {name: statistics.median(t) for name, t in times.items()}, times


# Issue 38 item 7's goal for the device run: GRPO fwd+bwd of bf16 logits at N = 8192, V = 151936 on an H200 in at
# most 1.30 ms (1.5x Liger's measured 1.95 ms), on the cluster kernel and on the Triton path (docs/design.md §7).
GOAL = dict(preset="grpo", dtype="bf16", n=8192, vocab=151936, layout="contiguous", ms=1.30)


def verdict(med, n, vocab, dtype, preset, layout):
    """The line that says whether this row met GOAL, per path (None for any other case)."""
    g = GOAL
    if (preset, dtype, n, vocab, layout) != (g["preset"], g["dtype"], g["n"], g["vocab"], g["layout"]):
        return None
    names = {"two": "cluster kernel (cuda, two passes)", "three": "cuda three passes", "triton": "triton path",
             "triton_two": "triton split row (two passes)", "liger": "Liger"}
    parts = [f"{names[k]} {med[k] * 1e3:.3f} ms {'met' if med[k] * 1e3 <= g['ms'] else 'NOT met'}" +
             (f" ({med['liger'] / med[k]:.2f}x Liger)" if "liger" in med and k != "liger" else "")
             for k in names if k in med]
    return f"goal: GRPO fwd+bwd <= {g['ms']:.2f} ms at N = {n}, V = {vocab}, {dtype}: " + "; ".join(parts)


# The cluster kernel's design: 3 blocks of 512 threads per SM (csrc/cuda/cluster_row.cuh, kBlocksPerSm).
BLOCKS_PER_SM = 3


def cluster_occupancy(vocab, dtype) -> tuple:
    """(line, ok): the CUDA two-pass kernel's resident clusters on this device (cudaOccupancyMaxActiveClusters through
    the extension's `two_pass_active_clusters`) as blocks per SM, against BLOCKS_PER_SM."""
    from rlkernels.kernels import _extension  # noqa: F401  (loads the extension's ops)

    logits = torch.empty(1, vocab, dtype=DTYPES[dtype], device="cuda")
    clusters, size = torch.ops.rlkernels_C.two_pass_active_clusters(logits)
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    per_sm = clusters * size / sms
    ok = per_sm >= BLOCKS_PER_SM
    return (f"cluster kernel, V = {vocab} {dtype}: {clusters} clusters of {size} blocks resident on {sms} SMs = "
            f"{per_sm:.2f} blocks per SM (design {BLOCKS_PER_SM}){'' if ok else ': FAILED'}"), ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cpu", help="the backend of that name too")
    parser.add_argument("--n", type=int, help="tokens (default: cpu 4096, cuda 8192)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--presets", nargs="+", help="default: cpu grpo dapo, cuda grpo")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default: cpu fp32 bf16, cuda bf16")
    parser.add_argument("--inplace", action="store_true", help="also a row with inplace=True (no gradient allocated)")
    args = parser.parse_args(argv)
    defaults = DEFAULTS[args.device]
    n, names, dtypes = args.n or defaults["n"], args.presets or defaults["presets"], args.dtypes or defaults["dtypes"]
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"N = {n}, V = {args.vocab}, {where}, load average {os.getloadavg()[0]:.1f} at the start; {args.rounds} "
          "interleaved rounds")
    layouts = [("contiguous", False, False)] + ([("sliced", True, False)] if args.device == "cuda" else []) + (
        [("in place", False, True)] if args.inplace else [])
    unit, scale = ("ms", 1e3) if args.device == "cuda" else ("s", 1.0)
    status = 0
    if args.device == "cuda":  # the occupancy the timing assumes, asserted first (the timing still runs)
        for dtype in dtypes:
            line, ok = cluster_occupancy(args.vocab, dtype)
            print(line, flush=True)
            status |= not ok
    print(f"| preset | dtype | layout | two passes ({unit}) | three passes ({unit}) | speed-up | Liger ({unit}) | "
          f"Liger / two passes | best two / three ({unit}) | rounds two / three ({unit}) | triton ({unit}) | "
          f"triton two passes ({unit}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        for preset in names:
            liger = (_liger_step(n, args.vocab, dtype, args.device) if args.device == "cuda" and preset == "grpo"
                     else None)
            for layout, sliced, inplace in layouts:
                med, times = compare(n, args.vocab, dtype, preset, args.rounds, args.device, sliced,
                                     None if inplace else liger, inplace)
                fmt = lambda ts: " ".join(f"{t * scale:.3g}" for t in ts)  # noqa: E731
                lig = f"{med['liger'] * scale:.3f} | {med['liger'] / med['two']:.2f}x" if "liger" in med else "- | -"
                tri = " | ".join(f"{med[k] * scale:.3f}" if k in med else "-" for k in ("triton", "triton_two"))
                print(f"| {preset} | {dtype} | {layout} | {med['two'] * scale:.3f} | "
                      f"{med['three'] * scale:.3f} | {med['three'] / med['two']:.2f}x | {lig} | "
                      f"{min(times['two']) * scale:.3f} / {min(times['three']) * scale:.3f} | "
                      f"{fmt(times['two'])} / {fmt(times['three'])} | {tri} |", flush=True)
                line = verdict(med, n, args.vocab, dtype, preset, layout) if args.device == "cuda" else None
                if line:  # at once, below its row: a stage cut later keeps it
                    print(line, flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
