"""The `cuda` backend: the compiled extension `rlkernels._C` (csrc/cuda/) on CUDA tensors.

The CUDA kernels register themselves for the same `torch.ops.rlkernels_C.*` ops as the CPU ones
(the dispatcher picks by device); they exist only when `_C` was built by a CUDA torch with nvcc
(setup.py). `available()` says which of extension, CUDA build and device is missing.
Logits fp32/bf16/fp16 (not fp64); fp32 results.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

try:
    from rlkernels import _C
except ImportError as e:  # not built, or built for another CPU / torch: report why
    _C = None
    _IMPORT_ERROR: Optional[ImportError] = e
else:
    _IMPORT_ERROR = None


def available() -> Tuple[bool, str]:
    """(True, description) when the compiled CUDA kernels can run, else (False, the reason)."""
    if _C is None:
        return False, f"rlkernels._C is not importable ({_IMPORT_ERROR}); build it with " \
                      "`pip install --no-build-isolation -e .`"
    if not getattr(_C, "with_cuda", 0):
        why = "this torch is a CPU build" if not torch.version.cuda else \
            "nvcc was not found when it was built, or RLKERNELS_NO_CUDA=1"
        return False, f"rlkernels._C was built without CUDA ({why})"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, f"compiled extension rlkernels._C (CUDA {torch.version.cuda}, {torch.cuda.get_device_name()})"


def token_logprobs_fwd(logits, targets, temperature, need_entropy):
    """(logp, entropy, lse) of (N, V) logits; see rlkernels/kernels/__init__.py."""
    return torch.ops.rlkernels_C.token_logprobs_fwd(logits, targets, float(temperature), bool(need_entropy))


def token_logprobs_bwd(logits, targets, lse, entropy, grad_logp, grad_entropy, temperature, out=None):
    """grad_logits (N, V) in the dtype of logits, written into `out` when given (it may be `logits`
    itself); see rlkernels/kernels/__init__.py."""
    if out is None:
        return torch.ops.rlkernels_C.token_logprobs_bwd(
            logits, targets, lse, entropy, grad_logp, grad_entropy, float(temperature))
    torch.ops.rlkernels_C.token_logprobs_bwd_out(
        logits, targets, lse, entropy, grad_logp, grad_entropy, float(temperature), out)
    return out
