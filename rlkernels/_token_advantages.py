"""Token-level returns and the advantage estimators built on them (docs/math.md §13): verl's REINFORCE++,
ReMax and Optimal Token Baseline, and the masked whitening that GAE and they share.

`(B, T)` inputs; the mask is bool or 0/1 numbers, and padding may hold anything (`torch.where`, not a
product). Group statistics are `index_add_` reductions over rows (`_groups`), no loop over groups.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import FLOAT_DTYPES, check_mask, check_real, check_same_shape, check_tensor
from ._dtypes import acc_dtype
from ._groups import group_index, group_reduce, group_sum

WHITEN_EPS = 1e-8  # verl's masked_whiten: (A − mean) * rsqrt(var + 1e-8)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x − mean)/sqrt(var + 1e-8), mean and Bessel-corrected variance over the masked entries (variance 0 below
    two), applied to every entry: verl's `masked_whiten`."""
    n = mask.sum().to(x.dtype)
    mean = torch.where(mask, x, 0.0).sum() / n.clamp(min=1)
    var = torch.where(mask, (x - mean).square(), 0.0).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS)


def _token_inputs(rewards, mask, *others):
    """(rewards in the accumulation dtype, mask as bool), `others` (name, tensor) checked to match rewards."""
    check_tensor("rewards", rewards, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask)
    check_same_shape("mask", mask, "rewards", rewards)
    for name, t in others:
        check_tensor(name, t, dtypes=FLOAT_DTYPES)
        check_same_shape(name, t, "rewards", rewards)
    return rewards.to(acc_dtype(rewards)), check_mask("mask", mask)


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{s ≥ t} m_s·r_s (B, T): the undiscounted return from each position (masked rewards count 0)."""
    r = torch.where(mask, rewards, 0.0)
    return r.flip(-1).cumsum(-1).flip(-1)


@torch.no_grad()
def reinforce_plus_plus(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (verl's `reinforce_plus_plus`): (advantages, returns) `(B, T)`. Scanning t = T−1 .. 0,
    G_t = r_t + γ·G_next on the masked tokens (0 elsewhere), the running return carried unchanged through
    masked positions; advantages = masked_whiten(G) over the batch's masked tokens, 0 on the others."""
    r, mask = _token_inputs(rewards, mask)
    gamma = check_real("gamma", gamma, 0.0, 1.0)
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        step = r[:, t] + gamma * running
        returns[:, t] = torch.where(mask[:, t], step, 0.0)
        running = torch.where(mask[:, t], step, running)
    return torch.where(mask, masked_whiten(returns, mask), 0.0), returns


@torch.no_grad()
def remax(rewards: torch.Tensor, baselines: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """ReMax (verl's `remax`): (advantages, returns) `(B, T)`, returns G_t = Σ_{s ≥ t} m_s r_s and advantages
    G_t − b_i on the masked tokens, G_t elsewhere (as verl), with `baselines` b `(B,)` the rewards of the
    greedy responses."""
    r, mask = _token_inputs(rewards, mask)
    check_tensor("baselines", baselines, shape=(r.shape[0],), dtypes=FLOAT_DTYPES, device=r.device)
    returns = reward_to_go(r, mask)
    return torch.where(mask, returns - baselines.to(r.dtype)[:, None], returns), returns


@torch.no_grad()
def optimal_token_baseline(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    is_weights: Optional[torch.Tensor] = None,
    zero_tail: bool = True,
    compact: bool = False,
    eps: float = 1e-8,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (verl's `optimal_token_baseline`; `compact=True`: `tir_optimal_token_baseline`):
    (advantages, returns) `(B, T)`, returns G = `reward_to_go`.

    Per token w_t = (1 − 2π_t + Σ_v π_v²)·ρ̄_t², π_t = e^{ℓ_old}, `sum_pi_squared` Σ_v π_v², ρ̄ `is_weights`
    (1 when None); W_t = Σ_{s ≤ t} m_s w_s. In each group of two or more rows, the baseline of step k is
    b_k = Σ_j G_jk W_jk / (Σ_j W_jk + eps) over the group's masked tokens at step k, where step k is position k,
    or with `compact` the k-th masked token of each row (multi-turn rows; its groups leave empty rows out).
    `zero_tail`: a group's longest row, when it is the only one that long, gets baseline 0 from the second
    longest row's length on. Advantages G − b on the masked tokens (a group of one: G), 0 elsewhere."""
    r, mask = _token_inputs(rewards, mask, ("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared),
                            *(() if is_weights is None else (("is_weights", is_weights),)))
    eps = check_real("eps", eps, 0.0)
    for name, flag in (("zero_tail", zero_tail), ("compact", compact)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    B, T = r.shape
    inverse, G = group_index(B, group_ids, group_size, r.device)
    returns = reward_to_go(r, mask)
    w = 1 - 2 * torch.exp(old_logp.to(r.dtype)) + sum_pi_squared.to(r.dtype)
    if is_weights is not None:
        w = w * is_weights.to(r.dtype).square()
    cum_w = torch.where(mask, w, 0.0).cumsum(-1)
    lengths = mask.sum(-1)
    if compact:  # step k: the k-th masked token of each row (its column in a left-packed copy)
        step = torch.where(mask, mask.cumsum(-1) - 1, T)  # masked-out entries go to an extra column, dropped
        packed = lambda x: x.new_zeros(B, T + 1).scatter_(1, step, x)[:, :T]  # noqa: E731
        g, cw, m = packed(returns), packed(cum_w), torch.arange(T, device=r.device) < lengths[:, None]
        member = lengths > 0
    else:
        g, cw, m, member = returns, cum_w, mask, torch.ones_like(lengths, dtype=torch.bool)
    rows = group_sum(member.to(r.dtype), inverse, G)[inverse]  # each row's group size
    num = group_sum(torch.where(m, g * cw, 0.0), inverse, G)
    den = group_sum(torch.where(m, cw, 0.0), inverse, G)
    baseline = torch.where((rows > 1)[:, None], (num / (den + eps))[inverse], 0.0)
    if zero_tail:
        baseline = torch.where(_unique_longest_tail(lengths, member, inverse, G, T), 0.0, baseline)
    adv = g - baseline
    if compact:  # back to each masked token's position
        adv = adv.gather(1, torch.where(mask, mask.cumsum(-1) - 1, 0))
    return torch.where(mask, adv, 0.0), returns


def _unique_longest_tail(lengths, member, inverse, G, T) -> torch.Tensor:
    """(B, T) bool: the steps k ≥ L_second of a group's longest member row, when no other row is that long
    (L_second: the longest of the group's other rows)."""
    L = torch.where(member, lengths, -1)
    is_longest = (L == group_reduce(L, inverse, G, "amax")[inverse]) & member
    unique = group_sum(is_longest.long(), inverse, G)[inverse] == 1
    second = group_reduce(torch.where(is_longest, -1, L), inverse, G, "amax")[inverse]
    tail = is_longest & unique & (second >= 0)
    return tail[:, None] & (torch.arange(T, device=lengths.device) >= second[:, None])
