"""The one place that chooses a backend (docs/design.md §6); the only reader of RLKERNELS_BACKEND.

Auto (`backend=None`, or RLKERNELS_BACKEND unset/"auto"): CUDA tensors → cuda, else triton,
else torch; CPU tensors → cpu if the extension is built, else torch. Auto falls back quietly;
an explicit request for a backend that is unavailable raises with the reason.
"""
from __future__ import annotations

import importlib
import os
from typing import Dict, Optional

import torch

BACKENDS = ("triton", "cuda", "cpu", "torch")
ENV_VAR = "RLKERNELS_BACKEND"
_MODULES = {
    "triton": "rlkernels.kernels.triton",
    "cuda": "rlkernels.kernels.cuda",
    "cpu": "rlkernels.kernels.cpu",
    "torch": "rlkernels.kernels.torch_chunked",
}
# CUDA before Triton where both exist: on an H200 (benchmarks/RESULTS.md) its forward ran at 90%
# of the copy rate against Triton's 69%, GRPO forward + backward 2.11 against 2.38 ms.
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}
_status: Dict[str, tuple] = {}
# an optional package a backend needs: how to get it (CUDA builds of torch install triton themselves)
_HOW_TO_GET = {"triton": "; install it with `pip install triton` (or the extra: pip install -e '.[triton]'), "
                         "on Linux with a CUDA GPU"}


def _probe(name: str):
    """(module or None, reason) — imported once; the import error is kept to report it."""
    if name not in _status:
        try:
            module = importlib.import_module(_MODULES[name])
        except ImportError as e:  # the optional dependency or the extension is missing
            how = _HOW_TO_GET.get(e.name, "") if isinstance(e, ModuleNotFoundError) else ""
            _status[name] = (None, f"cannot import {_MODULES[name]}: {e}{how}")
        else:
            ok, reason = module.available()
            _status[name] = (module if ok else None, reason)
    return _status[name]


def available(name: str) -> bool:
    """Whether backend `name` can run here (its module imports and says so)."""
    return _probe(name)[0] is not None


def backend_info() -> Dict[str, Dict[str, object]]:
    """{backend: {"available": bool, "reason": str}} for every backend."""
    return {name: {"available": available(name), "reason": _probe(name)[1]} for name in BACKENDS}


def _device_ok(name: str, device: torch.device) -> bool:
    if name == "triton":  # the Triton interpreter runs kernels on CPU tensors
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if name == "cuda":
        return device.type == "cuda"
    if name == "cpu":
        return device.type == "cpu"
    return True


def resolve(backend: Optional[str], device: torch.device) -> str:
    """The backend to run on tensors of `device`: `backend`, else RLKERNELS_BACKEND, else auto."""
    requested = backend if backend is not None else os.environ.get(ENV_VAR, "auto") or "auto"
    source = "backend" if backend is not None else ENV_VAR
    if requested == "auto":
        for name in _AUTO_ORDER.get(device.type, ("torch",)):
            if available(name) and _device_ok(name, device):
                return name
        return "torch"
    if requested not in BACKENDS:
        raise ValueError(f"{source}: expected one of {BACKENDS + ('auto',)}, got {requested!r}")
    module, reason = _probe(requested)
    if module is None:
        raise RuntimeError(f"{source}: backend {requested!r} is not available: {reason}")
    if not _device_ok(requested, device):
        raise ValueError(f"{source}: backend {requested!r} cannot run on {device.type} tensors")
    return requested


def kernels(name: str):
    """The kernels of an available backend: its module, a `kernels.Kernels`."""
    module, reason = _probe(name)
    if module is None:
        raise RuntimeError(f"backend {name!r} is not available: {reason}")
    return module

