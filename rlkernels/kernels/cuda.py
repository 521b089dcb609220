"""The `cuda` backend: the compiled extension `rlkernels._C` (csrc/cuda/) on CUDA tensors.

The CUDA kernels register themselves for the same `torch.ops.rlkernels_C.*` ops as the CPU ones
(the dispatcher picks by device); they exist only when `_C` was built by a CUDA torch with nvcc
(setup.py). `available()` says which of extension, CUDA build and device is missing.
Logits fp32/bf16/fp16 (not fp64); fp32 results.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._extension import *  # noqa: F401,F403  the contract's ops, shared by the cpu and cuda backends
from ._extension import _C, missing_reason
from . import supports_all_but

# every op; policy_token_fwd_grad (the sm_90 cluster kernel, docs/design.md §7) raises on an older device when called,
# and fused_policy_loss takes it only when asked (two_pass=True) until a device run shows it exact and faster
supports = supports_all_but({})


def available() -> Tuple[bool, str]:
    """(True, description) when the compiled CUDA kernels can run, else (False, the reason)."""
    reason = missing_reason()
    if reason:
        return False, reason
    if not getattr(_C, "with_cuda", 0):
        why = ("this torch is a CPU build" if not torch.version.cuda else
               "nvcc was not found when it was built, or RLKERNELS_NO_CUDA=1")
        return False, f"rlkernels._C was built without CUDA ({why})"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, f"compiled extension rlkernels._C (CUDA {torch.version.cuda}, {torch.cuda.get_device_name()})"

