"""Benchmark report: every provider of every op, swept over V and over N, forward and forward +
backward; writes benchmarks/results/<machine>.md (+ .json) and <machine>_<op>.png.

    python -m benchmarks.report                      # this machine's defaults (CPU or CUDA)
    python -m benchmarks.report --ops grpo --providers eager rlkernels-cpu --vocabs 32768 151936
    python -m benchmarks.report --quick              # tiny sizes: checks that everything runs

The roofline column is the fraction of this machine's own limit reached, measured in the same run:
logits ops — the bytes the op must move (workloads.Case.bytes_moved) per second over the
bandwidth of a device copy (CUDA) or a streaming read (CPU); the hidden-state op, which is
matmul-bound — its matmul FLOP/s over a plain square matmul's in the same dtype.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time

import torch

from . import measure
from .providers import all_providers, prepare, runnable
from .workloads import DTYPES, MODES, OPS, Case

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULTS = {  # (vocab sweep, N sweep, the other axis's fixed value, dtype, H)
    "cpu": dict(vocabs=[8192, 32768, 131072], ns=[512, 2048, 8192], n=2048, vocab=32768, dtype="fp32", hidden=256),
    "cuda": dict(vocabs=[32768, 65536, 151936, 262144], ns=[2048, 8192, 32768], n=8192, vocab=151936,
                 dtype="bf16", hidden=4096),
    "quick": dict(vocabs=[512, 2048], ns=[64, 256], n=256, vocab=2048, dtype="fp32", hidden=64),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--providers", nargs="+", help="names as in the table (default: all that can run)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--vocabs", type=int, nargs="+", help="the V sweep (at N = --n)")
    p.add_argument("--ns", type=int, nargs="+", help="the N sweep (at V = --vocab)")
    p.add_argument("--n", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--hidden", type=int, help="H of the hidden-state op")
    p.add_argument("--seq-len", type=int, default=512, help="T; B = N / T")
    p.add_argument("--reps", type=int, default=3, help="timed runs per case on CPU (CUDA: do_bench)")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="skip what is left after this long")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one rep: a smoke test")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--name", help="file name stem (default: the machine's)")
    args = p.parse_args(argv)
    known = [q.name for q in all_providers()]
    unknown = sorted(set(args.providers or ()) - set(known))
    if unknown:
        p.error(f"--providers: unknown {unknown}; expected names from {known}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device: {args.device!r} requested but torch sees no CUDA device")
    defaults = DEFAULTS["quick" if args.quick else ("cuda" if args.device.startswith("cuda") else "cpu")]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.reps = 1
    return args


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{platform.machine()}-{os.cpu_count()}c"


def cases(args):
    """Every (op, V, N, mode) of the two sweeps; the point they share is measured once. Mode by mode, in the
    order of --modes, then op by op in the order of --ops: when --budget-s runs out, what is lost is the
    last mode and op named."""
    points = [(v, args.n) for v in args.vocabs] + [(args.vocab, n) for n in args.ns]
    return [Case(op, n, v, args.dtype, mode, hidden=args.hidden if op == "grpo_linear" else 0, seq_len=args.seq_len)
            for mode in args.modes for op in args.ops for v, n in dict.fromkeys(points)]


def run_one(case, provider, device, args):
    row = dict(op=case.op, mode=case.mode, provider=provider.name, vocab=case.vocab, n=case.n, dtype=case.dtype,
               hidden=case.hidden, batch=case.shape[0], bytes=case.bytes_moved(), flops=case.flops())
    try:
        step, leaves, inputs = prepare(case, provider, device)
        row["ms"] = measure.time_ms(step, leaves, device, args.reps)
        row["peak_mb"] = measure.extra_peak_bytes(step, leaves, device) / 2**20
    except Exception as e:  # one provider failing (out of memory, an API change) must not end the run
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        return row
    finally:
        inputs = leaves = step = None  # noqa: F841  (free before the next case)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def machine_limits(device, dtypes):
    """Bandwidth, and the matmul rate of each dtype in `dtypes`."""
    return {"bandwidth": measure.read_bandwidth(device),
            "matmul": {d: measure.matmul_rate(device, DTYPES[d]) for d in dtypes}}


def add_model(rows):
    """The traffic model's time (benchmarks/traffic.py) beside each rlkernels row: what the code's own op
    sequence must take on an H200 (its bytes over 4.27 TB/s plus its GEMM FLOPs over 760 TFLOP/s)."""
    from . import traffic

    cache = {}
    for row in rows:
        if "ms" not in row or not row["provider"].startswith("rlkernels-") or row["op"] not in traffic.REPORT_PATHS:
            continue
        key = (row["op"], row["mode"], row["n"], row["vocab"], row["hidden"], row["dtype"], row["batch"])
        if key not in cache:
            (cache[key],) = traffic.model(row["n"], row["vocab"], row["hidden"] or 1, DTYPES[row["dtype"]],
                                          only=[traffic.REPORT_PATHS[row["op"]]], batch=row["batch"],
                                          backward=row["mode"] == "fwd+bwd")
        row["model_ms"] = cache[key].model_ms


def add_roofline(rows, limits):
    """The fraction of the machine's limit each row reached (module docstring)."""
    for row in rows:
        if "ms" in row:
            per_s = (row["flops"] if row["op"] == "grpo_linear" else row["bytes"]) / (row["ms"] * 1e-3)
            row["roofline"] = per_s / (limits["matmul"][row["dtype"]] if row["op"] == "grpo_linear" else limits["bandwidth"])


def run(args):
    from tqdm.auto import tqdm

    device = torch.device(args.device)
    measure.fix_malloc_threshold()  # before any timing: a raised threshold hides reused chunks from the peak
    todo, skipped = [], []
    for index, case in enumerate(cases(args)):
        for provider, reason in runnable(case.op, device, args.providers):
            if reason:
                skipped.append(f"{case.op} {provider.name}: {reason}")
            else:
                todo.append((index, case, provider))
    skipped = list(dict.fromkeys(skipped))
    # Within a case, the baselines last: when --budget-s runs out, torch.compile's compile time is what
    # gets skipped, not our rows (the sort is stable, so the cases keep their order).
    todo = [(case, provider) for index, case, provider in
            sorted(todo, key=lambda t: (t[0], t[2].name in ("eager", "compile")))]
    dtypes = [args.dtype] if "grpo_linear" in args.ops else []
    before = machine_limits(device, dtypes)
    rows, start = [], time.time()
    # Each case as it finishes, a JSON line in <out>/<name>.rows.jsonl (and one line on stderr): a run killed at
    # its time limit (gpu_check) keeps the cases it measured, where the report files come only at the end.
    os.makedirs(args.out, exist_ok=True)
    partial = open(os.path.join(args.out, f"{args.name or machine_name(device)}.rows.jsonl"), "w")
    bar = tqdm(todo, desc="benchmarks", dynamic_ncols=True, file=sys.stderr)
    for case, provider in bar:
        bar.set_postfix_str(f"{case.op} {case.mode} V={case.vocab} N={case.n} {provider.name}")
        if time.time() - start > args.budget_s:
            skipped.append(f"{case.op} {case.mode} V={case.vocab} N={case.n} {provider.name}: over --budget-s")
            continue
        rows.append(run_one(case, provider, device, args))
        what = rows[-1].get("error") or f"{rows[-1]['ms']:.3f} ms, extra peak {rows[-1]['peak_mb']:.0f} MB"
        bar.write(f"{case.op} {case.mode} V={case.vocab} N={case.n} {provider.name}: {what}")
        partial.write(json.dumps(rows[-1]) + "\n")
        partial.flush()
    partial.close()
    # Measured before and after the cases, the best of both: a shared machine's noise lowers a
    # rate, so the higher one is the better estimate of the limit.
    after = machine_limits(device, dtypes)
    limits = {"bandwidth": max(before["bandwidth"], after["bandwidth"]),
              "matmul": {d: max(before["matmul"][d], after["matmul"][d]) for d in dtypes}}
    add_roofline(rows, limits)
    add_model(rows)
    return rows, skipped, limits, device


def _key(r):
    return r["op"], r["mode"], r["vocab"], r["n"], r["dtype"]


def _speedups(rows):
    """{id(row): {"eager": x, "compile": y}} — the row's time against those providers' on the same case."""
    by_case = {}
    for r in rows:
        if "ms" in r:
            by_case.setdefault(_key(r), {})[r["provider"]] = r["ms"]
    return {id(r): {p: by_case[_key(r)][p] / r["ms"] for p in ("eager", "compile") if p in by_case[_key(r)]}
            for r in rows if "ms" in r}


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def table(rows, only=None):
    speed = _speedups(rows)
    lines = ["| op | mode | V | N | provider | ms | modelled H200 ms | extra peak MB | vs eager | vs compile | roofline |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r or (only and not only(r)):
            continue
        s = speed[id(r)]
        lines.append(f"| {r['op']} | {r['mode']} | {r['vocab']} | {r['n']} | {r['provider']} | {r['ms']:.2f} | "
                     f"{_fmt(r.get('model_ms'), '.3g')} | {r['peak_mb']:.0f} | {_fmt(s.get('eager'), '.2f')}× | {_fmt(s.get('compile'), '.2f')}× | "
                     f"{r['roofline']:.0%} |")
    return lines


def summary(rows, args):
    """The largest case of each op and mode (N = --n, the largest V)."""
    big = max(args.vocabs)
    return table(rows, only=lambda r: r["n"] == args.n and r["vocab"] == big)


def plot(rows, args, stem):
    """One PNG per op: time and extra peak memory (rows) against V and N, fwd and fwd+bwd (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op in args.ops:
        fig, axes = plt.subplots(2, 4, figsize=(20, 8), squeeze=False)
        for col, (axis, mode) in enumerate((a, m) for a in ("vocab", "n") for m in ("fwd", "fwd+bwd")):
            fixed = ("n", args.n) if axis == "vocab" else ("vocab", args.vocab)
            sel = [r for r in rows if r["op"] == op and r["mode"] == mode and "ms" in r and r[fixed[0]] == fixed[1]]
            for provider in dict.fromkeys(r["provider"] for r in sel):
                pts = sorted((r[axis], r["ms"], r["peak_mb"]) for r in sel if r["provider"] == provider)
                for row, idx in ((0, 1), (1, 2)):
                    axes[row][col].plot([p[0] for p in pts], [max(p[idx], 1e-3) for p in pts], marker="o", label=provider)
            for row, ylabel in ((0, "ms"), (1, "extra peak MB")):
                ax = axes[row][col]
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("V" if axis == "vocab" else "N (tokens)")
                ax.set_ylabel(ylabel)
                ax.set_title(f"{mode}, {fixed[0].replace('vocab', 'V').replace('n', 'N')} = {fixed[1]}")
                ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{op} ({args.dtype}{f', H = {args.hidden}' if op == 'grpo_linear' else ''}) — {stem}")
        fig.tight_layout()
        path = os.path.join(args.out, f"{stem}_{op}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def write(rows, skipped, limits, device, args, argv):
    import rlkernels

    stem = args.name or machine_name(device)
    os.makedirs(args.out, exist_ok=True)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.machine()} CPU, {os.cpu_count()} cores")
    matmul = ", ".join(f"{k} matmul {v / 1e12:.3f} TFLOP/s" for k, v in limits["matmul"].items())
    head = [f"# Benchmarks: {stem} ({datetime.date.today()})", "",
            f"{where}; torch {torch.__version__}; {'copy' if device.type == 'cuda' else 'streaming-read'} "
            f"bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s{'; ' + matmul if matmul else ''}.",
            f"Command: `{' '.join(['python -m benchmarks.report', *argv])}`.",
            f"{args.dtype}; rows of T = {args.seq_len} tokens; H = {args.hidden} for grpo_linear. ms: "
            + ("`triton.testing.do_bench`" if device.type == "cuda" else f"median of {args.reps} after a warm-up")
            + "; extra peak: above the inputs, gradients included; roofline: see benchmarks/report.py.",
            "rlkernels backends: " + ", ".join(f"{k} ({'yes' if v['available'] else 'no'})"
                                                for k, v in rlkernels.backend_info().items()) + ".", "",
            "## Summary (largest V at N = {})".format(args.n), "", *summary(rows, args), "",
            "## All cases", "", *table(rows)]
    if skipped:
        head += ["", "## Not measured", "", *[f"* {s}" for s in skipped]]
    errors = [f"* {r['op']} {r['mode']} V={r['vocab']} N={r['n']} {r['provider']}: {r['error']}" for r in rows if "error" in r]
    if errors:
        head += ["", "## Failed", "", *errors]
    md = os.path.join(args.out, f"{stem}.md")
    with open(md, "w") as f:
        f.write("\n".join(head) + "\n")
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(args=vars(args), limits=limits, rows=rows, skipped=skipped), f, indent=1)
    try:
        pngs = plot(rows, args, stem)
    except ImportError as e:  # matplotlib is in the bench/test extras, not the core install
        print(f"no plots: {e}", file=sys.stderr)
        pngs = []
    return md, pngs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows, skipped, limits, device = run(args)
    md, pngs = write(rows, skipped, limits, device, args, argv)
    print("\n".join(summary(rows, args)))
    print(f"\nwrote {md}" + "".join(f", {p}" for p in pngs))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
