"""Importance weights (docs/math.md §4) and surrogates (§5) as per-token losses.

Every function returns a `Surrogate` over (B, T): sequence-level losses are broadcast to the
row's tokens, so one aggregation serves all of them (docs/math.md, "Surrogates").
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .aggregation import masked_sum_rows


@dataclasses.dataclass
class Surrogate:
    loss: torch.Tensor  # (B, T) per-token loss, differentiable w.r.t. ℓ
    ratio: torch.Tensor  # (B, T) unclipped importance weight, detached, for metrics
    clipped_low: torch.Tensor  # (B, T) bool: the lower clip removes the gradient here
    clipped_high: torch.Tensor  # (B, T) bool


@dataclasses.dataclass
class Batch:
    """The inputs of one loss call, masked positions already zeroed (so no NaN can leak in)."""

    logp: torch.Tensor  # ℓ (B, T)
    old_logp: torch.Tensor  # ℓ_old (B, T), detached
    mask: torch.Tensor  # (B, T) bool
    lengths: torch.Tensor  # L_i (B,)
    adv: Optional[torch.Tensor]  # A (B, T), per-row advantages broadcast
    adv_row: Optional[torch.Tensor]  # (B,), only for sequence-level ratios
    group: Optional[torch.Tensor]  # (B,) group index in [0, num_groups)
    num_groups: int
    rewards: Optional[torch.Tensor]  # (B,), only for snis

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        return masked_sum_rows(x, self.mask) / self.lengths.clamp(min=1)

    def per_token(self, row: torch.Tensor) -> torch.Tensor:
        return row[:, None].expand_as(self.logp)


def clip_objective(w, adv, cfg):
    """PPO's clipped surrogate max(−A·w', −A·clip(w)) with optional delta and dual clip."""
    unclipped = -adv * (w.clamp(max=cfg.delta) if cfg.delta is not None else w)
    loss = torch.maximum(unclipped, -adv * w.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
    if cfg.dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
    w = w.detach()
    return Surrogate(loss, w, (w < 1 - cfg.clip_low) & (adv < 0), (w > 1 + cfg.clip_high) & (adv > 0))


def _token_log_ratio(b: Batch, cfg) -> torch.Tensor:
    return (b.logp - b.old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def _sequence_log_ratio(b: Batch, cfg) -> torch.Tensor:
    """log s_i = Σ_t m (ℓ − ℓ_old) / L_i (GSPO), clamped."""
    return b.row_mean(b.logp - b.old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def token(b: Batch, cfg) -> Surrogate:
    w = torch.exp(_token_log_ratio(b, cfg))
    if cfg.objective == "clip":
        return clip_objective(w, b.adv, cfg)
    if cfg.objective == "reinforce":
        none = torch.zeros_like(b.mask)
        return Surrogate(-b.adv * b.logp, w.detach(), none, none)
    # CISPO: the clipped weight is a constant that scales the REINFORCE gradient.
    low = None if cfg.clip_low is None else 1 - cfg.clip_low
    high = None if cfg.clip_high is None else 1 + cfg.clip_high
    w = w.detach()
    clipped_low = w < low if low is not None else torch.zeros_like(b.mask)
    clipped_high = w > high if high is not None else torch.zeros_like(b.mask)
    return Surrogate(-w.clamp(low, high) * b.adv * b.logp, w, clipped_low, clipped_high)


def sequence(b: Batch, cfg) -> Surrogate:
    return clip_objective(b.per_token(torch.exp(_sequence_log_ratio(b, cfg))), b.adv, cfg)


def sequence_token(b: Batch, cfg) -> Surrogate:
    # Value of s_i on every token, gradient of ℓ_{i,t} alone (GSPO-token).
    log_w = _sequence_log_ratio(b, cfg).detach()[:, None] + b.logp - b.logp.detach()
    return clip_objective(torch.exp(log_w), b.adv, cfg)


def sequence_sum(b: Batch, cfg) -> Surrogate:
    """FSPO: the raw sequence log-ratio, clipped to a band that grows as √L."""
    s = masked_sum_rows(b.logp - b.old_logp, b.mask).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    root = b.lengths.to(s.dtype).sqrt()
    low, high = -cfg.fspo_c_low * root, cfg.fspo_c_high * root
    adv = b.adv_row
    row_loss = -torch.minimum(torch.exp(s) * adv, torch.exp(torch.clamp(s, low, high)) * adv)
    s = s.detach()
    return Surrogate(
        b.per_token(row_loss),
        b.per_token(torch.exp(s)),
        b.per_token((s < low) & (adv < 0)),
        b.per_token((s > high) & (adv > 0)),
    )


def group_expectation(b: Batch, cfg) -> Surrogate:
    """GEPO: log w_i = log p_i − log Ê_g with Ê_g = Σ_g q_j² / Σ_g q_j, all in log space."""
    log_p = b.row_mean(b.logp)
    log_q = b.row_mean(b.old_logp)
    valid = b.lengths > 0
    log_e = group_logsumexp(2 * log_q, b.group, b.num_groups, valid) - group_logsumexp(
        log_q, b.group, b.num_groups, valid
    )
    log_w = (log_p - log_e[b.group]).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    log_w = torch.where(valid, log_w, torch.zeros_like(log_w))  # a group of empty rows has no Ê_g
    return clip_objective(b.per_token(torch.exp(log_w)), b.adv, cfg)


def geometric(b: Batch, cfg) -> Surrogate:
    """GMPO: geometric mean of sign-aware, log-space clipped token ratios."""
    delta = _token_log_ratio(b, cfg)
    sign = torch.sign(b.adv)
    clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-cfg.clip_low, cfg.clip_high))
    row_loss = -b.adv_row * torch.exp(b.row_mean(clipped))
    delta = delta.detach()
    return Surrogate(
        b.per_token(row_loss),
        b.per_token(torch.exp(b.row_mean(delta))),
        (delta < -cfg.clip_low) & (b.adv < 0),
        (delta > cfg.clip_high) & (b.adv > 0),
    )


def snis(b: Batch, cfg) -> Surrogate:
    """Self-normalised importance weights with a group baseline (experimental, docs/math.md §4)."""
    s = torch.exp(_sequence_log_ratio(b, cfg)).detach()
    valid = b.lengths > 0
    w_hat = torch.where(valid, s / group_mean(s, b.group, b.num_groups, valid)[b.group], torch.zeros_like(s))
    baseline = group_mean(w_hat * b.rewards, b.group, b.num_groups, valid)[b.group]
    row_loss = -w_hat * (b.rewards - baseline) * b.row_mean(b.logp)
    none = torch.zeros_like(b.mask)
    return Surrogate(b.per_token(row_loss), b.per_token(s), none, none)


def group_mean(x, group, num_groups, valid):
    """Mean of x over the valid rows of each group (0 for a group with none)."""
    zeros = x.new_zeros(num_groups)
    sums = zeros.index_add(0, group, torch.where(valid, x, torch.zeros_like(x)))
    counts = zeros.index_add(0, group, valid.to(x.dtype))
    return sums / counts.clamp(min=1)


def group_logsumexp(x, group, num_groups, valid):
    """logsumexp of x over the valid rows of each group (−inf for a group with none)."""
    x = x.masked_fill(~valid, float("-inf"))
    top = x.new_full((num_groups,), float("-inf")).scatter_reduce(0, group, x, "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    sums = x.new_zeros(num_groups).index_add(0, group, torch.exp(x - top[group]))
    return torch.log(sums) + top


BY_RATIO = {
    "token": token,
    "sequence": sequence,
    "sequence_token": sequence_token,
    "sequence_sum": sequence_sum,
    "group_expectation": group_expectation,
    "geometric": geometric,
    "snis": snis,
}
