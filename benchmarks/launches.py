"""Device ops and host syncs per loss call, forward + backward, counted by a TorchDispatchMode.

On a GPU every counted op is a kernel launch (~5 µs each) and every sync stalls the stream, so
these counts are the launch overhead of the loss head, measured deterministically on CPU:

    python -m benchmarks.launches                  # every preset, both paths, cpu backend
    python -m benchmarks.launches --backend torch  # another backend
    python -m benchmarks.launches --device cuda --backend triton   # on a GPU: the same counts there
    python -m benchmarks.launches --preset gepo --group-ids        # one call's ops, groups as group_ids
    python -m benchmarks.launches --preset grpo --sliced 256       # on logits[:, :-1] of a (256, 9, V) parent

Counted: every aten op that is not a view (views, `detach` and `empty*` allocate nothing and
launch nothing) and every custom op (one launch each; what runs inside it is not seen), except the
Triton backend's ops (`torch.library.triton_op`): their bodies run under the counter, so their aten ops
count, and each Triton kernel they launch counts once (`triton::<kernel>`; a Triton launch goes from
Python to the driver, past the dispatcher, so `triton_launches` counts it at `JITFunction.run`). A sync
is an op that copies a device value to the host: `_local_scalar_dense` (`.item()`, `bool(t)`),
`nonzero`, `equal`, `unique`, `masked_select`.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

FREE = ("detach", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "alias",
        "_unsafe_view")
SYNCS = ("_local_scalar_dense", "nonzero", "equal", "unique", "_unique", "_unique2", "unique_dim",
         "unique_consecutive", "masked_select", "item")


@contextlib.contextmanager
def triton_launches(names: Dict[str, int]):
    """While active, each Triton kernel launch adds one to `names["triton::<kernel>"]` (compiled kernels and
    the interpreter's alike)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing to count
        yield
        return
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def counted(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                names[f"triton::{self.fn.__name__}"] += 1
            with _disable_current_modes():  # the launch itself (or the interpreter's copies) is not an op
                return original(self, *args, **kwargs)
        return run

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def _triton_op_body(func):
    """The Python body of a `torch.library.triton_op`, None for any other op."""
    from torch._library import custom_ops, triton

    qualname = func._schema.name
    # every triton_op's name (torch 2.6 on); without it a Triton op counts as one op beside its kernels
    if qualname not in getattr(triton, "triton_ops_to_kernels", {}):
        return None
    return custom_ops.OPDEFS[qualname]._init_fn


class OpCounter(TorchDispatchMode):
    """Counts launches (`ops`) and host syncs (`syncs`); `names` keeps each op's count. Triton kernels count
    only inside `triton_launches(self.names)` (as `count` runs it)."""

    def __init__(self):
        super().__init__()
        self.names: Dict[str, int] = collections.Counter()
        self.sync_names: Dict[str, int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        name = packet.__name__
        namespace = func.namespace
        if namespace != "aten" and (body := _triton_op_body(func)) is not None:
            with self:  # its aten ops come back through this mode; its kernels are counted by `triton_launches`
                return body(*args, **(kwargs or {}))
        if namespace == "aten" and name in SYNCS:
            self.sync_names[name] += 1
        if namespace != "aten" or not (func.is_view or name in FREE):
            self.names[f"{namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def ops(self) -> int:
        return sum(self.names.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_names.values())


@dataclasses.dataclass
class Count:
    ops: int
    syncs: int
    names: Dict[str, int]


def loss_inputs(preset: str, B: int = 8, T: int = 256, seed: int = 0, device="cpu", group_ids: bool = False):
    """Inputs of one call with every argument the preset uses (ragged masks, off-policy); the groups of 4 rows
    of a grouped ratio as `config.group_size`, or as `group_ids` (any ids, unsorted)."""
    from rlkernels import presets

    g = torch.Generator().manual_seed(seed)
    constant = presets.fields(preset).get("agg") == "constant"  # Dr. GRPO: divides by the max completion length
    config = presets.get(preset, **({"norm_length": T} if constant else {}))
    grouped = config.ratio in ("group_expectation", "snis")
    if grouped and not group_ids:
        config = config.replace(group_size=4)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    targets = torch.randint(0, 1000, (B, T), generator=g)
    old_logp = -torch.rand(B, T, generator=g) * 5
    kwargs = dict(old_logp=old_logp, ref_logp=old_logp + 0.1 * torch.randn(B, T, generator=g))
    advantages = torch.randn(B, generator=g)
    if config.ratio == "snis":
        kwargs["rewards"], advantages = torch.randint(0, 2, (B,), generator=g).float(), None
    if grouped and group_ids:
        kwargs["group_ids"] = (torch.arange(B) // 4 * 7).flip(0)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return config, to(targets), to(advantages), to(mask), {k: to(v) for k, v in kwargs.items()}


def count(fn) -> Count:
    """Ops and syncs of `fn()` (which runs one forward and backward)."""
    with OpCounter() as counter, triton_launches(counter.names):
        fn()
    return Count(counter.ops, counter.syncs, dict(counter.names) | {f"SYNC {k}": v for k, v in counter.sync_names.items()})


def fused_policy_loss_count(preset: str, backend: Optional[str] = None, vocab: int = 1000, device="cpu",
                            group_ids: bool = False, B: int = 8, T: int = 256, sliced: bool = False) -> Count:
    """Ops and syncs of one call on (B, T, V) logits; `sliced`: on `parent[:, :-1]` of a (B, T + 1, V) parent,
    as a causal LM's logits are aligned with their targets."""
    import rlkernels

    config, targets, advantages, mask, kwargs = loss_inputs(preset, B=B, T=T, device=device, group_ids=group_ids)
    parent = torch.randn(B, T + sliced, vocab, generator=torch.Generator().manual_seed(1))
    parent = parent.to(device).requires_grad_(True)

    def call():
        logits = parent[:, :-1] if sliced else parent
        out = rlkernels.fused_policy_loss(logits, targets, advantages, mask, config, backend=backend, **kwargs)
        out.loss.backward()

    call()  # first call: op registration and lazy imports are not part of the count
    return count(call)


def fused_linear_policy_loss_count(preset: str, chunk_size: int, backend: Optional[str] = None,
                                   vocab: int = 1000, hidden: int = 64, device="cpu") -> Count:
    import rlkernels

    config, targets, advantages, mask, kwargs = loss_inputs(preset, device=device)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(*targets.shape, hidden, generator=g).to(device).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_(True)

    def call():
        out = rlkernels.fused_linear_policy_loss(h, w, targets, advantages, mask, config, backend=backend,
                                                 chunk_size=chunk_size, **kwargs)
        out.loss.backward()

    call()
    return count(call)


def linear_split(preset: str, backend: Optional[str] = None, rows: int = 8 * 256, device="cpu"):
    """(ops per chunk, ops besides the chunks, syncs) from two chunk sizes: ops = a + b·chunks."""
    c1 = fused_linear_policy_loss_count(preset, rows // 4, backend, device=device)
    c2 = fused_linear_policy_loss_count(preset, rows // 8, backend, device=device)
    per_chunk = (c2.ops - c1.ops) / 4
    return per_chunk, c1.ops - 4 * per_chunk, max(c1.syncs, c2.syncs)


def table(backend: Optional[str] = None, device="cpu") -> str:
    from rlkernels import presets

    lines = ["| preset | ratio | fused_policy_loss ops | syncs | fused_linear_policy_loss ops per chunk | besides | syncs |",
             "|---|---|---|---|---|---|---|"]
    for name in presets.NAMES:
        c = fused_policy_loss_count(name, backend, device=device)
        per_chunk, besides, lsyncs = linear_split(name, backend, device=device)
        lines.append(f"| {name} | {loss_inputs(name)[0].ratio} | {c.ops} | {c.syncs} | {per_chunk:g} | {besides:g} | {lsyncs} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="rlkernels backend (default: automatic, cpu on CPU)")
    parser.add_argument("--device", default="cpu", help="where the inputs live (cpu, cuda)")
    parser.add_argument("--preset", default=None, help="print the op names of one preset's fused_policy_loss call")
    parser.add_argument("--group-ids", action="store_true",
                        help="with --preset: a grouped ratio's groups as group_ids, not config.group_size")
    parser.add_argument("--sliced", type=int, default=0, metavar="B",
                        help="with --preset: the call on logits[:, :-1] of a (B, 9, V) parent")
    args = parser.parse_args(argv)
    if args.preset:
        shape = dict(B=args.sliced, T=8, sliced=True) if args.sliced else {}
        c = fused_policy_loss_count(args.preset, args.backend, device=args.device, group_ids=args.group_ids, **shape)
        for name, n in sorted(c.names.items(), key=lambda kv: -kv[1]):
            print(f"{n:5d}  {name}")
        print(f"{c.ops} ops, {c.syncs} syncs")
        return
    print(table(args.backend, args.device))


if __name__ == "__main__":
    main()
