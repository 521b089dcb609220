"""`policy_loss`: the RL objectives of docs/math.md over per-token log-probs (the spec of every kernel)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .._checks import check_tensor
from . import objectives, surrogates
from .aggregation import aggregate, masked_mean
from .batch import Batch
from .config import PolicyLossConfig
from .inputs import LossInputs, takes_loss_args
from .kl import kl_estimate
from .metrics import metrics_from_sums


@dataclasses.dataclass
class LossOutput:
    """`loss`: 0-d tensor to minimise; `metrics`: detached 0-d tensors (docs/math.md, "Metrics");
    `logp`, `entropy`: the per-token log-probs and entropies `(B, T)` the fused ops computed on the
    way, detached, in the accumulation dtype (None from `policy_loss`, which takes them as inputs)."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]
    logp: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


@takes_loss_args
def policy_loss(
    logp: torch.Tensor,
    advantages: Optional[torch.Tensor],
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    entropy: Optional[torch.Tensor] = None,
    **loss_args,
) -> LossOutput:
    """The policy loss of `config` on log-probs `logp (B, T)` of the sampled tokens.

    `advantages` is `(B,)` or `(B, T)` (`None` for `snis`, which takes `rewards (B,)`);
    `old_logp=None` means on-policy. `ref_logp` `(B, T)`: the reference's log-probs (the KL term).
    `entropy` `(B, T)`: the per-token entropies (the bonus, `top_entropy_quantile`, the metric).
    `group_ids` `(B,)`: each row's prompt group (grouped ratios; default: `config.group_size` contiguous
    rows). `num_items` / `num_seqs` replace the local token / row counts of the aggregation (global
    counts for gradient accumulation and data parallel).
    `is_weights` `(B, T)` or `(B,)`: constant weights of each token's surrogate term (not of the KL
    or entropy terms), e.g. the rollout correction's importance weights (docs/math.md §7).
    `rollout_logp` `(B, T)`: the sampler's log-probs, read by `config.off_policy_mask` (default: `old_logp`).
    `entropy_quantile_group`: a torch.distributed process group over whose ranks' masked tokens
    `config.top_entropy_quantile` takes its quantile (TRL takes it over every process; default: this call's).
    The keyword arguments but `entropy` are declared once, by `LossInputs.build` (`takes_loss_args`).
    """
    check_tensor("logp", logp, ndim=2, dtypes=(torch.float32, torch.float64))
    inputs = LossInputs.build(config, shape=tuple(logp.shape), dtype=logp.dtype, device=logp.device, mask=mask,
                              advantages=advantages, **loss_args)
    return evaluate(logp, entropy, inputs, config)


def evaluate(logp: torch.Tensor, entropy: Optional[torch.Tensor], inputs: LossInputs,
             config: PolicyLossConfig) -> LossOutput:
    """The loss and metrics of validated `inputs` at log-probs `logp (B, T)` and entropy (or None)."""
    b, ref_logp, entropy = inputs.masked(logp, entropy, config)
    high_entropy = high_entropy_tokens(entropy, b.mask, config, inputs.entropy_quantile_group)
    w = surrogate_weights(b, inputs, config, high_entropy)
    per_token, sur, k = per_token_loss(b, config, ref_logp, entropy, w)
    loss = aggregate(per_token, b.mask, config.agg, num_items=inputs.num_items, num_seqs=inputs.num_seqs,
                     norm_length=config.norm_length)
    if separate_entropy_bonus(config):  # its own token mean, over the tokens the surrogate acts on (§7)
        loss = loss - config.entropy_coef * masked_mean(entropy, b.mask if high_entropy is None else high_entropy)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    with torch.no_grad():
        approx_kl = kl_estimate(b.old_logp, b.logp, "k3", config.log_ratio_clamp)
        low, high = sur.clipped_low, sur.clipped_high
        if w is not None:  # a token whose surrogate has weight 0 is not counted as clipped (§10)
            low, high = low & (w > 0), high & (w > 0)
        stats = [low, high, sur.ratio, approx_kl, zero.expand_as(logp) if k is None else k]
        stats.append(zero.expand_as(logp) if entropy is None else entropy)
        stats = torch.where(b.mask[..., None], torch.stack([s.to(logp.dtype) for s in stats], -1), zero)
        ratio_max = torch.where(b.mask, sur.ratio, zero).amax() if logp.numel() else zero
        count = b.mask.sum().clamp(min=1)
        metrics = metrics_from_sums(stats.sum((0, 1)), count, ratio_max, entropy is not None)
    return LossOutput(loss, metrics)


def high_entropy_tokens(entropy, mask, config: PolicyLossConfig, group=None):
    """§7 `top_entropy_quantile`: the tokens of `mask` whose entropy is at least the (1 − ρ)-quantile of theirs
    (of every rank's in the process group `group`), or None."""
    if config.top_entropy_quantile is None or config.top_entropy_quantile >= 1:
        return None
    q = 1 - config.top_entropy_quantile
    entropy = entropy.detach()
    threshold = _quantile(entropy, mask, q) if group is None else _quantile(*_gathered(entropy, mask, group), q)
    return (entropy >= threshold) & mask


def _gathered(x, mask, group):
    """(values, mask) of every rank of `group`, concatenated: each rank's padded to the longest with masked
    entries. One host sync (the longest length), on this opt-in multi-process path only."""
    n = torch.tensor([x.numel()], device=x.device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    pad = int(n) - x.numel()
    values = torch.cat([x.reshape(-1), x.new_zeros(pad)])
    kept = torch.cat([mask.reshape(-1), mask.new_zeros(pad)]).to(torch.uint8)  # gloo gathers no bool
    world = dist.get_world_size(group)
    all_values, all_kept = [torch.empty_like(values) for _ in range(world)], [torch.empty_like(kept) for _ in range(world)]
    dist.all_gather(all_values, values, group=group)
    dist.all_gather(all_kept, kept, group=group)
    return torch.cat(all_values), torch.cat(all_kept).bool()


def surrogate_weights(b: Batch, inputs: LossInputs, config: PolicyLossConfig, high_entropy=None):
    """ω of §7, (B, T) and 0 where masked, or None: the importance weights times the off-policy and the entropy
    masks (`high_entropy`: `high_entropy_tokens`'s). The fused paths count a row's clip flags on its ω > 0."""
    # VESPO takes the weights into its sequence ratio instead (as TRL does; `surrogates.vespo`)
    w = (None if inputs.is_weights is None or objectives.get(config.objective).weights_in_ratio else
         torch.where(b.mask, inputs.is_weights, 0.0))  # padding: anything
    if high_entropy is not None:
        w = high_entropy.to(b.logp.dtype) if w is None else w * high_entropy
    if config.off_policy_mask is None:
        return w
    # DeepSeek-V3.2: drop a row with A < 0 whose mean (ℓ_rollout − ℓ) exceeds the threshold. NaN
    # rollout log-probs (tokens the sampler could not score) count as 0, as TRL does.
    rollout = inputs.rollout_logp if inputs.rollout_logp is not None else b.old_logp
    mean_gap = b.row_mean(torch.nan_to_num(rollout - b.logp.detach(), nan=0.0))[:, None]
    keep = (((b.adv >= 0) | (mean_gap <= config.off_policy_mask)) & b.mask).to(b.logp.dtype)
    return keep if w is None else w * keep


def _quantile(x, mask, q: float):
    """torch.quantile (linear interpolation) of the masked entries of x, without copying their count
    to the host: sort with the others at +inf, then interpolate at q·(n − 1). +inf if none."""
    values = torch.where(mask, x, float("inf")).reshape(-1).sort().values
    pos = q * (mask.sum() - 1).clamp(min=0).to(x.dtype)
    lo, hi = pos.floor(), pos.ceil()
    low, high = values[torch.stack([lo, hi]).long()].unbind()  # a 1-d index: a 0-d one would be read on the host
    return torch.where(hi > lo, low + (high - low) * (pos - lo), low)


def per_token_loss(b: Batch, cfg: PolicyLossConfig, ref_logp, entropy, is_weights=None):
    """(ℓoss (B, T), the surrogate, the KL values for the `kl` metric or None): w·surrogate + β·k − c_H·H,
    w the importance weights (1 when None).

    For `ratio="token"` every term depends on its own token only, so this may be evaluated on
    any subset of tokens (the kernels evaluate it token by token).
    """
    sur = objectives.get(cfg.objective).surrogates[cfg.ratio](b, cfg)
    per_token, k = sur.loss, None
    if is_weights is not None:  # a sequence surrogate, broadcast to its tokens, is weighted token by token
        per_token = per_token * is_weights
    if ref_logp is not None:
        k = kl_estimate(ref_logp, b.logp, cfg.kl_estimator or "k3", cfg.log_ratio_clamp)
        if cfg.kl_coef > 0:
            if cfg.kl_clamp is not None:
                k = k.clamp(-cfg.kl_clamp, cfg.kl_clamp)
            if cfg.kl_bias_correction:  # times the token's ratio or its row's, with the ratio's gradient
                k = k * (surrogates.token_ratio(b, cfg) if cfg.kl_bias_ratio == "token" else
                         surrogates.sequence_ratio(b, cfg))
            per_token = per_token + cfg.kl_coef * k
        else:  # the metric reports k3 when no KL enters the loss
            k = kl_estimate(ref_logp, b.logp, "k3", cfg.log_ratio_clamp)
    if entropy is not None and cfg.entropy_coef != 0 and not separate_entropy_bonus(cfg):
        per_token = per_token - cfg.entropy_coef * entropy
    return per_token, sur, k


def separate_entropy_bonus(cfg: PolicyLossConfig) -> bool:
    """An entropy bonus aggregated apart from the loss (`entropy_agg="token_mean"`), not in each token's loss."""
    return cfg.entropy_coef != 0 and cfg.entropy_agg is not None
