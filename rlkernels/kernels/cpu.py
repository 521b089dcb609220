"""The `cpu` backend: the compiled extension `rlkernels._C` (csrc/cpu/), OpenMP and vectorised.

When the extension is missing `available()` says why and `rlkernels._backend` falls back to the
`torch` backend.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._extension import *  # noqa: F401,F403  the contract's ops, shared by the cpu and cuda backends
from ._extension import _C, missing_reason


def available() -> Tuple[bool, str]:
    """(True, description) when the compiled CPU kernels can run, else (False, the reason)."""
    reason = missing_reason()
    if reason:
        return False, reason
    return True, f"compiled extension rlkernels._C (cpu isa: {_C.cpu_capability}, {torch.get_num_threads()} threads)"
