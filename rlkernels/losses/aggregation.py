"""Masked reductions over (B, T) tensors: the aggregations of docs/math.md §8 and the metric means."""
from __future__ import annotations

from typing import Optional

import torch


def masked_sum_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t m·x per row. `torch.where`, not a product, so padding holding inf/NaN cannot leak in."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked entries; 0 for an empty mask."""
    return masked_sum_rows(x, mask).sum() / mask.sum().clamp(min=1)


def aggregation_weights(
    mask: torch.Tensor,
    agg: str,
    *,
    num_items: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(B, T) weights w with agg(ℓoss) = Σ_{i,t} w_{i,t}·ℓoss_{i,t} (0 where masked); docs/math.md §8.

    Every aggregation is linear in the per-token loss, so a kernel can apply it token by token.
    Divisors of 0 give weights of 0 (the masked sum is then empty anyway). `lengths`: the rows'
    token counts `mask.sum(-1)` in `dtype`, when the caller has them already.
    """
    if lengths is None:
        lengths = mask.sum(-1, dtype=dtype)
    lengths = lengths[:, None]
    if agg == "token_mean":
        divisor = lengths.sum().clamp(min=1) if num_items is None else num_items
    else:
        seqs = lengths.clamp(max=1).sum().clamp(min=1) if num_seqs is None else num_seqs  # non-empty rows
        if agg == "seq_mean_token_mean":
            divisor = lengths.clamp(min=1) * seqs
        elif agg == "seq_mean_token_sum":
            divisor = seqs
        elif agg == "constant":
            divisor = seqs * (mask.shape[-1] if norm_length is None else norm_length)
        else:
            raise ValueError(f"agg: unknown aggregation {agg!r}")
    # mask / divisor in `dtype`: a tensor divisor has it already (no cast of the mask); a number does not
    return torch.div(mask, divisor) if torch.is_tensor(divisor) else mask.to(dtype) / divisor


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str, **counts) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with `aggregation_weights` (same keyword arguments)."""
    weights = aggregation_weights(mask, agg, dtype=per_token.dtype, **counts)
    return masked_sum_rows(per_token * weights, mask).sum()
