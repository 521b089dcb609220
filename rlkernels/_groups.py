"""Resolving prompt groups and per-group sums, vectorised over groups.

A batch of ``B`` rows is split into groups either by ``group_ids`` (a ``(B,)`` integer tensor;
rows with equal ids form a group, any values) or by ``group_size=k`` (contiguous groups of
``k`` rows). Both become an ``inverse`` index ``(B,)`` into ``G`` groups numbered ``0..G-1``,
on which group statistics are ``index_add_`` / ``scatter_reduce`` reductions. Contiguous groups of
``size`` rows (``group_size``) may also pass ``size``: their reductions are then over a
``(G, size)`` view, fewer launches than a scatter.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import INT_DTYPES, check_int, check_tensor


def check_ids(
    name: str, ids, batch_size: int, device: Optional[torch.device], ref_name: str = "rewards"
) -> torch.Tensor:
    """``ids`` is a ``(batch_size,)`` integer tensor on ``device`` (when given)."""
    check_tensor(name, ids, ndim=1, dtypes=INT_DTYPES)
    if ids.shape[0] != batch_size:
        raise ValueError(
            f"{name}: expected shape ({batch_size},) matching {ref_name}, got {tuple(ids.shape)}"
        )
    if device is not None and ids.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device} like {ref_name}, got {ids.device}")
    return ids


def group_index(
    batch_size: int,
    group_ids: Optional[torch.Tensor] = None,
    group_size: Optional[int] = None,
    device: Optional[torch.device] = None,
    *,
    ref_name: str = "rewards",
    exact_count: bool = True,
) -> Tuple[torch.Tensor, int]:
    """``(inverse, num_groups)``: ``inverse[i]`` in ``[0, num_groups)`` is row i's group.

    Exactly one of ``group_ids`` / ``group_size`` must be given. Groups from ``group_ids`` are
    numbered in increasing order of id; counting them (``torch.unique``) synchronises with the
    device, so with ``exact_count=False`` ``num_groups`` is the batch size instead, an upper
    bound, and a group's number is where its id first comes in the sorted ids: the numbers in
    between are empty groups (the losses only gather their rows' groups).
    ``group_size`` groups are in row order, without a synchronisation.
    """
    if (group_ids is None) == (group_size is None):
        got = "neither" if group_ids is None else "both"
        raise ValueError(f"group_ids/group_size: expected exactly one of them, got {got}")
    if group_ids is not None:
        check_ids("group_ids", group_ids, batch_size, device, ref_name)
        if not exact_count:
            return _sorted_group_index(group_ids), batch_size
        uniq, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse, int(uniq.numel())
    k = check_group_size(batch_size, group_size)
    inverse = torch.arange(batch_size, device=device) // k
    return inverse, batch_size // k


def check_group_size(batch_size: int, group_size) -> int:
    """``group_size`` is a positive int dividing ``batch_size``."""
    k = check_int("group_size", group_size, lo=1, what="a positive int")
    if batch_size % k:
        raise ValueError(
            f"group_size: expected a positive int dividing the batch size {batch_size}, got {k}"
        )
    return k


def _sorted_group_index(ids: torch.Tensor) -> torch.Tensor:
    """Each row's group: the first position of its id in the sorted ids (two launches, no host
    synchronisation; the groups are not numbered consecutively)."""
    return torch.searchsorted(torch.sort(ids).values, ids)


def pair_index(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Group index of the pairs ``(a[i], b[i])``: rows are together when both ids agree."""
    uniq, inverse = torch.unique(torch.stack([a.long(), b.long()]), dim=1, return_inverse=True)
    return inverse, int(uniq.shape[1])


def group_sum(x: torch.Tensor, inverse: torch.Tensor, num_groups: int, size: Optional[int] = None) -> torch.Tensor:
    """``(G, ...)`` sums of ``x (B, ...)`` over each group (``size``: the groups are contiguous runs of it)."""
    if size is not None:
        return x.view(num_groups, size, *x.shape[1:]).sum(1)
    return x.new_zeros((num_groups, *x.shape[1:])).index_add_(0, inverse, x)


def group_gather(values: torch.Tensor, inverse: Optional[torch.Tensor], size: Optional[int] = None) -> torch.Tensor:
    """``(B, ...)``: each row's value of ``values (G, ...)``, by ``inverse`` or, for contiguous groups of ``size``
    rows, by repetition."""
    return values[inverse] if size is None else values.repeat_interleave(size, 0)


def group_reduce(x: torch.Tensor, inverse: torch.Tensor, num_groups: int, op: str) -> torch.Tensor:
    """``(G, ...)`` ``op`` ("amax" / "amin") of ``x (B, ...)`` over each group (every group is non-empty)."""
    index = inverse.view(-1, *(1,) * (x.dim() - 1)).expand_as(x)
    return x.new_zeros((num_groups, *x.shape[1:])).scatter_reduce_(0, index, x, op, include_self=False)


def group_exp(x: torch.Tensor, valid: torch.Tensor, inverse: Optional[torch.Tensor], num_groups: int,
              size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(e, top)``: ``e_i = exp(x_i − top_g)`` ``(B,)`` on the ``valid`` rows (0 on the others), ``top (G,)`` the
    largest valid ``x`` of each group: nothing overflows, and a group's largest ``e`` is 1, so a group sum of ``e``
    is ≥ 1 where the group has a valid row. A group of none has the dtype's lowest value as its top (its ``e`` are
    0, not NaN). ``size`` as in `group_sum` (then a max over the ``(G, size)`` view)."""
    x = torch.where(valid, x, float("-inf"))
    lowest = torch.finfo(x.dtype).min
    if size is not None:
        x = x.view(num_groups, size)
        top = x.amax(1).clamp(min=lowest).detach()
        return torch.exp(x - top[:, None]).view(-1), top
    # the max over a fill of the lowest value (include_self): finite, and no pass to set the groups' start first
    top = x.new_full((num_groups,), lowest).scatter_reduce_(0, inverse, x, "amax").detach()
    return torch.exp(x - top[inverse]), top


def group_centered(
    x: torch.Tensor, inverse: torch.Tensor, num_groups: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x − μ_g, counts)``: each row minus its group mean, and the group sizes ``(G,)``.

    The mean is taken of ``x`` shifted by a member of its group (the group max), which is
    exact for a group of equal values (so they centre to exactly 0) and avoids cancellation
    when the rewards are large compared with their spread.
    """
    counts = group_sum(torch.ones_like(x), inverse, num_groups)
    shifted = x - group_reduce(x, inverse, num_groups, "amax")[inverse]
    mean = group_sum(shifted, inverse, num_groups) / counts
    return shifted - mean[inverse], counts


def group_std(
    centered: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """``(G,)`` Bessel-corrected standard deviations from centred values; 0 for groups of one."""
    ss = group_sum(centered * centered, inverse, num_groups)
    return (ss / (counts - 1).clamp(min=1)).sqrt()
