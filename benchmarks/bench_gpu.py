"""GPU timings of token_logprobs and fused_policy_loss against eager PyTorch, torch.compile and Liger.

Called by benchmarks/gpu_check.sh. For each V and op, times forward and forward+backward with
`triton.testing.do_bench` and reports TB/s and the fraction of the measured copy bandwidth,
from the bytes each op must move (the `# I/O:` comments). Writes
benchmarks/results/gpu_<date>.md and .json. `--dry-run` checks imports and builds inputs at a
tiny size on CPU, running each provider that can run there once (no timing, nothing written).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

import rlkernels
from rlkernels import presets

EPS, BETA = 0.2, 0.04  # GRPO's clip and KL coefficient (presets.grpo)
GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192, help="tokens (B·T)")
    p.add_argument("--seq-len", type=int, default=1024, help="T; B = n / T")
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--ops", nargs="+", default=["token_logprobs", "grpo", "gspo"],
                   choices=["token_logprobs", "grpo", "gspo"])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile providers")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip what is left after this many seconds")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: imports and inputs only")
    return p.parse_args(argv)


# ---- eager PyTorch, written plainly (TRL style): log_softmax materialises N × V in fp32 ----------

def eager_logprobs(logits, targets):
    # I/O: reads N·V·2 (bf16 logits); log_softmax writes and gather reads N·V·4 more
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def eager_grpo(logits, targets, adv, mask, old, ref):
    logp = eager_logprobs(logits, targets)
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(1 - EPS, 1 + EPS))
    delta = ref - logp
    per_token = per_token + BETA * (torch.exp(delta) - delta - 1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def eager_gspo(logits, targets, adv, mask, old, ref):
    logp = eager_logprobs(logits, targets)
    log_s = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    s = torch.exp(log_s)[:, None]
    per_token = torch.maximum(-adv[:, None] * s, -adv[:, None] * s.clamp(1 - GSPO_EPS_LOW, 1 + GSPO_EPS_HIGH))
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


EAGER = {"token_logprobs": lambda x, t, *rest: eager_logprobs(x, t), "grpo": eager_grpo, "gspo": eager_gspo}


def rlkernels_op(op, backend):
    if op == "token_logprobs":
        return lambda x, t, *rest: rlkernels.token_logprobs(x, t, backend=backend)
    config = presets.grpo() if op == "grpo" else presets.gspo()

    def fn(x, t, adv, mask, old, ref):
        return rlkernels.fused_policy_loss(x, t, adv, mask, config, old_logp=old, ref_logp=ref, backend=backend).loss
    return fn


def liger_op(op):
    """Liger-Kernel's Triton GRPO loss (logits (B, T+1, V): it drops the last position), or None."""
    if op == "token_logprobs":
        return None
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None
    extra = {} if op == "grpo" else {"importance_sampling_level": "sequence"}
    eps = (EPS, EPS) if op == "grpo" else (GSPO_EPS_LOW, GSPO_EPS_HIGH)

    def fn(x, t, adv, mask, old, ref):
        per_token = triton_grpo_loss(x, old, ref if op == "grpo" else None, t, adv, mask, temperature=1.0,
                                     beta=BETA if op == "grpo" else 0.0, eps_low=eps[0], eps_high=eps[1],
                                     inplace=True, **extra)[0]
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return fn


def make_inputs(n, seq_len, vocab, device, dtype=torch.bfloat16, extra_position=False):
    b = max(n // seq_len, 1)
    t = n // b
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(b, t + extra_position, vocab, device=device, generator=g) * 2).to(dtype)
    targets = torch.randint(0, vocab, (b, t), device=device, generator=g)
    adv = torch.randn(b, device=device, generator=g)
    mask = torch.ones(b, t, device=device)
    old = -torch.rand(b, t, device=device, generator=g) * 5
    ref = old + 0.1 * torch.randn(b, t, device=device, generator=g)
    return logits, targets, adv, mask, old, ref


def copy_bandwidth(device):
    """Bytes per second of a ≥ 1 GB device-to-device clone (it reads and writes every byte)."""
    import triton.testing
    x = torch.empty(1 << 29, dtype=torch.float32, device=device)  # 2 GiB
    ms = triton.testing.do_bench(lambda: x.clone(), warmup=50, rep=200)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def providers(op, device, compile_ok):
    out = {"eager": EAGER[op]}
    if compile_ok:
        out["torch.compile"] = torch.compile(EAGER[op], dynamic=False)
    info = rlkernels.backend_info()
    for backend in ("triton", "cuda"):
        if device == "cuda" and info[backend]["available"]:
            out[f"rlkernels-{backend}"] = rlkernels_op(op, backend)
    if device == "cpu":
        out["rlkernels-torch"] = rlkernels_op(op, "torch")
    liger = liger_op(op) if device == "cuda" else None
    if liger is not None:
        out["liger-triton"] = liger
    return out


def run(args):
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.n, args.seq_len, args.vocab = 16, 8, [64]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device (use --dry-run to check it on CPU)")
    start = time.time()
    peak = None if args.dry_run else copy_bandwidth(device)
    rows, skipped = [], []
    for vocab in args.vocab:
        for op in args.ops:
            for name, fn in providers(op, device, not args.no_compile and not args.dry_run).items():
                for mode in ("fwd", "fwd+bwd"):
                    if time.time() - start > args.budget_s:
                        skipped.append(f"{op} V={vocab} {name} {mode}: over the time budget")
                        continue
                    rows.append(measure(args, op, vocab, name, fn, mode, device, peak))
                    if rows[-1].get("error"):
                        skipped.append(f"{op} V={vocab} {name} {mode}: {rows[-1]['error']}")
    return peak, rows, skipped


def measure(args, op, vocab, name, fn, mode, device, peak):
    row = dict(op=op, vocab=vocab, n=args.n, provider=name, mode=mode)
    inputs = make_inputs(args.n, args.seq_len, vocab, device, extra_position=name.startswith("liger"))
    logits = inputs[0].requires_grad_(mode == "fwd+bwd")
    n_logits = args.n * vocab
    # I/O: forward reads the logits once (N·V·2 bytes, bf16); forward+backward reads them twice
    # and writes ∂logits once (3·N·V·2).
    row["bytes"] = (1 if mode == "fwd" else 3) * n_logits * 2

    def step():
        out = fn(logits, *inputs[1:])
        if mode == "fwd+bwd":
            out.backward(torch.ones_like(out))  # (N,) log-probs, or the 0-d loss
        return out

    try:
        if args.dry_run:
            step()
            return row
        import triton.testing
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = triton.testing.do_bench(step, warmup=10, rep=50, grad_to_none=[logits] if mode == "fwd+bwd" else None)
        row.update(ms=ms, tbps=row["bytes"] / (ms * 1e-3) / 1e12, frac_copy=row["bytes"] / (ms * 1e-3) / peak,
                   peak_extra_gb=(torch.cuda.max_memory_allocated() - base) / 1e9)
    except Exception as e:  # one provider failing (out of memory, Liger's API changed) must not end the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        del inputs, logits
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def report(args, peak, rows, skipped):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=stamp, device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                copy_tbps=peak / 1e12, backends=rlkernels.backend_info())
    lines = [f"# GPU benchmark {stamp}", "",
             f"{meta['device']}, torch {meta['torch']}, copy bandwidth {meta['copy_tbps']:.2f} TB/s "
             f"(clone of 2 GiB). N = {args.n}, bf16 logits.", "",
             "| op | V | mode | provider | ms | TB/s | of copy | peak extra GB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" in r:
            lines.append(f"| {r['op']} | {r['vocab']} | {r['mode']} | {r['provider']} | {r['ms']:.3f} | {r['tbps']:.2f} "
                         f"| {r['frac_copy']:.0%} | {r['peak_extra_gb']:.2f} |")
    if skipped:
        lines += ["", "Not measured:", ""] + [f"* {s}" for s in skipped]
    base = os.path.join(args.out, f"gpu_{stamp}")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, skipped=skipped), f, indent=1)
    print("\n".join(lines))
    print(f"\nwrote {base}.md and {base}.json")


def main(argv=None):
    args = parse_args(argv)
    peak, rows, skipped = run(args)
    if args.dry_run:
        bad = [r for r in rows if r.get("error")]
        print(f"dry run: {len(rows) - len(bad)} provider/mode cases ran on CPU; errors: {bad or 'none'}; "
              f"liger importable: {liger_op('grpo') is not None}")
        raise SystemExit(1 if bad else 0)
    report(args, peak, rows, skipped)


if __name__ == "__main__":
    main()
