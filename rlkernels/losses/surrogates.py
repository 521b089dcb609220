"""Importance weights (docs/math.md §4) and what of the surrogates (§5) is not a per-token formula of the table.

The per-token surrogates of the kernels' objectives (clip, CISPO, REINFORCE, SAPO, DPPO, DRO, TOPR, GPPO, SPO) are
generated from their formulas, once, in token_formulas.py: the spec the kernels are derived from. What stays here
reads more than one token: the ratios (a sequence's, a group's), the sequence-level surrogates (FSPO, VESPO, GMPO,
SNIS, whose row loss is no function of one token), the covariance choice of Clip-Cov and KL-Cov (over the whole
batch, then the table's per-token formula), and the helpers the fused sequence steps share with them.
Every function returns a `Surrogate` over (B, T): sequence-level losses are broadcast to the
row's tokens, so one aggregation serves all of them (docs/math.md, "Surrogates").
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .._groups import group_exp, group_gather, group_sum
from . import token_formulas
from .aggregation import masked_sum_rows
from .batch import Batch, Surrogate


def _token_log_ratio(b: Batch, cfg) -> torch.Tensor:
    return (b.logp - b.old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def _sequence_log_ratio(b: Batch, cfg) -> torch.Tensor:
    """log s_i = Σ_t m (ℓ − ℓ_old) / L_i (GSPO), clamped."""
    return b.row_mean(b.logp - b.old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def token_ratio(b: Batch, cfg) -> torch.Tensor:
    """w = exp(clamp(ℓ − ℓ_old)) per token (B, T)."""
    return torch.exp(_token_log_ratio(b, cfg))


def sequence_ratio(b: Batch, cfg) -> torch.Tensor:
    """s_i = exp(clamp(mean_t (ℓ − ℓ_old))) (GSPO's), on each token of its row (B, T)."""
    return b.per_token(torch.exp(_sequence_log_ratio(b, cfg)))


def sequence_token_ratio(b: Batch, cfg) -> torch.Tensor:
    """GSPO-token's weight: the value of s_i on every token, the gradient of ℓ_{i,t} alone (B, T)."""
    return torch.exp(_sequence_log_ratio(b, cfg).detach()[:, None] + b.logp - b.logp.detach())


def _trajectory_log_ratio(b: Batch, cfg) -> torch.Tensor:
    """log π(τ)/μ(τ) = clamp(Σ_t m (ℓ − ℓ_old)) (B,), the raw sequence log-ratio."""
    return masked_sum_rows(b.logp - b.old_logp, b.mask).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def trajectory_ratio(b: Batch, cfg) -> torch.Tensor:
    """π(τ)/μ(τ), the raw sequence ratio, on each token of its row (B, T)."""
    return b.per_token(torch.exp(_trajectory_log_ratio(b, cfg)))


def at(weight, surrogate):
    """The surrogate `surrogate(w, b, cfg)` at the importance weight `weight(b, cfg)` (B, T): one of the functions
    above, so that an objective is written once for every ratio it takes."""
    return functools.partial(_at, weight, surrogate)


def _at(weight, surrogate, b: Batch, cfg) -> Surrogate:
    return surrogate(weight(b, cfg), b, cfg)


def _none(b: Batch) -> torch.Tensor:
    return torch.zeros_like(b.mask)


def cispo_weight(w: torch.Tensor, cfg):
    """(clamp(w, 1 − ε_low, 1 + ε_high), w below the band, w above it): CISPO's constant weight, either
    bound None for none."""
    low = None if cfg.clip_low is None else 1 - cfg.clip_low
    high = None if cfg.clip_high is None else 1 + cfg.clip_high
    none = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
    return w.clamp(low, high), w < low if low is not None else none, w > high if high is not None else none


def _covariance(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A − mean A)·(ℓ − mean ℓ) per token, means over the masked tokens of the batch, summed in float64 and
    rounded to ℓ's dtype: then every summation order gives the same means, so the kernels choose the same tokens."""
    count = mask.sum().clamp(min=1)
    mean_adv = (torch.where(mask, adv, 0.0).sum(dtype=torch.float64) / count).to(logp.dtype)
    mean_logp = (torch.where(mask, logp, 0.0).sum(dtype=torch.float64) / count).to(logp.dtype)
    return (adv - mean_adv) * (logp - mean_logp)


def clip_cov_tokens(w: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Clip-Cov's chosen tokens (B, T): of the masked tokens PPO's clip leaves unclipped and whose covariance lies
    in (clip_cov_lb, clip_cov_ub), a random few (`random_tokens`). Inputs detached; padding may hold anything."""
    clipped = -adv * w.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) > -adv * w
    cov = _covariance(adv, logp, mask)
    candidates = mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    return random_tokens(candidates, mask, cfg.clip_cov_ratio, cfg.clip_cov_draw)


def kl_cov_tokens(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """KL-Cov's chosen tokens (B, T): the k = max(⌊kl_cov_ratio·N⌋, 1) masked tokens of largest covariance (ties:
    the first position wins), k kept on the device. Inputs detached; padding may hold anything."""
    cov = torch.where(mask, _covariance(adv, logp, mask), float("-inf"))
    k = torch.floor(mask.sum().to(torch.float64) * cfg.kl_cov_ratio).clamp(min=1)
    return (_ranks(cov.reshape(-1), descending=True).view_as(mask) < k) & mask


def clip_cov(w, b: Batch, cfg) -> Surrogate:
    """Clip-Cov: the table's formula (PPO's clip, loss 0 and no gradient on the chosen tokens) at its choice, a random
    few tokens of high covariance."""
    with torch.no_grad():
        chosen = clip_cov_tokens(w.detach(), b.adv, b.logp.detach(), b.mask, cfg)
    return token_formulas.clip_cov(w, b, cfg, chosen.to(w.dtype))


def random_tokens(candidates: torch.Tensor, mask: torch.Tensor, fraction: float, draw: str = "device") -> torch.Tensor:
    """Clip-Cov's draw: min(k, n) of the n candidate tokens, uniformly at random, k = max(⌊fraction·N⌋, 1) with
    N the masked tokens.

    `draw="device"`: the candidates of the k smallest keys `torch.rand(candidates.shape, dtype=torch.float32)` (the
    default generator of the inputs' device; ties: the first position), without a host sync. `draw="verl"`: verl's code, the
    candidates (row-major) at `torch.randperm(n)[:k]` on the default CPU generator, so the same RNG
    state chooses the same tokens as verl; n must reach the host, one sync."""
    flat = candidates.reshape(-1)
    if draw == "device":
        draws = torch.rand(flat.shape, dtype=torch.float32, device=flat.device)
        keys = torch.where(flat, draws, 2.0)  # non-candidates last
        k = torch.floor(mask.sum().to(torch.float64) * fraction).clamp(min=1)
        return ((_ranks(keys) < k) & flat).view_as(candidates)
    order = torch.argsort((~flat).to(torch.int8), stable=True)  # the candidates first, in row-major order
    base = flat.numel() + 1
    n_tokens, n = divmod(int((mask.sum() * base + flat.sum()).item()), base)  # both counts in one sync
    chosen = torch.zeros_like(flat)
    if n > 0:
        k = max(int(fraction * n_tokens), 1)
        picked = order[:n][torch.randperm(n)[:min(k, n)].to(order.device)]
        chosen = chosen.index_fill(0, picked, True)
    return chosen.view_as(candidates)


def _ranks(values: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """The rank of each entry of a 1-d tensor in sorted order (ties by position)."""
    order = torch.sort(values, descending=descending, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def kl_cov(w, b: Batch, cfg) -> Surrogate:
    """KL-Cov: the table's formula (−A·w, plus chosen·|ℓ − ℓ_old|) with chosen = kl_cov_coef on the k tokens of
    largest covariance, 0 elsewhere."""
    with torch.no_grad():
        chosen = kl_cov_tokens(b.adv, b.logp.detach(), b.mask, cfg)
    return token_formulas.kl_cov(w, b, cfg, torch.where(chosen, w.new_tensor(cfg.kl_cov_coef), 0.0))


def fspo(b: Batch, cfg) -> Surrogate:
    """FSPO: the raw sequence log-ratio, clipped to a band that grows as √L."""
    s = _trajectory_log_ratio(b, cfg)
    root = b.lengths.to(s.dtype).sqrt()
    low, high = -cfg.fspo_c_low * root, cfg.fspo_c_high * root
    adv = b.inputs.adv_row
    row_loss = -torch.minimum(torch.exp(s) * adv, torch.exp(torch.clamp(s, low, high)) * adv)
    s = s.detach()
    return Surrogate(
        b.per_token(row_loss),
        b.per_token(torch.exp(s)),
        b.per_token((s < low) & (adv < 0)),
        b.per_token((s > high) & (adv > 0)),
    )


# VESPO's lower bound on the sequence log-ratio, TRL's log(1e-8).
VESPO_LOG_W_MIN = math.log(1e-8)


def vespo(b: Batch, cfg) -> Surrogate:
    """VESPO: −sg(φ(w_i))·A·ℓ, φ(w) = exp(λ + k·log w − λ·w), w_i the raw sequence ratio (TRL's bounds)."""
    with torch.no_grad():
        phi, w = vespo_weight(masked_sum_rows(_token_log_ratio(b, cfg), b.mask), b.inputs.adv_row, cfg,
                              b.inputs.is_weights, b.mask)
    return Surrogate(-b.per_token(phi) * b.adv * b.logp, b.per_token(w), _none(b), _none(b))


def vespo_weight(log_ratio_sum: torch.Tensor, adv_row: torch.Tensor, cfg, is_weights=None, mask=None):
    """(φ(w_i), w_i) (B,) of VESPO from Σ_t m·clamp(ℓ − ℓ_old), the row sums of the clamped token log-ratios.
    Importance weights ω `(B, T)` (the rollout correction) enter the ratio as TRL has them:
    log w_i += Σ_t m·clamp(log ω_t, log 1e-8, c), in place of weighting the per-token loss."""
    if is_weights is not None:
        log_is = torch.log(is_weights).clamp(VESPO_LOG_W_MIN, cfg.log_ratio_clamp)
        log_ratio_sum = log_ratio_sum + masked_sum_rows(log_is, mask)
    log_w = log_ratio_sum.clamp(VESPO_LOG_W_MIN, cfg.log_ratio_clamp)
    w = torch.exp(log_w)
    pos = adv_row >= 0
    k = torch.where(pos, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(pos, log_w.new_tensor(cfg.vespo_lambda_pos), log_w.new_tensor(cfg.vespo_lambda_neg))
    lam = lam.clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), w


def group_expectation_ratio(b: Batch, cfg) -> torch.Tensor:
    """GEPO's w_i = p_i / Ê_g on each token of its row (B, T): log w_i = log p_i − log Ê_g with
    Ê_g = Σ_g q_j² / Σ_g q_j, all in log space."""
    valid = b.lengths > 0
    i = b.inputs
    log_e = gepo_log_expectation(b.row_mean(b.old_logp), i.group, i.num_groups, valid, i.group_size)
    log_w = (b.row_mean(b.logp) - log_e).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    log_w = torch.where(valid, log_w, torch.zeros_like(log_w))  # a group of empty rows has no Ê_g
    return b.per_token(torch.exp(log_w))


def gepo_log_expectation(log_q: torch.Tensor, group: torch.Tensor, num_groups: int, valid: torch.Tensor,
                         group_size: Optional[int] = None):
    """log Ê_g of each row's group (B,): log(Σ_g q_j² / Σ_g q_j) over the valid rows, log q_j the mean ℓ_old; as
    log(Σ e_j² / Σ e_j) + log max_g q with e_j = q_j / max_g q, so that nothing overflows."""
    e, top = group_exp(log_q, valid, group, num_groups, group_size)
    sums = group_sum(e[:, None].expand(-1, 2).cumprod(1), group, num_groups, group_size)  # [e, e·e]: one op, one sum
    return group_gather(torch.log(sums[:, 1] / sums[:, 0]) + top, group, group_size)


def geometric(b: Batch, cfg) -> Surrogate:
    """GMPO: geometric mean of sign-aware, log-space clipped token ratios."""
    delta = _token_log_ratio(b, cfg)
    sign = torch.sign(b.adv)
    clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-cfg.clip_low, cfg.clip_high))
    row_loss = -b.inputs.adv_row * torch.exp(b.row_mean(clipped))
    delta = delta.detach()
    return Surrogate(
        b.per_token(row_loss),
        b.per_token(torch.exp(b.row_mean(delta))),
        (delta < -cfg.clip_low) & (b.adv < 0),
        (delta > cfg.clip_high) & (b.adv > 0),
    )


def snis(b: Batch, cfg) -> Surrogate:
    """Self-normalised importance sampling over the prompt group, with the SNIS baseline (docs/math.md §4, §5).

    log ρ_i = Σ_t m (ℓ − ℓ_old), ŵ_i = ρ_i / mean_{j∈g} ρ_j (in log space), b_g = mean_{j∈g} ŵ_j R_j;
    row loss −ŵ_i (R_i − b_g)·Σ_t m ℓ, with ŵ and b constants. The ratio metric is ρ_i = e^clamp(log ρ_i).
    """
    log_rho = masked_sum_rows(b.logp - b.old_logp, b.mask).detach()
    i = b.inputs
    row_loss = (-snis_advantage(log_rho, i.rewards, i.group, i.num_groups, b.lengths > 0, i.group_size)
                * masked_sum_rows(b.logp, b.mask))
    none = torch.zeros_like(b.mask)
    rho = torch.exp(log_rho.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    return Surrogate(b.per_token(row_loss), b.per_token(rho), none, none)


def snis_advantage(log_rho: torch.Tensor, rewards: torch.Tensor, group: torch.Tensor, num_groups: int,
                   valid: torch.Tensor, group_size: Optional[int] = None) -> torch.Tensor:
    """ŵ_i·(R_i − b_g) (B,), SNIS's constant coefficient of Σ_t m ℓ, from log ρ_i unclamped; 0 for invalid rows.

    Over the valid rows, with e_j = ρ_j / max_g ρ (0 on the others): ŵ_i = ρ_i / mean_j ρ_j = n_g·e_i / Σ_j e_j and
    b_g = mean_j ŵ_j R_j = Σ_j e_j R_j / Σ_j e_j, from one group sum. Without forming ρ: nothing overflows, and a
    clamp of log ρ would change the weights (docs/math.md §4)."""
    e, _ = group_exp(log_rho, valid, group, num_groups, group_size)
    sums = group_sum(torch.stack([valid, e * rewards, e], 1), group, num_groups, group_size)  # n_g, Σ e R, Σ e
    # Σ e ≥ 1 in a group with a valid row; in one without, it is 0 and so are n_g and Σ e R
    scale, baseline = group_gather(sums[:, :2] / sums[:, 2:].clamp(min=1), group, group_size).unbind(1)
    return e * scale * (rewards - baseline)
