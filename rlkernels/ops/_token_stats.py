"""The loss and metrics of a call from the kernels' per-token statistics (`kernels.token_loss_params.STATS`):
what the forward step (`_loss_step`), the sequence step and the covariance step each end with."""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.token_loss_params import Stat
from ..losses import LossOutput
from ..losses.spec import LossInputs, metrics_from_sums


def loss_from_stats(stats: torch.Tensor, inputs: LossInputs, sums: Optional[torch.Tensor] = None) -> LossOutput:
    """The loss and metrics from the kernel's `(N, 7)` statistics (`Stat.LOSS` the weighted loss); `sums`: their
    column sums when the caller has added terms of its own to them (default `stats.sum(0)`)."""
    sums = stats.sum(0) if sums is None else sums
    ratio_max = stats[:, Stat.RATIO].amax() if stats.shape[0] else sums[Stat.RATIO]  # every ratio is ≥ 0, masked ones are 0
    metrics = metrics_from_sums(sums[Stat.CLIP_LOW:], inputs.mask.sum().clamp(min=1), ratio_max, has_entropy=True)
    return LossOutput(sums[Stat.LOSS], metrics)
