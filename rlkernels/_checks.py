"""Argument checks shared by the public functions.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
shape or value) with a message that starts with the argument's name and says what was
expected and what was given, e.g. ``"group_ids: expected shape (8,) matching rewards, got (7,)"``.
Each returns its (possibly converted) argument so calls read as assignments.
"""
from __future__ import annotations

import math
import numbers
from typing import Collection, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _shape(shape: Sequence) -> str:
    """``(8,)`` / ``(4, 6)`` / ``(4, *)`` -- like ``tuple`` but ``None`` prints as ``*``."""
    items = ["*" if s is None else str(s) for s in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _dtypes(dtypes: Collection[torch.dtype]) -> str:
    if set(dtypes) == set(FLOAT_DTYPES):
        return "a floating dtype"
    if set(dtypes) == set(INT_DTYPES):
        return "an integer dtype"
    return "one of " + ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    dtypes: Optional[Collection[torch.dtype]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """``t`` is a tensor with ``ndim`` dims, ``shape`` (``None`` entries match any size),
    a dtype in ``dtypes`` and on ``device`` -- each only when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {_shape(t.shape)}")
    if shape is not None and (
        t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))
    ):
        raise ValueError(f"{name}: expected shape {_shape(shape)}, got {_shape(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected {_dtypes(dtypes)}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_same_shape(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """``t`` (already known to be a tensor) has the shape and device of ``ref``."""
    if t.shape != ref.shape:
        raise ValueError(
            f"{name}: expected shape {_shape(ref.shape)} matching {ref_name}, got {_shape(t.shape)}"
        )
    if t.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} like {ref_name}, got {t.device}")
    return t


def check_on_device(ok: torch.Tensor, msg: str, error=ValueError) -> None:
    """Assert a bool tensor `ok` without copying it to the host (`torch._assert_async`): a CUDA
    kernel asserts later, on its stream; on CPU the check runs now and raises `error`."""
    try:
        torch._assert_async(ok, msg)
    except RuntimeError:
        raise error(msg) from None


def check_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask given as bool or as numbers that are all 0 or 1; returns it as bool.
    The values are checked on the device, without a synchronisation (`check_on_device`)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name}: expected a bool or real tensor of 0/1, got {mask.dtype}")
    check_on_device(((mask == 0) | (mask == 1)).all(), f"{name}: expected a bool tensor or numbers that are all 0 or 1")
    return mask != 0


def check_targets(targets: torch.Tensor, vocab, what: str) -> torch.Tensor:
    """Token ids in [0, vocab) (an int, or a 0-d device tensor); `what` says where V comes from. Checked on the device
    (`check_on_device`: no synchronisation, and traceable by torch.compile); the CPU kernels on
    logits check on the host and name the row, so their callers skip this (not the hidden-state path's:
    its kernels read padded blocks)."""
    if targets.numel():
        bound = vocab if isinstance(vocab, int) else "V"
        # ⌊t / V⌋ = 0 exactly when 0 ≤ t < V: one elementwise op where two comparisons and an `and` were.
        in_range = (targets.div(vocab, rounding_mode="floor") == 0).all()
        check_on_device(in_range, f"targets: expected values in [0, {bound}) ({what})")
    return targets


def check_real(
    name: str,
    x,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    optional: bool = False,
) -> Optional[float]:
    """A finite real Python number (not a bool, not a tensor) in the range [lo, hi]
    (open ends where asked); returns it as ``float``. ``optional``: None passes (and is returned)."""
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__}")
    x = float(x)
    too_low = lo is not None and (x <= lo if lo_open else x < lo)
    too_high = hi is not None and (x >= hi if hi_open else x > hi)
    if not math.isfinite(x) or too_low or too_high:
        lb = "-inf" if lo is None else f"{lo:g}"
        hb = "inf" if hi is None else f"{hi:g}"
        rng = f"{'(' if lo_open or lo is None else '['}{lb}, {hb}{')' if hi_open or hi is None else ']'}"
        raise ValueError(f"{name}: expected a finite number in {rng}, got {x!r}")
    return x


# The kernels multiply by 1/τ in fp32: below this τ the inverse overflows to inf.
MIN_TEMPERATURE = 1.0 / torch.finfo(torch.float32).max


def _check_invertible(name: str, x, expected: str, why: str = "") -> float:
    """A finite x > 0 whose inverse is finite in fp32 (x ≥ 2.9e-39: the kernels multiply by 1/x); as float."""
    x = check_real(name, x, 0, lo_open=True)
    if x < MIN_TEMPERATURE:
        raise ValueError(f"{name}: expected {expected} >= {MIN_TEMPERATURE:.3g}{why}, got {x!r}")
    return x


def check_temperature(temperature) -> float:
    """A finite temperature whose inverse is finite in fp32; returns it as float."""
    return _check_invertible("temperature", temperature, "a number", " (1/τ must be finite in fp32)")


def check_softcap(softcap) -> float:
    """A final-logit cap c (None: none) as the kernels take it: a float, 0.0 for none."""
    return 0.0 if softcap is None else _check_invertible("softcap", softcap, "None or a number")


def check_int(name: str, x, lo: Optional[int] = None, what: Optional[str] = None,
              optional: bool = False) -> Optional[int]:
    """A Python int (not a bool) that is at least ``lo``; ``what`` overrides the wording.
    ``optional``: None passes (and is returned)."""
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name}: expected {what or f'an int >= {lo}'}, got {x}")
    return x


def check_choice(name: str, x, choices: Sequence) -> object:
    """``x`` is one of ``choices`` (compared with ``==``, types included)."""
    if not any(type(x) is type(c) and x == c for c in choices):
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {x!r}")
    return x
