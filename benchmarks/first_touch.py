"""token_logprobs forward + backward on the CPU, the kernel apart from the first touch of its fresh gradient buffer.

    python -m benchmarks.first_touch [--n 4096] [--seq-len 512] [--vocab 32768] [--dtype fp32] [--reps 5]

A backward that returns a new N × V gradient pays, besides the kernel, for the pages of that buffer: the allocator
hands out fresh memory each call and the kernel's first store to each page faults it in (a cost of the host's
memory, not of the kernel: issue 38 saw it swing from 1.2 to 4 s with 2 MB pages on a fragmented host). Rows,
each the median of `reps` calls after one warm-up, wall clock:

  eager            TRL's pattern (benchmarks/providers.py's selective_log_softmax), backward through autograd (its
                   own fresh buffers)
  rlkernels        `token_logprobs` forward + backward through autograd: the gradient in a fresh buffer
  kernel           the same two kernels (cpu backend), the backward into a buffer already touched (`out=`)
  first touch      rlkernels − kernel: what the fresh buffer's pages cost in the kernel's own stores

and the speed-ups of `rlkernels` and of `kernel` over eager.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.providers import selective_log_softmax
from rlkernels import token_logprobs
from rlkernels.kernels import _extension as ext

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_touch", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512, help="T: logits (N / T, T, V)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    shape = (args.n // args.seq_len, args.seq_len)
    logits = torch.randn(*shape, args.vocab, dtype=dtype)
    targets = torch.randint(0, args.vocab, shape)
    grad_logp = torch.randn(shape)

    def eager():
        x = logits.detach().requires_grad_(True)
        selective_log_softmax(x, targets).backward(grad_logp)

    def rlkernels():
        x = logits.detach().requires_grad_(True)
        token_logprobs(x, targets, backend="cpu").backward(grad_logp)

    rows_2d, targets_1d, grad_1d = logits.view(-1, args.vocab), targets.view(-1), grad_logp.view(-1)
    out = torch.zeros_like(rows_2d)  # touched once, here

    def kernel():
        _, entropy, lse_parts = ext.token_logprobs_fwd(rows_2d, targets_1d, 1.0, False)
        ext.token_logprobs_bwd(rows_2d, targets_1d, lse_parts, entropy, grad_1d, None, 1.0, out=out)

    rows = [(name, median_ms(fn, args.reps)) for name, fn in
            (("eager", eager), ("rlkernels", rlkernels), ("kernel", kernel))]
    ms = dict(rows)
    rows.append(("first touch", ms["rlkernels"] - ms["kernel"]))
    print(f"token_logprobs fwd+bwd, cpu, N = {args.n}, V = {args.vocab}, {args.dtype}, {torch.get_num_threads()} "
          f"threads, median of {args.reps} (gradient {logits.numel() * logits.element_size() / 2**20:.0f} MB)\n")
    print("| row | ms | vs eager |\n|---|---:|---:|")
    for name, t in rows:
        speedup = f"{ms['eager'] / t:.2f}×" if name in ("rlkernels", "kernel") else "-"
        print(f"| {name} | {t:.1f} | {speedup} |", flush=True)


if __name__ == "__main__":
    main()
