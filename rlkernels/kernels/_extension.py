"""The compiled extension `rlkernels._C`, shared by the `cpu` and `cuda` backends.

Its ops `torch.ops.rlkernels_C.*` have a CPU and (in a CUDA build) a CUDA implementation; the
dispatcher picks by the tensors' device, so both backends call the same wrappers. When the
extension is missing (a pure-Python install, a failed build, a CPU without the instruction set
it was compiled for) the import error is kept for `available()` to report.

The extension raises every argument error as a RuntimeError whose message starts with the Python
class it stands for (csrc/include/rlkernels/checks.h); `python_errors` raises that class instead.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from . import supports_all_but

# what the cpu and cuda backends take from here: the contract's ops (kernels/__init__.py)
__all__ = ["supports", "token_logprobs_fwd", "token_logprobs_bwd", "policy_token_fwd", "policy_token_fwd_grad",
           "scale_grad_", "policy_token_loss", "covariance_choice"]

# import_module, not `from rlkernels import _C`: while rlkernels is still initialising, a missing _C would be
# reported as "cannot import name '_C' from partially initialized module ... (circular import)"
try:
    _C = importlib.import_module("rlkernels._C")
except ModuleNotFoundError as e:
    _C = None
    IMPORT_ERROR: Optional[str] = ("this install has no compiled extension (a pure-Python install, or a build "
                                   "without torch)" if e.name == "rlkernels._C" else str(e))
except ImportError as e:  # built for another CPU / torch: report why
    _C = None
    IMPORT_ERROR = str(e)
else:
    IMPORT_ERROR = None


def missing_reason() -> Optional[str]:
    """Why the extension cannot be used, or None."""
    if _C is None:
        return (f"rlkernels._C is not importable: {IMPORT_ERROR}; build it with torch installed: "
                f"`pip install --no-build-isolation -e .`")
    return None


supports = supports_all_but({})

_ERRORS = {"ValueError: ": ValueError, "TypeError: ": TypeError}


def python_errors(op):
    """`op` (a call of the extension's ops) raising their argument errors as the ValueError or TypeError
    that their message names, with the rest of the message; other errors as they are."""

    @functools.wraps(op)
    def call(*args, **kwargs):
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            message = str(e)
            for prefix, error in _ERRORS.items():
                if message.startswith(prefix):
                    raise error(message[len(prefix):]) from None
            raise

    return call


@python_errors
def token_logprobs_fwd(logits, targets, temperature, need_entropy, softcap=0.0):
    """(logp, entropy, lse_parts) of (N, V) logits; see rlkernels/kernels/__init__.py."""
    return torch.ops.rlkernels_C.token_logprobs_fwd(logits, targets, float(temperature), float(softcap),
                                                    bool(need_entropy))


@python_errors
def token_logprobs_bwd(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, out=None,
                       softcap=0.0):
    """grad_logits (N, V) in the dtype of logits, written into `out` when given (it may be `logits`
    itself); see rlkernels/kernels/__init__.py."""
    if out is None:
        return torch.ops.rlkernels_C.token_logprobs_bwd(
            logits, targets, lse_parts, entropy, grad_logp, grad_entropy, float(temperature), float(softcap))
    torch.ops.rlkernels_C.token_logprobs_bwd_out(
        logits, targets, lse_parts, entropy, grad_logp, grad_entropy, float(temperature), float(softcap), out)
    return out


@python_errors
def policy_token_fwd(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, temperature, params,
                     softcap=0.0):
    """(logp, entropy, lse_parts, grad_logp, grad_entropy, stats) of (N, V) logits and the per-token policy
    loss of `params` (a TokenLossParams); see rlkernels/kernels/__init__.py."""
    return torch.ops.rlkernels_C.policy_token_fwd(
        logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, float(temperature), float(softcap),
        params.packed())


@python_errors
def policy_token_fwd_grad(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, entropy_grad, temperature,
                          params, scale, out=None, softcap=0.0):
    """(logp, entropy, stats, grad_logits): policy_token_fwd and ∂logits from one read of each row, into `out`
    when given (it may be `logits` itself); see rlkernels/kernels/__init__.py."""
    args = (logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, entropy_grad, float(temperature),
            float(softcap), params.packed(), float(scale))
    if out is None:
        return torch.ops.rlkernels_C.policy_token_fwd_grad(*args)
    return (*torch.ops.rlkernels_C.policy_token_fwd_grad_out(*args, out), out)


@python_errors
def scale_grad_(grad, grad_out, assumed):
    """grad ×= grad_out / assumed unless grad_out equals `assumed`; see rlkernels/kernels/__init__.py."""
    torch.ops.rlkernels_C.scale_grad_(grad, grad_out, float(assumed))


@python_errors
def policy_token_loss(logp, entropy, mask, weight, adv, old_logp, ref_logp, params, chosen=None, is_weights=None):
    """(grad_logp, grad_entropy, stats) of the per-token policy loss at log-probs `logp (N,)`; see
    rlkernels/kernels/__init__.py."""
    return torch.ops.rlkernels_C.policy_token_loss(
        logp, entropy, mask, weight, adv, old_logp, ref_logp, chosen, is_weights, params.packed())


@python_errors
def covariance_choice(logp, adv, old_logp, mask, draws, params):
    """Clip-Cov's or KL-Cov's tokens (N,) of a `CovarianceChoiceParams`; see rlkernels/kernels/__init__.py."""
    p = params
    return torch.ops.rlkernels_C.covariance_choice(
        logp, adv, old_logp, mask, draws, int(p.objective), float(p.fraction), float(p.cov_lb),
        float(p.cov_ub), float(p.clip_low), float(p.clip_high), float(p.log_ratio_clamp), float(p.scale))
