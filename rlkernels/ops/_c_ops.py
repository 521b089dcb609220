"""The compiled extension's ops (`torch.ops.rlkernels_C.*`, CPU and CUDA kernels behind one
schema each) as first-class torch ops: a fake implementation for each, so that
`torch.compile(fullgraph=True)` traces them, and autograd on `token_logprobs_fwd` (its backward is
`token_logprobs_bwd`), as pytorch/extension-cpp registers its ops. The dispatcher picks the CPU or
the CUDA kernel by the tensors' device; no Python wrapper op sits in between.
"""
from __future__ import annotations

import torch

from .._dtypes import acc_dtype
from ..kernels.token_loss_params import NUM_STATS
from ._precomputed_grad import refuse_create_graph

_LIB = "rlkernels_C"


def _rows(logits) -> int:
    """N: the rows of logits (N, V) or (B, T, V)."""
    return logits.shape[:-1].numel()


def logprobs_fwd_fake(logits, targets, temperature, softcap, need_entropy):
    n, dtype = _rows(logits), acc_dtype(logits)
    return (logits.new_empty(n, dtype=dtype), logits.new_empty(n if need_entropy else 0, dtype=dtype),
            logits.new_empty(n, 2, dtype=dtype))


def logprobs_bwd_fake(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap):
    return torch.empty_like(logits)


def _bwd_out_fake(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap, out):
    return None


def _policy_fwd_fake(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, temperature, softcap, params):
    n, dtype = _rows(logits), acc_dtype(logits)
    vec = lambda: logits.new_empty(n, dtype=dtype)  # noqa: E731
    return vec(), vec(), logits.new_empty(n, 2, dtype=dtype), vec(), vec(), logits.new_empty(n, NUM_STATS, dtype=dtype)


def _policy_loss_fake(logp, entropy, mask, weight, adv, old_logp, ref_logp, chosen, is_weights, params):
    n = logp.shape[0]
    return torch.empty_like(logp), torch.empty_like(logp), logp.new_empty(n, NUM_STATS)


def _choice_fake(logp, adv, old_logp, mask, draws, *scalars):
    return torch.empty_like(logp)


def _setup_context(ctx, inputs, output):
    logits, targets, temperature, softcap, need_entropy = inputs
    _, entropy, lse_parts = output
    ctx.save_for_backward(logits, targets, lse_parts, entropy)
    ctx.temperature, ctx.softcap, ctx.need_entropy = temperature, softcap, need_entropy


def register_logprobs_autograd(fwd, bwd) -> None:
    """The autograd formula of a token_logprobs forward op `fwd` (any backend's), whose backward op is `bwd`."""

    def backward(ctx, grad_logp, grad_entropy, _grad_lse_parts):
        refuse_create_graph("token_logprobs")
        logits, targets, lse_parts, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = lse_parts.new_zeros(lse_parts.shape[0])
        if not ctx.need_entropy:
            grad_entropy = None
        grad = bwd(logits, targets, lse_parts, entropy, grad_logp.contiguous(),
                   None if grad_entropy is None else grad_entropy.contiguous(), ctx.temperature, ctx.softcap)
        return grad, None, None, None, None

    torch.library.register_autograd(fwd, backward, setup_context=_setup_context)


def register():
    """Register the fakes and the autograd formula (once: the caller holds the registration lock)."""
    for name, fake in (("token_logprobs_fwd", logprobs_fwd_fake), ("token_logprobs_bwd", logprobs_bwd_fake),
                       ("token_logprobs_bwd_out", _bwd_out_fake), ("policy_token_fwd", _policy_fwd_fake),
                       ("policy_token_loss", _policy_loss_fake), ("covariance_choice", _choice_fake)):
        torch.library.register_fake(f"{_LIB}::{name}", fake)
    register_logprobs_autograd(f"{_LIB}::token_logprobs_fwd", torch.ops.rlkernels_C.token_logprobs_bwd)
    return torch.ops.rlkernels_C.token_logprobs_fwd.default
