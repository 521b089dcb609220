"""The `cpu` backend: the compiled extension `rlkernels._C` (csrc/cpu/), OpenMP and vectorised.

The ops are registered by the extension as `torch.ops.rlkernels_C.*`; importing `_C` is what
registers them. When the extension is missing (a pure-Python install, a failed build, a CPU
without the instruction set it was compiled for) the import error is kept and reported by
`available()`; `rlkernels._backend` then falls back to the `torch` backend.
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
    """(True, description) when the compiled CPU kernels can run, else (False, the reason)."""
    if _C is None:
        return False, f"rlkernels._C is not importable ({_IMPORT_ERROR}); build it with " \
                      "`pip install --no-build-isolation -e .`"
    return True, f"compiled extension rlkernels._C (cpu isa: {_C.cpu_capability}, " \
                 f"{torch.get_num_threads()} threads)"


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
