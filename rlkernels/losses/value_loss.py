"""The PPO critic's clipped value loss (docs/math.md §12)."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_choice, check_int, check_mask, check_real, check_same_shape, check_tensor
from .aggregation import aggregate, masked_mean
from .config import AGGREGATIONS
from .inputs import count
from .policy_loss import LossOutput


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: Optional[float] = 0.2,
    agg: str = "token_mean",
    num_items: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
) -> LossOutput:
    """½·agg(max((V − R̂)², (clip(V, V_old ± clip) − R̂)²)); `clip=None` disables the clipped branch.
    `agg="constant"` divides by `norm_length` (required, as for the policy loss: the padded T would make the loss
    change with the padding); the counts are checked as the policy loss's (> 0, with a finite inverse)."""
    check_tensor("values", values, ndim=2, dtypes=FLOAT_DTYPES)
    for name, t in (("old_values", old_values), ("returns", returns)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES)
        check_same_shape(name, t, "values", values)
    check_tensor("mask", mask)
    check_same_shape("mask", mask, "values", values)
    mask = check_mask("mask", mask)
    check_choice("agg", agg, AGGREGATIONS)
    if clip is not None:
        check_real("clip", clip, 0, lo_open=True)
    num_items = count("num_items", num_items, values.dtype)
    num_seqs = count("num_seqs", num_seqs, values.dtype)
    check_int("norm_length", norm_length, 1, optional=True)
    if agg == "constant" and norm_length is None:
        raise ValueError("norm_length: agg='constant' divides by a constant length, got None; pass the maximum "
                         "completion length (with the padded T the loss would change with the padding)")
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(mask, values, zero)
    old_values = torch.where(mask, old_values.to(values.dtype), zero).detach()
    returns = torch.where(mask, returns.to(values.dtype), zero).detach()

    unclipped = (values - returns).square()
    if clip is None:
        per_token, clipped = unclipped, torch.zeros_like(mask)
    else:
        clipped_sq = (values.clamp(old_values - clip, old_values + clip) - returns).square()
        per_token, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq.detach() > unclipped.detach()
    loss = 0.5 * aggregate(per_token, mask, agg, num_items=num_items, num_seqs=num_seqs, norm_length=norm_length)
    return LossOutput(loss, {"vf_clip_frac": masked_mean(clipped.to(values.dtype), mask)})
