"""The logits arguments shared by the ops on logits: their checks, and their rows as kernel blocks."""
from __future__ import annotations

import functools
from typing import List, Tuple

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


def row_blocks(logits: Tensor, in_place: bool = True) -> List[Tuple[int, int, Tensor]]:
    """`logits (..., V)` as `(start, end, block)`: 2-D `(end − start, V)` blocks holding the
    flattened rows start:end, which the kernels can read where they are. The whole tensor when it
    is contiguous; with `in_place`, the blocks `logits[b]` of a `(B, T, V)` slice whose blocks are
    contiguous (`model(x).logits[:, :-1]`), so that its N × V values are not copied; otherwise
    one contiguous copy."""
    vocab = logits.shape[-1]
    if in_place and not logits.is_contiguous() and logits.dim() == 3 and logits.shape[0] > 0 and logits[0].is_contiguous():
        blocks = list(logits.unbind(0))
    else:
        blocks = [logits.reshape(-1, vocab).contiguous()]
    out, start = [], 0
    for block in blocks:
        out.append((start, start + block.shape[0], block))
        start += block.shape[0]
    return out


def run_blocks(kernel, blocks, per_row, *args):
    """`kernel(block, *(x[s:e] for x in per_row), *args)` over the blocks, outputs concatenated
    (no concatenation for one block). `per_row` entries may be None (passed as None)."""
    parts = [kernel(block, *(None if x is None else x[s:e] for x in per_row), *args) for s, e, block in blocks]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


class _SoftCapped:
    """A backend's kernels with a final-logit cap bound: every pass over logits reads them as
    c·tanh(z/c) (kernels/__init__.py); the other kernels are the backend's own."""

    def __init__(self, kernels, softcap: float):
        self._kernels = kernels
        for name in ("token_logprobs_fwd", "token_logprobs_bwd", "policy_token_fwd"):
            if hasattr(kernels, name):  # the torch backend has no fused policy kernel
                setattr(self, name, functools.partial(getattr(kernels, name), softcap=softcap))

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def with_softcap(kernels, softcap: float):
    """`kernels` whose passes over logits apply the cap `softcap` (0.0: `kernels` themselves)."""
    return _SoftCapped(kernels, softcap) if softcap else kernels
