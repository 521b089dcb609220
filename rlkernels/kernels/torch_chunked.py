"""The `torch` backend: chunked pure PyTorch, always available.

Rows are processed in chunks of about `CHUNK_ELEMENTS` logits, so the extra memory is
O(chunk × V) rather than O(N × V); the backward recomputes softmax from the saved (m, log s)
(docs/design.md §2) instead of keeping a log_softmax for autograd. A soft cap c > 0 replaces the
logits z by c·tanh(z/c) before anything else, and multiplies the gradient by 1 − tanh²(z/c).
"""
from __future__ import annotations

import torch

from .._dtypes import acc_dtype
from . import supports_all_but

# 4M fp32 elements = 16 MB per temporary; a 152k vocabulary gives chunks of 27 rows.
CHUNK_ELEMENTS = 1 << 22


def available():
    return True, "pure PyTorch"


supports = supports_all_but(dict.fromkeys(
    ("policy_token_fwd", "policy_token_loss", "covariance_choice"),
    "the torch backend has no fused policy kernels"))


def _chunks(logits):
    """(start, end, index): the rows start:end of logits (N, V) or (B, T, V) as `logits[index]`, about
    CHUNK_ELEMENTS logits each: of a (B, T, V) view, whole sequences, or part of one when T rows are more."""
    vocab = logits.shape[-1]
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if logits.dim() == 2:
        for start in range(0, logits.shape[0], step):
            yield start, min(start + step, logits.shape[0]), (slice(start, start + step),)
        return
    batch, seq = logits.shape[:2]
    if seq == 0:
        return
    if seq <= step:
        for b in range(0, batch, step // seq):
            stop = min(b + step // seq, batch)
            yield b * seq, stop * seq, (slice(b, stop),)
        return
    for b in range(batch):
        for t in range(0, seq, step):
            stop = min(t + step, seq)
            yield b * seq + t, b * seq + stop, (b, slice(t, stop))


def _p_times(p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """p·d with 0·(−inf) = 0, for vocabulary entries whose logit is −inf (NaN stays NaN)."""
    return torch.where(p == 0, torch.zeros((), dtype=p.dtype, device=p.device), p * d)


def _capped(z, softcap):
    """(y, t): y = c·tanh(z/c) (−inf stays −inf, as in every backend) and t = tanh(z/c) for a cap c > 0,
    else (z, None)."""
    if not softcap:
        return z, None
    t = torch.tanh(z / softcap)
    return torch.where(z == float("-inf"), z, t * softcap), t


def token_logprobs_fwd(logits, targets, temperature, need_entropy, softcap=0.0):
    n = logits.shape[:-1].numel()
    acc = acc_dtype(logits)
    logp = torch.empty(n, dtype=acc, device=logits.device)
    lse_parts = torch.empty(n, 2, dtype=acc, device=logits.device)
    entropy = torch.empty(n if need_entropy else 0, dtype=acc, device=logits.device)
    for s, e, index in _chunks(logits):
        z, _ = _capped(logits[index].to(acc), softcap)  # (rows, V) or (sequences, T, V): read where it lies
        rows = z.shape[:-1]
        # Relative to the row max, as log_softmax: log p = d − log s with d = (z − m)/τ, never
        # z/τ − (m/τ + log s), which rounds to ulp(m/τ); τ scales differences only (z/τ overflows
        # near 3e38 at τ < 1). A row of −inf (m = −inf) gives z − m = NaN, so NaN results.
        m = z.amax(-1, keepdim=True)
        d = (z - m).div_(temperature)
        e_d = torch.exp(d)
        total = e_d.sum(-1)
        log_s = total.log()
        lse_parts[s:e] = torch.stack((m[..., 0], log_s), -1).view(-1, 2)
        logp[s:e] = (d.gather(-1, targets[s:e].reshape(*rows, 1)).squeeze(-1) - log_s).view(-1)
        if need_entropy:
            # H = log s − Σ e^d·d / s: terms relative to m, no cancellation of large numbers.
            entropy[s:e] = (log_s - _p_times(e_d, d).sum(-1) / total).view(-1)
    return logp, entropy, lse_parts


def token_logprobs_bwd(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, out=None,
                       softcap=0.0):
    acc = acc_dtype(logits)
    grad = torch.empty_like(logits) if out is None else out
    for s, e, index in _chunks(logits):
        y, t = _capped(logits[index].to(acc), softcap)  # (rows, V) or (sequences, T, V): read where it lies
        per_row = lambda x: x[s:e].reshape(*y.shape[:-1], -1)  # noqa: E731  per-row values shaped as the chunk
        lse = per_row(lse_parts)
        log_p = (y - lse[..., :1]).div_(temperature) - lse[..., 1:]
        p = torch.exp(log_p)
        g = per_row(grad_logp).to(acc)
        chunk = -g * p
        chunk.scatter_add_(-1, per_row(targets), g)
        if grad_entropy is not None:
            # ∂H/∂x_v = −p_v (log p_v + H)
            h = per_row(grad_entropy).to(acc)
            chunk -= h * _p_times(p, log_p + per_row(entropy))
        chunk /= temperature
        if t is not None:  # dy/dz = (1 − t)(1 + t)
            chunk *= (1 - t) * (1 + t)
        grad[index] = chunk
    return grad
