"""The `torch` backend: chunked pure PyTorch, always available.

Rows are processed in chunks of about `CHUNK_ELEMENTS` logits, so the extra memory is
O(chunk × V) rather than O(N × V); the backward recomputes softmax from the saved logsumexp
(DESIGN.md §2) instead of keeping a log_softmax for autograd.
"""
from __future__ import annotations

import torch

# 4M fp32 elements = 16 MB per temporary; a 152k vocabulary gives chunks of 27 rows.
CHUNK_ELEMENTS = 1 << 22


def available():
    return True, "pure PyTorch"


def _chunks(n_rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


def _acc_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _p_log_p(log_p: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """p·log p with 0·(−inf) = 0, for vocabulary entries whose logit is −inf."""
    return torch.where(p > 0, p * log_p, torch.zeros((), dtype=p.dtype, device=p.device))


def token_logprobs_fwd(logits, targets, temperature, need_entropy):
    n, vocab = logits.shape
    acc = _acc_dtype(logits)
    logp = torch.empty(n, dtype=acc, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty(n if need_entropy else 0, dtype=acc, device=logits.device)
    for s, e in _chunks(n, vocab):
        x = logits[s:e].to(acc) / temperature
        lse[s:e] = torch.logsumexp(x, dim=-1)
        logp[s:e] = x.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
        if need_entropy:
            log_p = x.sub_(lse[s:e, None])
            entropy[s:e] = -_p_log_p(log_p, torch.exp(log_p)).sum(-1)
    return logp, entropy, lse


def token_logprobs_bwd(logits, targets, lse, entropy, grad_logp, grad_entropy, temperature, out=None):
    n, vocab = logits.shape
    acc = _acc_dtype(logits)
    grad = torch.empty_like(logits) if out is None else out
    for s, e in _chunks(n, vocab):
        log_p = logits[s:e].to(acc) / temperature - lse[s:e, None]
        p = torch.exp(log_p)
        g = grad_logp[s:e, None].to(acc)
        chunk = -g * p
        chunk.scatter_add_(1, targets[s:e, None], g)
        if grad_entropy is not None:
            # ∂H/∂x_v = −p_v (log p_v + H)
            h = grad_entropy[s:e, None].to(acc)
            chunk -= h * _p_log_p(log_p + entropy[s:e, None], p)
        grad[s:e] = chunk / temperature
    return grad
