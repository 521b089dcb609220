"""CPU benchmark (not a test): rlkernels' CPU backend against eager PyTorch and torch.compile.

    python -m benchmarks.bench_cpu                       # N = 4096, V ∈ {32768, 151936}, fp32 + bf16
    python -m benchmarks.bench_cpu --vocab 32768 --dtype fp32 --reps 2

Each case runs in a fresh process (so its peak memory is its own): forward+backward of
`token_logprobs` and of the GRPO and GSPO losses from logits. Time is the median of `--reps`
runs after one warm-up (which includes compilation for torch.compile); extra peak memory is
the high-water mark of resident memory above what the inputs already hold, during one run.
Writes a markdown table (default benchmarks/results/cpu.md) and prints it.

# I/O per case: logits N·V·s bytes read forward, read again and N·V·s gradient bytes written
# backward (s = 4 for fp32, 2 for bf16); everything else is O(N).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("token_logprobs", "grpo", "gspo")
PROVIDERS = ("rlkernels", "eager", "compile")


def _eager_logprobs(logits, targets, with_entropy):
    """TRL's pattern: a materialised log_softmax, then gather (and the entropy for its metrics)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    logp = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    return logp, -(log_probs.exp() * log_probs).sum(-1)


def _make_step(op, provider, inputs):
    import rlkernels
    from rlkernels import presets

    logits, targets, adv, mask, old_logp, ref_logp = inputs
    if op == "token_logprobs":
        if provider == "rlkernels":
            return lambda x: rlkernels.token_logprobs(x, targets).sum()
        fn = lambda x: _eager_logprobs(x, targets, False)[0].sum()  # noqa: E731
    else:
        config = presets.get(op)
        if provider == "rlkernels":
            return lambda x: rlkernels.fused_policy_loss(x, targets, adv, mask, config, old_logp=old_logp,
                                                         ref_logp=ref_logp).loss

        def fn(x):
            logp, entropy = _eager_logprobs(x, targets, True)
            return rlkernels.policy_loss(logp, adv, mask, config, old_logp=old_logp, ref_logp=ref_logp,
                                         entropy=entropy).loss
    return torch.compile(fn, dynamic=False) if provider == "compile" else fn


def run_case(op, provider, n, vocab, dtype, reps):
    """One case in this process: {"ms": median fwd+bwd time, "peak_mb": extra peak memory}."""
    from rlkernels._peak_memory import peak_since, reset_peak

    torch.manual_seed(0)
    B = max(1, n // 512)
    T = n // B
    logits = (torch.randn(B, T, vocab) * 2).to(DTYPES[dtype])
    targets = torch.randint(0, vocab, (B, T))
    adv = torch.randn(B)
    mask = torch.ones(B, T, dtype=torch.bool)
    old_logp = -torch.rand(B, T) * 5
    ref_logp = -torch.rand(B, T) * 5
    step = _make_step(op, provider, (logits, targets, adv, mask, old_logp, ref_logp))

    def once():
        x = logits.detach().requires_grad_(True)
        step(x).backward()
        return x.grad

    once()  # warm-up (and compilation)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    start_rss = reset_peak()
    grad = once()
    peak = peak_since(start_rss)
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak / 2**20, "grad_mb": grad.numel() * grad.element_size() / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description="CPU benchmark of rlkernels against eager PyTorch and torch.compile")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--op", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--provider", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu.md"))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args(argv)

    if args.case:
        op, provider, vocab, dtype = args.case.split(":")
        print(json.dumps(run_case(op, provider, args.n, int(vocab), dtype, args.reps)))
        return 0

    import rlkernels

    rows = []
    header = f"| op | V | dtype | provider | fwd+bwd ms | extra peak MB | grad MB | speed-up vs eager | vs compile |"
    print(f"backends: {rlkernels.backend_info()['cpu']}; torch {torch.__version__}; {os.cpu_count()} cores")
    for vocab in args.vocab:
        for dtype in args.dtype:
            for op in args.op:
                res = {}
                for provider in args.provider:
                    cmd = [sys.executable, "-m", "benchmarks.bench_cpu", "--case", f"{op}:{provider}:{vocab}:{dtype}",
                           "--n", str(args.n), "--reps", str(args.reps)]
                    proc = subprocess.run(cmd, capture_output=True, text=True,
                                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                    if proc.returncode:
                        print(f"{op} {provider} V={vocab} {dtype} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                        continue
                    res[provider] = json.loads(proc.stdout.strip().splitlines()[-1])
                    print(f"{op:>15} V={vocab:<7} {dtype} {provider:>9}: {res[provider]['ms']:9.1f} ms "
                          f"peak +{res[provider]['peak_mb']:8.0f} MB", flush=True)
                for provider, r in res.items():
                    vs = lambda other: f"{res[other]['ms'] / r['ms']:.2f}×" if other in res else "—"  # noqa: E731
                    rows.append(f"| {op} | {vocab} | {dtype} | {provider} | {r['ms']:.1f} | {r['peak_mb']:.0f} | "
                                f"{r['grad_mb']:.0f} | {vs('eager')} | {vs('compile')} |")
    table = "\n".join([header, "|" + "---|" * 9, *rows])
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, N = {args.n}"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"# CPU benchmark ({time.strftime('%Y-%m-%d')}, {machine})\n\n"
                f"Command: `python -m benchmarks.bench_cpu {' '.join(argv or sys.argv[1:])}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
