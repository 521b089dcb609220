"""The metrics of a policy loss (docs/math.md, "Metrics") from per-token statistics.

Every path produces the same per-token statistics, masked to 0 where the mask is 0 and stacked
in the order of `TOKEN_STATS` (the kernels' `stats` columns after the loss): one masked sum over
the batch and one division give every mean, so the metrics cost a handful of ops, not one
reduction each.
"""
from __future__ import annotations

from typing import Dict

import torch

TOKEN_STATS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl", "entropy")


def metrics_from_sums(sums: torch.Tensor, count: torch.Tensor, ratio_max: torch.Tensor,
                      has_entropy: bool) -> Dict[str, torch.Tensor]:
    """Metrics from `sums (len(TOKEN_STATS),)`, the masked sums of the statistics, the number of
    masked tokens `count` (≥ 1: an empty mask gives zeros) and the masked max of the ratio."""
    means = dict(zip(TOKEN_STATS, (sums / count).detach().unbind()))
    if not has_entropy:
        del means["entropy"]
    means["clip_frac"] = means["clip_frac_low"] + means["clip_frac_high"]
    means["ratio_max"] = ratio_max.detach()
    return means
