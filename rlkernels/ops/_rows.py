"""The logits arguments shared by the ops on logits: their checks, and their rows as the kernels read them."""
from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._checks import FLOAT_DTYPES, INT_DTYPES, check_targets, check_temperature, check_tensor


def kernel_checks_targets(backend: str) -> bool:
    """Whether `backend`'s kernels check every target on the host (naming its row): then no
    device assert is needed before them."""
    return backend == "cpu"


def check_logits_args(logits: Tensor, targets: Tensor, temperature, backend: str) -> float:
    """Validate logits `(..., V)`, aligned targets and the temperature for `backend`; returns τ."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    check_tensor("targets", targets, shape=tuple(logits.shape[:-1]), dtypes=INT_DTYPES, device=logits.device)
    temperature = check_temperature(temperature)
    if not kernel_checks_targets(backend):
        check_targets(targets, logits.shape[-1], "V = logits.shape[-1]")
    return temperature


@dataclasses.dataclass
class LogitsRows:
    """A logits argument `(..., V)` as the kernels read it, and where its gradient goes.

    `blocks`: `(start, end, block)`, views holding the flattened rows start:end as the kernels take them
    (`(N, V)` or `(B, T, V)`, unit stride over V: kernels/__init__.py), read where they lie, each in one
    launch; one block unless the view's leading dims do not collapse into two strides. `grad_input`: the tensor autograd is handed ∂ of: the logits, or the
    parent they are a box of (`model(x).logits[:, :-1]`: the (B, T + 1, V) output), so that autograd does
    not zero-fill a parent-sized gradient and copy ours into it (2 passes over N × V, and a second
    parent-sized buffer). `box`: the logits' place in `grad_input` (None: the logits themselves)."""

    logits: Tensor  # detached
    blocks: List[Tuple[int, int, Tensor]]
    grad_input: Tensor
    box: Optional[Tuple[slice, ...]] = None
    view: Optional[Tensor] = None  # with a box: the logits as the caller holds them (their node is in the graph)

    def inputs(self) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """The autograd inputs of a node over these rows: the logits, and for a box view its parent and
        `FULL_BACKWARD_PROBE` (else None, None)."""
        return (self.grad_input, None, None) if self.box is None else (self.view, self.grad_input, FULL_BACKWARD_PROBE)

    def in_backward(self) -> "LogitsRows":
        """The rows as this backward writes their gradient: into the parent's box only where nothing can observe
        the view in this graph task (`_observed`), else the view's own gradient, which autograd then hands on."""
        if self.box is None or not _observed(self.view):
            return self
        return dataclasses.replace(self, grad_input=self.view, box=None, view=None)

    def returned(self, target: "LogitsRows", grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        """`grad` (of `target.grad_input`) as the gradients of `inputs()`."""
        if self.box is None:
            return grad, None, None
        return (None, grad, None) if target.box is not None else (grad, None, None)

    def new_grad(self) -> Tuple[Tensor, List[Tensor]]:
        """A new gradient of `grad_input`'s shape, and its blocks where the kernels write the rows of
        `blocks`; the parent's rows outside the box are zeroed (a few strided fills, no sync)."""
        logits = self.logits
        grad = torch.empty(self.grad_input.shape, dtype=logits.dtype, device=logits.device)
        if self.box is None:
            flat = grad.view(-1, logits.shape[-1])
            return grad, [flat[s:e].view(block.shape) for s, e, block in self.blocks]
        for k in range(len(self.box) - 1):  # outside the box along dim k, inside it along the dims before
            inner, (start, stop), size = self.box[:k], (self.box[k].start, self.box[k].stop), grad.shape[k]
            for outside in (slice(0, start), slice(stop, size)):
                if outside.stop > outside.start:
                    grad[inner + (outside,)].zero_()
        return grad, [block for _, _, block in _blocks(_pieces(grad[self.box].view(logits.shape)))]


def logits_rows(logits: Tensor, in_place: bool = True, to_parent: bool = False) -> LogitsRows:
    """The rows of `logits (..., V)`. With `in_place`, a view with unit stride over V (`logits[:, :-1]`,
    `logits[:, -C - 1:-1]`, `logits[a:b]`) is read where it lies, in one launch per kernel when its
    leading dims collapse into at most two strides (a batch stride and a row stride; else one per index
    of its first dim); otherwise one contiguous copy is read. With `to_parent`, the gradient goes to the
    parent of a box view that autograd would give it to anyway (`LogitsRows.grad_input`): a view by one
    plain view op with no hook or retain_grad on it; any other view leaves its gradient to autograd (one copy)."""
    vocab, detached = logits.shape[-1], logits.detach()
    pieces = _pieces(detached) if in_place else None
    if pieces is None:
        return LogitsRows(detached, _blocks([detached.reshape(-1, vocab).contiguous()]), logits)
    rows = LogitsRows(detached, _blocks(pieces), logits)
    parent = logits._base
    if to_parent and parent is not None and parent.requires_grad and _autograd_hands_on(logits, parent):
        box = _box(logits, parent)
        if box is not None:
            rows.grad_input, rows.box, rows.view = parent, box, logits
    return rows


# An input of every node over a box view that nobody can ask a gradient of: the engine runs its node only in a
# backward that computes every gradient (`loss.backward()`, no `inputs=`). In any other (autograd.grad, inputs=)
# the view, or a tensor between it and its parent, may be what is asked for, and its gradient must reach it.
FULL_BACKWARD_PROBE = torch.zeros((), requires_grad=True)
# its AccumulateGrad node, held so that every graph has the same one (a leaf keeps its node only weakly)
_PROBE_NODE = (FULL_BACKWARD_PROBE * 1).grad_fn.next_functions[0][0]


def _observed(view: Tensor) -> bool:
    """Whether anything could see the gradient of `view` in the backward now running: a tensor hook or
    retain_grad on it (set before or after the call), or a backward that computes only some gradients
    (`FULL_BACKWARD_PROBE`). Called in a backward. Hooks put on the view's node itself (`view.grad_fn.register_
    prehook`) are not visible from Python (torch has no query for them) and are not seen (docs/design.md §4)."""
    return bool(view._backward_hooks) or view.retains_grad or not torch._C._will_engine_execute_node(_PROBE_NODE)


# The nodes of view ops whose backward only puts the gradient in its place in the input (`_box` checks where).
_PLAIN_VIEW = re.compile(r"(Slice|Select|View|AsStrided|Unsqueeze|Squeeze|Alias)Backward\d+")


def _autograd_hands_on(view: Tensor, base: Tensor) -> bool:
    """Whether autograd would hand the gradient of `view` to `base` unchanged but for its place: one plain view
    op's node between them and no hook or retain_grad on `view`. Anything else is left to autograd: an
    autograd.Function returning its input as a view (gradient reversal or scaling, tensor-parallel regions),
    or a chain of view ops, whose inner tensors may hold hooks that Python cannot see on their nodes."""
    node = view.grad_fn
    if node is None or not _PLAIN_VIEW.fullmatch(node.name()) or len(node.next_functions) != 1:
        return False
    if view._backward_hooks or view.retains_grad:
        return False
    target = node.next_functions[0][0]
    return target is base.grad_fn if base.grad_fn is not None else getattr(target, "variable", None) is base


def _blocks(pieces: List[Tensor]) -> List[Tuple[int, int, Tensor]]:
    out, start = [], 0
    for piece in pieces:
        rows = piece.shape[:-1].numel()
        out.append((start, start + rows, piece))
        start += rows
    return out


def _pieces(x: Tensor) -> Optional[List[Tensor]]:
    """`x (..., V)` as views the kernels read in one launch each, in row order: `x` itself as `(N, V)` or
    `(B, T, V)` when its leading dims collapse into at most two strides, else the pieces of each index of
    its first dim; None when V's stride is not 1."""
    if x.numel() == 0:
        return [x.reshape(-1, x.shape[-1])]
    if x.stride(-1) != 1:
        return None
    merged = []  # (size, stride) of the leading dims, adjacent ones merged where their strides allow
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) <= 2:
        sizes = [size for size, _ in merged] or [1]
        return [x.view(*sizes, x.shape[-1])]
    out = []
    for sub in x.unbind(0):
        part = _pieces(sub)
        if part is None:
            return None
        out += part
    return out


def _box(view: Tensor, parent: Tensor) -> Optional[Tuple[slice, ...]]:
    """`view` as `parent[box]` (up to dims of size 1) with a slice of unit step per dim of a contiguous
    parent and whole rows of V, or None (a permuted, stepped or reinterpreted view)."""
    vocab = view.shape[-1]
    if not parent.is_contiguous() or parent.dtype != view.dtype or parent.shape[-1] != vocab:
        return None
    offset, starts = view.storage_offset() - parent.storage_offset(), []
    for size, stride in zip(parent.shape, parent.stride()):  # contiguous: the offset splits into one start per
        start = 0  # dim of size > 1 (one of size 1 may have any stride, 0 from numpy, DLPack or empty_strided)
        if size > 1:
            start, offset = divmod(offset, stride)
        starts.append(start)
    lengths, last = [1] * parent.dim(), -1
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        dims = [k for k in range(last + 1, parent.dim()) if parent.stride(k) == stride and parent.shape[k] > 1]
        if not dims:
            return None
        last = dims[0]
        lengths[last] = size
    if starts[-1] != 0 or lengths[-1] != vocab or any(s + n > size for s, n, size in zip(starts, lengths, parent.shape)):
        return None
    return tuple(slice(s, s + n) for s, n in zip(starts, lengths))


def run_blocks(kernel, blocks, per_row, *args):
    """`kernel(block, *(x[s:e] for x in per_row), *args)` over the blocks, outputs concatenated
    (no concatenation for one block). `per_row` entries may be None (passed as None)."""
    parts = [kernel(block, *(None if x is None else x[s:e] for x in per_row), *args) for s, e, block in blocks]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(outputs) for outputs in zip(*parts))

