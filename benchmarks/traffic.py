"""Memory traffic and GEMM FLOPs of the loss head, from the code's own op sequence, and the time they model.

    python -m benchmarks.traffic                       # N = 8192, V = 151936, H = 4096, bf16
    python -m benchmarks.traffic --n 2048 --vocab 32768 --json traffic.json
    TRITON_INTERPRET=1 python -m benchmarks.traffic --per-call cpu triton   # the Triton launches too

On a GPU the loss head is streaming plus matmuls: its time is about its bytes over HBM bandwidth plus its
GEMM FLOPs over the matmul rate. Each path (token_logprobs, fused_policy_loss token- and sequence-level,
fused_linear_policy_loss; logits contiguous and as the `model(x).logits[:, :-1]` slice of a (B, T+1, V)
tensor) runs forward + backward on fake tensors (no memory, no arithmetic: real sizes on any machine) under
a TorchDispatchMode that adds up, for every op that is not a view:
* bytes: each tensor argument it reads and each tensor it writes, at its own size (a view of a big tensor
  counts its elements, not its storage's). A custom op (a kernel) reads its tensor inputs and writes its
  outputs and its mutated arguments; an aten op also reads an argument it updates in place, except the
  outputs of `out=` ops and the targets of `fill_`, `zero_` and `copy_`, which it only writes;
* FLOPs: 2·m·n·k for every `mm`, `addmm`, `bmm`, `baddbmm`, `addmm.dtype_out` (the head's GEMMs).
`rlkernels_C::scale_grad_`, the backward of the two-pass path, is counted as the read of its one incoming number:
the paths run `loss.backward()`, whose incoming gradient is the one the forward assumed, and the op then returns
before it touches the gradient (another incoming gradient would add one read and one write of it).
It also keeps the peak of live bytes allocated by the counted ops (fake tensors free like real ones),
the inputs included; the extra peak is that less the leaves (logits, or hidden states and head weight) and
their gradients, which must exist anyway, as a fraction of the N·V·b logits (for the hidden-state path:
of the logits it avoids).

The modelled time is bytes / 4.27 TB/s + FLOPs / 760 TFLOP/s, the copy bandwidth and bf16 dense matmul
rate measured on an H200 (benchmarks/RESULTS.md). Passes are bytes over N·V·b (b the logits' element size):
the logits path's floor is 3 (read forward, read and write backward), 2 on the two-pass path (read once and write
the gradient, both in the forward: `two_pass=True`, the cpu backend's default and the cuda backend's sm_90 cluster
kernel, docs/design.md §7, which calls the same op; the triton backend's split row, the same op with a scratch of
K partials per row, is a row derived from it: `split_row`); the hidden-state path's FLOP floor is
3·2·N·H·V (the logits, ∂hidden and ∂W products).

What the bytes do not show, the table shows beside them (`per_call`): the launches per call and the host time
per call of each path, run for real (`--per-call` backends; on a GPU at the sizes above, else on CPU tensors at
V = 16, H = 64 with the same N and B, the hidden-state rows left out). Launches: `benchmarks.launches.count`, the
Triton kernels too (launched from Python, past the dispatcher); host time: wall clock per call, which on a GPU
is the time to queue the call's kernels (a call of many small launches is host-bound when it exceeds the
modelled ms).

The inputs are fake CPU tensors and the backend is `cpu`, whose op sequence is the `cuda` backend's: both
call the extension's same ops (`rlkernels_C::*`, with fake implementations), chosen by the tensors' device.
The hidden-state path takes a GPU's choices on them (its design and their sizes, the GEMMs with an fp32
result: `rlkernels/ops/_gpu_like.py`); its rows are printed again with the design each took and its time over
the 3-GEMM floor (`designs_table`: the default, `memory_budget=None`, `chunk_size=2048`).
(Fake CUDA tensors would need a CUDA build of torch: its custom-op dispatch takes a CUDA device guard.)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import statistics
import time
import weakref
from typing import Callable, Dict, List, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.launches import FREE

HBM_BYTES_PER_S = 4.27e12
MATMUL_FLOPS_PER_S = 760e12
GEMMS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_")
WRITE_ONLY = ("fill_", "zero_", "copy_")
# returns at once when the incoming gradient is the assumed one, as in every path here (the docstring)
RETURNS_AT_ONCE = {"rlkernels_C::scale_grad_": "grad_out"}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TrafficCounter(TorchDispatchMode):
    """Bytes read and written, GEMM FLOPs and the peak of live allocated bytes of the ops run under it."""

    def __init__(self):
        super().__init__()
        self.read = self.written = self.flops = 0
        self.live = self.peak = 0
        self._seen = set()  # storages counted in `live`
        self.by_op: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace == "prim" or (func.namespace == "aten" and (func.is_view or name in FREE)):
            self._track(out)
            return out
        schema = func._schema
        read = written = 0
        mutated = set()
        key = f"{func.namespace}::{name}"
        for arg, value in zip(schema.arguments, [*args, *[kwargs.get(a.name) for a in schema.arguments[len(args):]]]):
            if key in RETURNS_AT_ONCE:
                read += sum(_nbytes(t) for t in _tensors(value)) if arg.name == RETURNS_AT_ONCE[key] else 0
                continue
            for t in _tensors(value):
                is_write = arg.alias_info is not None and arg.alias_info.is_write
                if is_write:
                    mutated.add(id(t))
                    written += _nbytes(t)
                aten_reads = func.namespace == "aten" and not arg.kwarg_only and name not in WRITE_ONLY
                if not is_write or aten_reads:
                    read += _nbytes(t)
        written += sum(_nbytes(t) for t in _tensors(out) if id(t) not in mutated and not _aliases(t, args, kwargs))
        if name in GEMMS:
            self.flops += _gemm_flops(name, args)
        self.read, self.written = self.read + read, self.written + written
        self.by_op[key] = self.by_op.get(key, 0) + read + written
        self._track(out)
        return out

    def _track(self, out):
        """Count each new storage once while it lives (views share their base's storage)."""
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._seen:
                continue
            size = storage.nbytes()
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)

    def _free(self, key, size):
        self._seen.discard(key)
        self.live -= size

    @property
    def bytes(self) -> int:
        return self.read + self.written


def _aliases(t, args, kwargs) -> bool:
    ptr = t.untyped_storage()._cdata
    return any(ptr == x.untyped_storage()._cdata for x in _tensors([*args, *kwargs.values()]))


def _gemm_flops(name: str, args) -> int:
    a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


@dataclasses.dataclass
class Traffic:
    path: str
    bytes: int
    flops: int
    peak_bytes: int
    extra_peak: float  # (peak − leaves and their gradients) / N·V·b
    passes: float  # bytes over N·V·b
    gemm_ratio: Optional[float]  # FLOPs over 3·2·N·H·V (hidden-state path)
    model_ms: float
    by_op: Dict[str, int]


@contextlib.contextmanager
def _modelling_a_gpu():
    """The hidden-state path takes a GPU's choices on the fake tensors (rlkernels/ops/_gpu_like.py)."""
    from rlkernels.ops import _gpu_like

    _gpu_like.MODEL_GPU = True
    try:
        yield
    finally:
        _gpu_like.MODEL_GPU = False


def measure(fn: Callable[[], list]):
    """Run `fn` (which builds its inputs, runs forward + backward and returns the leaves) under the
    counter; (counter, bytes of the leaves)."""
    with TrafficCounter() as counter:
        leaves = fn()
    return counter, sum(_nbytes(x) for x in leaves)


def _shapes(n: int, batch: int):
    if n % batch:
        raise ValueError(f"n: expected a multiple of the batch {batch}, got {n}")
    return batch, n // batch


def _once(step, leaves):
    step()


def _logits_inputs(n, vocab, dtype, batch, sliced, device):
    b, t = _shapes(n, batch)
    if sliced:  # the Hugging Face pattern: the model's (B, T + 1, V) logits, shifted
        parent = torch.empty(b, t + 1, vocab, dtype=dtype, device=device, requires_grad=True)
        return parent, parent[:, :-1]
    logits = torch.empty(b, t, vocab, dtype=dtype, device=device, requires_grad=True)
    return logits, logits


def _loss_args(n, batch, device):
    b, t = _shapes(n, batch)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    zeros = torch.zeros(b, t, device=device)
    targets = torch.zeros(b, t, dtype=torch.int64, device=device)
    return targets, torch.zeros(b, device=device), mask, dict(old_logp=zeros, ref_logp=zeros)


def paths(n: int, vocab: int, hidden: int, dtype: torch.dtype, backend: str, device: str, batch: int = 8,
          backward: bool = True) -> Dict[str, Callable]:
    """Name → a function `run(call)` that makes (fake) inputs, hands `call` the step that runs the path on them
    (forward, + backward by default) with the leaves it differentiates (default: runs it once), and returns
    the leaves."""
    import rlkernels
    from rlkernels import _backend, presets

    def finish(loss):
        if backward:
            loss.backward()

    def logprobs(sliced):
        def run(call=_once):
            leaf, logits = _logits_inputs(n, vocab, dtype, batch, sliced, device)
            targets = _loss_args(n, batch, device)[0]
            call(lambda: finish(rlkernels.token_logprobs(logits, targets, backend=backend).sum()), [leaf])
            return [leaf]
        return run

    def fused(preset, sliced, two_pass=False):
        def run(call=_once):
            leaf, logits = _logits_inputs(n, vocab, dtype, batch, sliced, device)
            targets, adv, mask, kw = _loss_args(n, batch, device)
            call(lambda: finish(rlkernels.fused_policy_loss(logits, targets, adv, mask, presets.get(preset),
                                                            backend=backend, two_pass=two_pass, **kw).loss), [leaf])
            return [leaf]
        return run

    def linear(preset, **design):  # design: memory_budget (default: the op's), chunk_size
        def run(call=_once):
            b, t = _shapes(n, batch)
            h = torch.empty(b, t, hidden, dtype=dtype, device=device, requires_grad=True)
            w = torch.empty(vocab, hidden, dtype=dtype, device=device, requires_grad=True)
            targets, adv, mask, kw = _loss_args(n, batch, device)
            call(lambda: finish(rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.get(preset),
                                                                   backend=backend, **design, **kw).loss), [h, w])
            return [h, w]
        return run

    out = {
        "token_logprobs": logprobs(False),
        "token_logprobs, sliced": logprobs(True),
        "fused_policy_loss grpo": fused("grpo", False),
        "fused_policy_loss grpo, sliced": fused("grpo", True),
        "fused_policy_loss gspo": fused("gspo", False),
        "fused_policy_loss gspo, sliced": fused("gspo", True),
        "fused_linear_policy_loss grpo": linear("grpo"),
        "fused_linear_policy_loss gspo": linear("gspo"),
        **{f"fused_linear_policy_loss {p}, {label}": linear(p, **design)
           for p in ("grpo", "gspo") for label, design in HIDDEN_DESIGNS.items()},
    }
    sm90 = torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)
    if _backend.kernels(backend).supports("policy_token_fwd_grad") is None and sm90:  # cpu, cuda (design.md §7)
        out["fused_policy_loss grpo, two-pass"] = fused("grpo", False, True)
        out["fused_policy_loss grpo, two-pass, sliced"] = fused("grpo", True, True)
    return out


# The hidden-state path's other designs, beside its default (vocabulary blocks within 10% of the logits where row
# chunks take more): speed first (row chunks by the speed rule), and row chunks of 2048 rows (several chunks: the
# fp32 ∂W accumulator).
HIDDEN_DESIGNS = {"memory_budget=None": dict(memory_budget=None), "chunk_size=2048": dict(chunk_size=2048)}

# the benchmark report's ops (benchmarks/workloads.py) as paths here
REPORT_PATHS = {"token_logprobs": "token_logprobs", "grpo": "fused_policy_loss grpo",
                "grpo_sliced": "fused_policy_loss grpo, sliced", "grpo_linear": "fused_linear_policy_loss grpo"}


def model(n=8192, vocab=151936, hidden=4096, dtype=torch.bfloat16, backend="cpu",
          only: Optional[List[str]] = None, batch: int = 8, backward: bool = True) -> List[Traffic]:
    """The traffic of each path (or of those named in `only`) on fake CPU tensors, `batch` rows of N / batch."""
    rows = []
    element = torch.empty(0, dtype=dtype).element_size()
    for name, run in paths(n, vocab, hidden, dtype, backend, "cpu", batch, backward).items():
        if only and name not in only and not any(o.startswith(name + ", triton split row") for o in only):
            continue
        with FakeTensorMode(), _modelling_a_gpu():
            counter, leaves = measure(run)
        linear = name.startswith("fused_linear")
        rows.append(Traffic(
            path=name, bytes=counter.bytes, flops=counter.flops, peak_bytes=counter.peak,
            extra_peak=(counter.peak - (2 if backward else 1) * leaves) / (n * vocab * element),
            passes=counter.bytes / (n * vocab * element),
            gemm_ratio=counter.flops / (3 * 2 * n * hidden * vocab) if linear else None,
            model_ms=1e3 * (counter.bytes / HBM_BYTES_PER_S + counter.flops / MATMUL_FLOPS_PER_S),
            by_op=dict(sorted(counter.by_op.items(), key=lambda kv: -kv[1])),
        ))
    if importlib.util.find_spec("triton") is None:
        return rows
    derived = [split_row(r, n, vocab, dtype) for r in rows if r.path.startswith("fused_policy_loss grpo, two-pass")]
    return [r for r in rows + derived if not only or r.path in only]


def split_row(two_pass: Traffic, n: int, vocab: int, dtype: torch.dtype) -> Traffic:
    """The two-pass row as the triton backend's split row makes it (kernels/triton/split_row.py): the same op and
    so the same bytes (the row read once, ∂logits written once), plus its scratch, counted once each way: K
    partials of 16 bytes per row written and read back (by each of the row's K programs, from L2 on a GPU: once
    from memory at most) and the N + 2 int32 counters zeroed and counted up. Its chunk's second read comes from
    L2, not HBM (docs/design.md §7): not counted, as a device run must confirm."""
    from rlkernels.kernels.triton.split_row import PARTIALS, split_plan

    chunks = split_plan(vocab, dtype, interpret=False)[3]
    scratch = 2 * n * chunks * PARTIALS.value * 4 + 2 * 4 * (n + 2)
    total = two_pass.bytes + scratch
    return dataclasses.replace(
        two_pass, path=f"{two_pass.path}, triton split row (K = {chunks})", bytes=total,
        peak_bytes=two_pass.peak_bytes + scratch // 2, passes=two_pass.passes * total / two_pass.bytes,
        model_ms=two_pass.model_ms + 1e3 * scratch / HBM_BYTES_PER_S,
        by_op={**two_pass.by_op, "split row scratch (partials, counters)": scratch})


def per_call(n, vocab, hidden, dtype, backend, device, batch=8, reps=5, only: Optional[List[str]] = None
             ) -> Dict[str, tuple]:
    """{path: (launches, host ms)} of one forward + backward of each path (or of those in `only`) on real
    tensors on `device`: the launches counted by `benchmarks.launches.count` (its ops and the Triton kernels
    it launches; the inputs' making not counted), the host time the median of `reps` wall-clock calls after a
    warm-up call. On a GPU a call returns once its kernels are queued, so that is the time the host spends per
    call; on CPU tensors the call's arithmetic is in it too (small at a tiny V and H), on one thread: a shared
    machine's idle threads wake late, which timed the scheduler (tens of ms) rather than the call. The Triton
    interpreter's time is not a host time: None there."""
    on_cpu = torch.device(device).type == "cpu"
    interpreted = backend == "triton" and on_cpu
    out = {}

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    threads = torch.get_num_threads()
    if on_cpu:
        torch.set_num_threads(1)
    try:
        for name, run in paths(n, vocab, hidden, dtype, backend, device, batch).items():
            if only is None or name in only:
                run(functools.partial(_timed, out, name, reps, sync, interpreted))
    finally:
        torch.set_num_threads(threads)
    return out


def _timed(out, name, reps, sync, interpreted, step, leaves):
    """per_call's `call`: out[name] = (launches, host ms) of `step`."""
    from benchmarks import launches

    times = []
    for i in range(2 if interpreted else reps + 2):
        for x in leaves:
            x.grad = None
        sync()
        if i == 1:  # after the warm-up (compiles, registers, allocates)
            counted = launches.count(step)
            continue
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        sync()
    out[name] = (counted.ops, None if interpreted else 1e3 * statistics.median(times[1:]))


def table_head(n, vocab, hidden, dtype, labels=()) -> str:
    """The table's title and header; `labels`: the per-call columns' (a launches and a host-time column each)."""
    floor_ms = 1e3 * 3 * 2 * n * hidden * vocab / MATMUL_FLOPS_PER_S
    extra = "".join(f" launches per call ({label}) | host ms per call ({label}) |" for label in labels)
    return "\n".join([
        f"N = {n}, V = {vocab}, H = {hidden}, {str(dtype).replace('torch.', '')}; H200 model: "
        f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s, {MATMUL_FLOPS_PER_S / 1e12:.0f} TFLOP/s; 3-GEMM floor {floor_ms:.2f} ms",
        "", "| path | passes over N·V·b | GB moved | GEMM FLOPs / 3·2·N·H·V | peak allocated (GB) | "
        "extra peak / N·V·b | modelled ms |" + extra, "|---|---|---|---|---|---|---|" + "---|---|" * len(labels)])


def table_row(r: Traffic, counts=()) -> str:
    """One path's line; `counts`: its (launches, host ms) per per-call column, (None, None) where not measured."""
    ratio = "-" if r.gemm_ratio is None else f"{r.gemm_ratio:.3f}"
    cells = "".join(f" {'-' if ops is None else ops} | {'-' if ms is None else f'{ms:.2f}'} |" for ops, ms in counts)
    return (f"| {r.path} | {r.passes:.2f} | {r.bytes / 1e9:.2f} | {ratio} | {r.peak_bytes / 1e9:.2f} | "
            f"{r.extra_peak:.1%} | {r.model_ms:.2f} |" + cells)


def designs_table(rows: List[Traffic], n, vocab, hidden, dtype) -> str:
    """The hidden-state path's rows: the design each ran (as `rlkernels/ops/_head_design.choose` takes it on a
    GPU), its extra peak and its modelled time over the 3-GEMM floor."""
    from rlkernels.ops import _head_design

    floor_ms = 1e3 * 3 * 2 * n * hidden * vocab / MATMUL_FLOPS_PER_S
    lines = ["| hidden-state path | design | extra peak / N·V·b | × 3-GEMM floor |", "|---|---|---|---|"]
    for r in rows:
        if not r.path.startswith("fused_linear"):
            continue
        label = r.path.partition(", ")[2]
        design = dict(HIDDEN_DESIGNS.get(label, {}))
        budget = design.get("memory_budget", _head_design.MEMORY_BUDGET)
        d = _head_design.choose(n, vocab, hidden, dtype, sharded=False, gpu=True, fp32_out=True, memory_budget=budget,
                                chunk_size=design.get("chunk_size"))
        pieces = (f"{-(-vocab // d.size)} vocabulary blocks of {d.size} columns" if d.kind == "vocab"
                  else f"{-(-n // d.size)} row chunk(s) of {d.size} rows")
        lines.append(f"| {r.path} | {pieces} | {r.extra_peak:.1%} | {r.model_ms / floor_ms:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="tokens (rows of logits)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--backend", default="cpu", help="whose op sequence (cpu: the cuda backend's)")
    parser.add_argument("--ops", action="store_true", help="also print each path's bytes by op")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    cuda = torch.cuda.is_available()
    parser.add_argument("--per-call", nargs="*", default=["cuda", "triton"] if cuda else ["cpu"], metavar="BACKEND",
                        help="backends whose launches and host time per call are measured on real tensors "
                             "(default: cuda triton on a GPU, else cpu; none, or no name: skip)")
    parser.add_argument("--per-call-vocab", type=int, help="their V (default: --vocab on a GPU, else 16)")
    parser.add_argument("--per-call-hidden", type=int, help="their H (default: --hidden on a GPU, else 64)")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = model(args.n, args.vocab, args.hidden, dtype, args.backend)
    device = "cuda" if cuda else "cpu"
    vocab = args.per_call_vocab or (args.vocab if cuda else 16)
    hidden = args.per_call_hidden or (args.hidden if cuda else 64)
    # The hidden-state path's design depends on V and H: at other sizes its launches are another design's.
    same = (vocab, hidden) == (args.vocab, args.hidden)
    only = [r.path for r in rows if same or not r.path.startswith("fused_linear")]
    backends = [b for b in args.per_call if b != "none"]
    # Row by row, each printed as soon as its calls are timed: a run cut at a time limit keeps the rows it finished.
    print(table_head(args.n, args.vocab, args.hidden, dtype, [f"{b} on {device}, V = {vocab}" for b in backends]),
          flush=True)
    for r in rows:
        counts = [per_call(args.n, vocab, hidden, dtype, b, device, only=[r.path]).get(r.path, (None, None))
                  if r.path in only else (None, None) for b in backends]
        print(table_row(r, counts), flush=True)
    if backends and not same:
        print(f"\nPer call: real tensors at V = {vocab}, H = {hidden} (N and B as above); the hidden-state rows are "
              "left out there (their design depends on V and H).")
    print("\n" + designs_table(rows, args.n, args.vocab, args.hidden, dtype))
    if args.ops:
        for r in rows:
            print(f"\n{r.path}:")
            for op, b in r.by_op.items():
                print(f"  {b / 1e9:10.3f} GB  {op}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
