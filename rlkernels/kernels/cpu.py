"""The `cpu` backend: the compiled extension `rlkernels._C` (csrc/cpu/), OpenMP and vectorised.

When the extension is missing `available()` says why and `rlkernels._backend` falls back to the
`torch` backend.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._extension import (  # noqa: F401
    _C, covariance_choice, missing_reason, policy_token_fwd, policy_token_loss, token_logprobs_bwd, token_logprobs_fwd,
)


def available() -> Tuple[bool, str]:
    """(True, description) when the compiled CPU kernels can run, else (False, the reason)."""
    reason = missing_reason()
    if reason:
        return False, reason
    return True, f"compiled extension rlkernels._C (cpu isa: {_C.cpu_capability}, {torch.get_num_threads()} threads)"
