"""`Batch`: what a surrogate reads of one loss call, built by `LossInputs.masked` (losses/inputs.py), and `Surrogate`,
what it returns."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .aggregation import masked_sum_rows


class Batch:
    """One loss call's log-probs, masked positions zeroed (so no NaN can leak in), with its `LossInputs`,
    whose other fields (groups, rewards, weights) it reads there. Built by `LossInputs.masked`, by keyword."""

    def __init__(self, *, inputs: "LossInputs", logp: torch.Tensor, old_logp: torch.Tensor,
                 adv: Optional[torch.Tensor], lengths: torch.Tensor):
        self.inputs = inputs
        self.logp = logp  # ℓ (B, T)
        self.old_logp = old_logp  # ℓ_old (B, T), detached
        self.adv = adv  # A (B, T), per-row advantages broadcast
        self.lengths = lengths  # L_i (B,)

    @property
    def mask(self) -> torch.Tensor:
        return self.inputs.mask

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        return masked_sum_rows(x, self.mask) / self.lengths.clamp(min=1)

    def per_token(self, row: torch.Tensor) -> torch.Tensor:
        return row[:, None].expand_as(self.logp)


@dataclasses.dataclass
class Surrogate:
    loss: torch.Tensor  # (B, T) per-token loss, differentiable w.r.t. ℓ
    ratio: torch.Tensor  # (B, T) unclipped importance weight, detached, for metrics
    clipped_low: torch.Tensor  # (B, T) bool: the lower clip removes the gradient here
    clipped_high: torch.Tensor  # (B, T) bool
