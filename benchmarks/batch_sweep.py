"""Host cost of the sliced logits path against the batch size: ops per call and host time per call.

    python -m benchmarks.batch_sweep                    # grpo, cpu backend, B = 8 ... 256
    python -m benchmarks.batch_sweep --preset gspo --backend torch

Each call is `fused_policy_loss(parent[:, :-1], ...)` forward + backward on a (B, T + 1, V) parent, the
shape a causal LM's logits are sliced to, and beside it the same call on contiguous (B, T, V) logits.
T and V are tiny (4 and 32), so that the kernels' work is small beside the host's: the time per call
is then what Python, the dispatcher and each launch cost, and it stays flat in B when every kernel
reads the slice in one launch (it grew by one launch per sequence while the slice was read block by
block); what grows with B at equal ops is the work on B·T rows. One thread. Ops:
`benchmarks.launches.count` (a GPU launch each). Time: the median and the minimum of `reps` calls
after warm-up calls, gradients cleared between calls (not timed); the machine's other load shows in
the median first.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from benchmarks import launches

BATCHES = (8, 16, 32, 64, 128, 256)


T, VOCAB = 4, 32


def loss_call(preset: str, B: int, sliced: bool = True, backend: Optional[str] = None):
    """(call, parent): one forward + backward of `fused_policy_loss` on `parent[:, :-1]` (sliced) or `parent`."""
    import rlkernels

    config, targets, advantages, mask, kwargs = launches.loss_inputs(preset, B=B, T=T)
    targets = targets % VOCAB
    parent = torch.randn(B, T + sliced, VOCAB, generator=torch.Generator().manual_seed(1)).requires_grad_(True)

    def call():
        logits = parent[:, :-1] if sliced else parent
        out = rlkernels.fused_policy_loss(logits, targets, advantages, mask, config, backend=backend, **kwargs)
        out.loss.backward()

    return call, parent


def host_us(call, parent, reps: int = 50, warmup: int = 5):
    """(median, minimum) microseconds per call."""
    times = []
    for i in range(warmup + reps):
        parent.grad = None
        start = time.perf_counter()
        call()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def kernel_us(call, parent, reps: int = 20) -> float:
    """Microseconds per call spent inside the extension's kernels (`rlkernels_C::` ops, their self time in
    torch.profiler): on the cpu backend the kernels run on the host, and their work grows with the B·T rows."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            parent.grad = None
            call()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("rlkernels_C::")) / reps


def sweep(preset: str = "grpo", backend: Optional[str] = "cpu", batches=BATCHES, reps: int = 50):
    """Rows (B, sliced ops, syncs, sliced (median, min) µs, sliced kernels' µs, contiguous ops, contiguous
    (median, min) µs)."""
    rows = []
    for B in batches:
        row = [B]
        for sliced in (True, False):
            call, parent = loss_call(preset, B, sliced, backend=backend)
            call()  # op registration and lazy imports are not part of the count
            c = launches.count(call)
            if sliced:
                row += [c.ops, c.syncs, host_us(call, parent, reps), kernel_us(call, parent)]
            else:
                row += [c.ops, host_us(call, parent, reps)]
        rows.append(row)
    return rows


def table(rows) -> str:
    """The host's own time per call is the minimum less the kernels' time (their work on the B·T rows)."""
    base = rows[0][3][1] - rows[0][4]
    lines = ["| B | ops | syncs | µs per call, median | min | kernels | min less kernels "
             f"| × B = {rows[0][0]}'s | contiguous: ops | median | min |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {B} | {ops} | {syncs} | {us[0]:.0f} | {us[1]:.0f} | {k:.0f} | {us[1] - k:.0f} | "
              f"{(us[1] - k) / base:.2f} | {c_ops} | {c_us[0]:.0f} | {c_us[1]:.0f} |"
              for B, ops, syncs, us, k, c_ops, c_us in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="grpo")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host cost, not the kernels' parallel speed-up
    print(f"{args.preset}, backend {args.backend}, fused_policy_loss(parent[:, :-1]) forward + backward, "
          f"T = {T}, V = {VOCAB}, one thread")
    print(table(sweep(args.preset, args.backend, reps=args.reps)))


if __name__ == "__main__":
    main()
