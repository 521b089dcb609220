"""Rollout selection and DAPO's reward shaping (docs/math.md §14).

* ``pods_select``: PODS down-sampling, the ``m`` rollouts of each group whose rewards have the
  largest variance.
* ``overlong_penalty``: DAPO's soft overlong punishment.
* ``filter_uniform_groups``: DAPO's dynamic sampling, dropping groups whose rewards are all equal.

All vectorised over groups (one sort of the batch, no Python loop over groups).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._checks import FLOAT_DTYPES, INT_DTYPES, check_int, check_real, check_tensor
from ._groups import group_centered, group_index, group_reduce

__all__ = ["pods_select", "overlong_penalty", "filter_uniform_groups"]


def pods_select(
    rewards: torch.Tensor,
    m: int,
    group_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
) -> torch.Tensor:
    """Indices (int64, increasing) of the rows kept by PODS: in every group of ``n > m`` rows,
    the ``m`` rows whose rewards have the largest (population) variance; groups of ``n <= m``
    rows keep all their rows.

    The best ``m``-subset of a group is always its ``k`` highest plus its ``m − k`` lowest
    rewards for some ``k`` in ``0..m`` (moving a kept value towards the middle never raises
    the variance), so after one sort of the batch by (group, reward) each group scores its
    ``m + 1`` candidates from prefix sums of ``r`` and ``r²``: ``O(n log n)`` per group.
    Among equally good subsets one is returned (ties between equal rewards follow the
    stable sort: the lowest are taken from the first rows, the highest from the last).
    """
    check_tensor("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)
    m = check_int("m", m, lo=1, what="an int >= 1")
    B = rewards.shape[0]
    inverse, G = group_index(B, group_ids, group_size, rewards.device)
    if B == 0:
        return torch.zeros(0, dtype=torch.long, device=rewards.device)

    # fp64 and centred per group: the scores below are differences of prefix sums
    x, _ = group_centered(rewards.to(torch.float64), inverse, G)
    by_reward = torch.argsort(x, stable=True)
    order = by_reward[torch.argsort(inverse[by_reward], stable=True)]  # sorted by (group, reward)
    xs = x[order]
    zero = xs.new_zeros(1)
    p1 = torch.cat([zero, torch.cumsum(xs, 0)])
    p2 = torch.cat([zero, torch.cumsum(xs * xs, 0)])

    counts = torch.bincount(inverse, minlength=G)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    k = torch.arange(m + 1, device=x.device)  # candidate k: top k, bottom m − k
    low_end = torch.minimum(starts[:, None] + (m - k), ends[:, None])  # clamped for n <= m
    high_start = torch.maximum(ends[:, None] - k, starts[:, None])
    s1 = p1[low_end] - p1[starts, None] + p1[ends, None] - p1[high_start]
    s2 = p2[low_end] - p2[starts, None] + p2[ends, None] - p2[high_start]
    best_k = torch.argmax(m * s2 - s1 * s1, dim=1)  # ∝ m² · variance of the candidate

    group_of = inverse[order]
    n = counts[group_of]
    pos = torch.arange(B, device=x.device) - starts[group_of]  # rank within the group
    kk = best_k[group_of]
    keep = (n <= m) | (pos < m - kk) | (pos >= n - kk)
    return torch.sort(order[keep]).values


def overlong_penalty(
    lengths: torch.Tensor,
    max_len: int,
    buffer: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward added per response:
    ``0`` for ``L <= max_len − buffer``, then linear down to ``−1`` at ``L = max_len``, ``−1``
    beyond, times ``penalty_factor``. ``lengths`` of any shape; the result has its shape and
    dtype (float32 for integer lengths)."""
    check_tensor("lengths", lengths, dtypes=INT_DTYPES + FLOAT_DTYPES)
    buffer = check_int("buffer", buffer, lo=1, what="an int >= 1")
    max_len = check_int("max_len", max_len)
    if max_len <= buffer:
        raise ValueError(f"max_len: expected an int > buffer ({buffer}), got {max_len}")
    penalty_factor = check_real("penalty_factor", penalty_factor, 0.0)
    out_dtype = lengths.dtype if lengths.is_floating_point() else torch.float32
    free = max_len - buffer
    ramp = (free - lengths.to(torch.float64)) / buffer
    return (ramp.clamp(min=-1.0, max=0.0) * penalty_factor).to(out_dtype)


def filter_uniform_groups(
    rewards: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: a bool keep-mask ``(B,)``, False for every row of a
    group whose rewards are all equal (groups of one included), True elsewhere."""
    check_tensor("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)
    inverse, G = group_index(rewards.shape[0], group_ids, group_size, rewards.device)
    varied = group_reduce(rewards, inverse, G, "amax") != group_reduce(rewards, inverse, G, "amin")
    return varied[inverse]
