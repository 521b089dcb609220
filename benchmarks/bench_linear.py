"""Hidden-state path benchmark (not a test): rlkernels against eager PyTorch, torch.compile and Liger.

    python -m benchmarks.bench_linear                            # N ∈ {2048, 8192}, fp32 + bf16
    python -m benchmarks.bench_linear --n 2048 --dtype fp32 --reps 1

Forward+backward of the GRPO loss from hidden states `(N, H)` and a head `(V, H)` (H = 896,
V = 151936: Qwen2.5-0.5B's, tied to the embedding there), gradients for both:
  rlkernels  `fused_linear_policy_loss` (chunked logits, one pass for token-level losses)
  eager      `hidden @ weight.T`, log_softmax, gather, entropy, `policy_loss` (TRL's pattern)
  compile    `torch.compile` of eager
  liger      `LigerFusedLinearGRPOLoss`, when `liger_kernel` is importable (skipped otherwise)
Each case runs in a fresh process (so its peak memory is its own). Time is the median of `--reps`
runs after one warm-up (which includes compilation); extra peak memory is the high-water mark of
resident memory above what the inputs hold, the largest over the timed runs (it includes the gradients ∂hidden,
∂weight that every provider returns: `grad MB`). `logits MB` is the (N, V) tensor avoided.

# FLOPs per case: 3 matmuls of 2·N·H·V (logits, ∂hidden, ∂weight) for every provider.
# I/O: eager writes and reads (N, V) logits, log-probs and ∂logits in memory; rlkernels keeps
# them in one chunk of ≤ 64 MB.
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
PROVIDERS = ("rlkernels", "eager", "compile", "liger")
H, V = 896, 151936


def _liger_available():
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError:
        return False
    return True


def _make_step(provider, inputs):
    import rlkernels
    from rlkernels import presets

    targets, adv, mask, old_logp, ref_logp = inputs
    config = presets.grpo()
    B, T = targets.shape
    if provider == "rlkernels":
        return lambda h, w: rlkernels.fused_linear_policy_loss(h.view(B, T, -1), w, targets, adv, mask, config,
                                                               old_logp=old_logp, ref_logp=ref_logp).loss
    if provider == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=config.kl_coef, epsilon_low=config.clip_low,
                                           epsilon_high=config.clip_high, loss_type="grpo")
        return lambda h, w: loss_fn(h.view(B, T, -1), w, targets, mask.long(), adv, ref_per_token_logps=ref_logp,
                                    old_per_token_logps=old_logp)[0]

    def fn(h, w):
        logits = h @ w.t()
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        logp = log_probs.gather(-1, targets.reshape(-1, 1)).view(B, T)
        entropy = -(log_probs.exp() * log_probs).sum(-1).view(B, T)
        return rlkernels.policy_loss(logp, adv, mask, config, old_logp=old_logp, ref_logp=ref_logp,
                                     entropy=entropy).loss
    return torch.compile(fn, dynamic=False) if provider == "compile" else fn


def run_case(provider, n, dtype, reps):
    """One case in this process: {"ms", "peak_mb", "grad_mb", "logits_mb"}."""
    from rlkernels._peak_memory import peak_since, reset_peak

    torch.manual_seed(0)
    B = max(1, n // 512)
    T = n // B
    hidden = torch.randn(B * T, H).to(DTYPES[dtype])
    weight = (torch.randn(V, H) / H**0.5).to(DTYPES[dtype])
    targets = torch.randint(0, V, (B, T))
    adv = torch.randn(B)
    mask = torch.ones(B, T, dtype=torch.bool)
    old_logp = -torch.rand(B, T) * 5
    ref_logp = -torch.rand(B, T) * 5
    step = _make_step(provider, (targets, adv, mask, old_logp, ref_logp))

    def once():
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        step(h, w).backward()
        return h.grad, w.grad

    once()  # warm-up (and compilation)
    times, peak = [], 0
    for _ in range(reps):  # each timed run also measures the peak (a run takes seconds on CPU here)
        start_rss = reset_peak()
        start = time.perf_counter()
        grads = once()
        times.append(time.perf_counter() - start)
        peak = max(peak, peak_since(start_rss))
        del grads
    grads = (hidden, weight)  # the gradients have the shapes and dtypes of the inputs
    size = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak / 2**20,
            "grad_mb": sum(g.numel() * g.element_size() for g in grads) / 2**20, "logits_mb": n * V * size / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description="hidden-state path benchmark: rlkernels vs eager, torch.compile, Liger")
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--provider", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "linear_cpu.md"))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args(argv)

    if args.case:
        provider, n, dtype = args.case.split(":")
        print(json.dumps(run_case(provider, int(n), dtype, args.reps)))
        return 0

    rows = []
    header = "| N | dtype | provider | fwd+bwd ms | extra peak MB | grad MB | logits MB avoided | peak/logits | speed-up vs eager | vs compile |"
    print(f"torch {torch.__version__}; {os.cpu_count()} cores; H = {H}, V = {V}", flush=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for n in args.n:
        for dtype in args.dtype:
            res = {}
            for provider in args.provider:
                if provider == "liger" and not _liger_available():
                    print("liger: skipped (liger_kernel is not importable)", flush=True)
                    continue
                cmd = [sys.executable, "-m", "benchmarks.bench_linear", "--case", f"{provider}:{n}:{dtype}",
                       "--reps", str(args.reps)]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
                if proc.returncode:
                    print(f"{provider} N={n} {dtype} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}",
                          file=sys.stderr, flush=True)
                    continue
                res[provider] = r = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"N={n:<5} {dtype} {provider:>9}: {r['ms']:9.0f} ms  peak +{r['peak_mb']:7.0f} MB "
                      f"(grads {r['grad_mb']:.0f} MB, logits {r['logits_mb']:.0f} MB)", flush=True)
            for provider, r in res.items():
                vs = lambda other: f"{res[other]['ms'] / r['ms']:.2f}×" if other in res else "—"  # noqa: E731
                extra = r["peak_mb"] - r["grad_mb"]
                rows.append(f"| {n} | {dtype} | {provider} | {r['ms']:.0f} | {r['peak_mb']:.0f} | {r['grad_mb']:.0f} | "
                            f"{r['logits_mb']:.0f} | {extra / r['logits_mb']:.1%} | {vs('eager')} | {vs('compile')} |")
    table = "\n".join([header, "|" + "---|" * 10, *rows])
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, H = {H}, V = {V}"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"# Hidden-state path, CPU ({time.strftime('%Y-%m-%d')}, {machine})\n\n"
                f"Command: `python -m benchmarks.bench_linear {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
                f"`peak/logits` = (extra peak − gradients) / the (N, V) logits in the input dtype.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
