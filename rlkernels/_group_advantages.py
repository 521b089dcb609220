"""verl's outcome-reward advantage estimators with a group baseline (docs/math.md §13): REINFORCE++ with
baseline, OPO, GPG, GRPO Pass@k and GDPO, each equal to verl 0.9.1's function of the same name.

One reward per row (`rewards (B,)`, or `(B, K)` components for GDPO) and prompt groups from `group_ids` or
`group_size`, reduced with `index_add_` over a group index (`_groups`), no loop over groups. verl's convention
for a group of one differs from GRPO's here: its baseline is 0, so the row keeps its reward.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._checks import FLOAT_DTYPES, check_mask, check_on_device, check_real, check_tensor
from ._dtypes import acc_dtype
from ._groups import group_centered, group_index, group_reduce, group_std, group_sum
from ._token_advantages import masked_whiten


def _rewards(rewards, ndim=1) -> torch.Tensor:
    check_tensor("rewards", rewards, ndim=ndim, dtypes=FLOAT_DTYPES)
    return rewards.to(acc_dtype(rewards))


def _mask(mask, B) -> torch.Tensor:
    check_tensor("mask", mask, ndim=2)
    if mask.shape[0] != B:
        raise ValueError(f"mask: expected {B} rows matching rewards, got shape {tuple(mask.shape)}")
    return check_mask("mask", mask)


def _minus_group_mean(x, inverse, G, weights=None) -> torch.Tensor:
    """x − μ_g (B,), μ_g each row's group mean (weighted by `weights` when given), μ = 0 in a group of one (verl's
    convention). The mean is taken of x shifted by its group's max, as `group_centered`: rewards near 1e3 keep
    their spread's precision, and a group of equal values centres to exactly 0."""
    counts = group_sum(torch.ones_like(x), inverse, G)
    shifted = x - group_reduce(x, inverse, G, "amax")[inverse]
    total = counts if weights is None else group_sum(weights, inverse, G)
    mean = group_sum(shifted if weights is None else weights * shifted, inverse, G) / total
    return torch.where((counts > 1)[inverse], shifted - mean[inverse], x)


def _grpo(x, inverse, G, scale_by_std: bool, eps: float) -> torch.Tensor:
    """verl's GRPO advantage of x (B,): (x − μ_g)/(σ_g + eps), or x − μ_g; a group of one has μ = 0, σ = 1."""
    centered, counts = group_centered(x, inverse, G)
    single = (counts == 1)[inverse]
    if not scale_by_std:
        return torch.where(single, x, centered)
    return torch.where(single, x / (1 + eps), centered / (group_std(centered, counts, inverse, G)[inverse] + eps))


@torch.no_grad()
def reinforce_plus_plus_baseline(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Optional[torch.Tensor] = None,
                                 *, group_size: Optional[int] = None) -> torch.Tensor:
    """REINFORCE++ with baseline (verl's `reinforce_plus_plus_baseline`): `(B, T)`, R_i − μ_g on each masked
    token, whitened over the batch's masked tokens (`masked_whiten`), 0 elsewhere."""
    x = _rewards(rewards)
    mask = _mask(mask, x.shape[0])
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    per_token = torch.where(mask, _minus_group_mean(x, inverse, G)[:, None], 0.0)
    return torch.where(mask, masked_whiten(per_token, mask), 0.0)


@torch.no_grad()
def opo(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Optional[torch.Tensor] = None, *,
        group_size: Optional[int] = None) -> torch.Tensor:
    """OPO (verl's `opo`): `(B,)` R_i − b_g with the length-weighted baseline b_g = Σ_g L_j R_j / Σ_g L_j
    (L_j the row's masked tokens; 0 in a group of one)."""
    x = _rewards(rewards)
    lengths = _mask(mask, x.shape[0]).sum(-1).to(x.dtype)
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    return _minus_group_mean(x, inverse, G, weights=lengths)


@torch.no_grad()
def gpg(rewards: torch.Tensor, group_ids: Optional[torch.Tensor] = None, *, group_size: Optional[int] = None,
        f_norm: float = 1.0) -> torch.Tensor:
    """GPG (verl's `gpg`): `(B,)` α·(R_i − μ_g)/F_norm with α = B / max(#{i: R_i ≠ 0}, 1) (μ = 0 in a group of one)."""
    x = _rewards(rewards)
    f_norm = check_real("f_norm", f_norm, 0.0, lo_open=True)
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    alpha = x.shape[0] / (x != 0).sum().clamp(min=1).to(x.dtype)
    return alpha * _minus_group_mean(x, inverse, G) / f_norm


@torch.no_grad()
def grpo_passk(rewards: torch.Tensor, group_ids: Optional[torch.Tensor] = None, *, group_size: Optional[int] = None,
               scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO for Pass@k (verl's `grpo_passk`): `(B,)` 0 except on each group's best row, which gets
    R_max − R_second (divided by σ_g + eps with `scale_by_std`); 0 when the best is tied. Groups need two rows."""
    x = _rewards(rewards)
    eps = check_real("eps", eps, 0.0)
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    centered, counts = group_centered(x, inverse, G)
    check_on_device((counts >= 2).all(), "group_ids: grpo_passk needs at least two rows in every group")
    best = group_reduce(x, inverse, G, "amax")[inverse]
    is_best = x == best
    second = group_reduce(torch.where(is_best, float("-inf"), x), inverse, G, "amax")[inverse]
    unique = group_sum(is_best.to(x.dtype), inverse, G)[inverse] == 1
    gap = torch.where(is_best & unique, best - second, 0.0)
    return gap / (group_std(centered, counts, inverse, G)[inverse] + eps) if scale_by_std else gap


@torch.no_grad()
def gdpo(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Optional[torch.Tensor] = None, *,
         group_size: Optional[int] = None, weights: Optional[Sequence[float]] = None, scale_by_std: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """GDPO (verl's `gdpo`): `(B, T)` from reward components `rewards (B, K)`: each component's GRPO advantage
    (verl's, a group of one has μ = 0, σ = 1), summed with `weights` (default 1 each), put on each masked
    token, then whitened over the batch's masked tokens (0 elsewhere)."""
    x = _rewards(rewards, ndim=2)
    mask = _mask(mask, x.shape[0])
    eps = check_real("eps", eps, 0.0)
    K = x.shape[1]
    w = torch.ones(K, dtype=x.dtype, device=x.device) if weights is None else torch.as_tensor(
        [check_real(f"weights[{k}]", v) for k, v in enumerate(weights)], dtype=x.dtype, device=x.device)
    if w.numel() != K:
        raise ValueError(f"weights: expected {K} weights, one per reward component, got {w.numel()}")
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    total = sum(w[k] * _grpo(x[:, k], inverse, G, scale_by_std, eps) for k in range(K))
    per_token = torch.where(mask, total[:, None], 0.0)
    return torch.where(mask, masked_whiten(per_token, mask), 0.0)
