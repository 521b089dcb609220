"""Sums over the ranks of torchrun (gloo on CPU, nccl on CUDA); in one process, plain numbers."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_sum(x: float) -> float:
    if dist_info()[1] == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return float(t)


def all_sums(values: dict) -> dict:
    """Each of `values` (numbers or 0-d tensors) summed over all ranks: one host sync and one all-reduce for them
    all (float64, as all_sum)."""
    if not values:
        return {}
    device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values.values()])
    if dist_info()[1] > 1:
        stacked = stacked.to(_comm_device())
        dist.all_reduce(stacked)
    return dict(zip(values, stacked.tolist()))


def _comm_device():
    """Where collective buffers live: NCCL reduces only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def nan_mean_std(x: torch.Tensor) -> tuple:
    """(mean, unbiased std) over all ranks of the non-NaN entries of `x`; (None, None) when there are none,
    std 0 when there is one."""
    return nan_mean_stds({0: x})[0]


def nan_mean_stds(columns: dict) -> dict:
    """`nan_mean_std` of each of `columns` (1-d tensors), in two all-reduces for them all: the counts and sums,
    then the squares about the means (two passes: no cancellation of Σx² − n·mean²)."""
    seen = {k: x[~x.isnan()] for k, x in columns.items()}
    sums = all_sums({**{("n", k): len(x) for k, x in seen.items()}, **{("sum", k): x.sum() for k, x in seen.items()}})
    means = {k: sums["sum", k] / sums["n", k] for k in seen if sums["n", k]}
    squares = all_sums({k: ((seen[k] - mean) ** 2).sum() for k, mean in means.items()})
    out = {k: (None, None) for k in seen}
    for k, mean in means.items():
        n = sums["n", k]
        out[k] = mean, math.sqrt(squares[k] / (n - 1)) if n > 1 else 0.0
    return out
