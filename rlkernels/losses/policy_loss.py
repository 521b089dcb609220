"""`policy_loss`: the RL objectives of DESIGN.md §3 over per-token log-probs."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from .._checks import FLOAT_DTYPES, check_mask, check_real, check_same_shape, check_tensor
from .._groups import group_index
from . import surrogates
from .aggregation import aggregate, masked_max, masked_mean
from .config import SEQUENCE_RATIOS, PolicyLossConfig
from .kl import kl_estimate

_GROUPED_RATIOS = ("group_expectation", "snis")


@dataclasses.dataclass
class LossOutput:
    """`loss`: 0-d tensor to minimise; `metrics`: detached 0-d tensors (DESIGN.md §3.7)."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def policy_loss(
    logp: torch.Tensor,
    advantages: Optional[torch.Tensor],
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    rewards: Optional[torch.Tensor] = None,
    num_items: Optional[float] = None,
    num_seqs: Optional[float] = None,
) -> LossOutput:
    """The policy loss of `config` on log-probs `logp (B, T)` of the sampled tokens.

    `advantages` is `(B,)` or `(B, T)` (`None` for `snis`, which takes `rewards (B,)`);
    `old_logp=None` means on-policy. `num_items` / `num_seqs` replace the local token / row
    counts of the aggregation (global counts for gradient accumulation and data parallel).
    """
    b, ref_logp, entropy = prepare_batch(
        logp, advantages, mask, config, old_logp, ref_logp, entropy, group_ids, rewards, num_items, num_seqs
    )
    cfg = config
    per_token, sur, k = per_token_loss(b, cfg, ref_logp, entropy)
    metrics = {"kl": masked_mean(k.detach(), b.mask) if k is not None else torch.zeros((), dtype=logp.dtype, device=logp.device)}
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), b.mask)

    loss = aggregate(
        per_token, b.mask, cfg.agg, num_items=num_items, num_seqs=num_seqs, norm_length=cfg.norm_length
    )
    low, high = masked_mean(sur.clipped_low.to(logp.dtype), b.mask), masked_mean(sur.clipped_high.to(logp.dtype), b.mask)
    metrics.update(
        clip_frac=low + high,
        clip_frac_low=low,
        clip_frac_high=high,
        ratio_mean=masked_mean(sur.ratio, b.mask),
        ratio_max=masked_max(sur.ratio, b.mask),
        approx_kl=masked_mean(kl_estimate(b.old_logp, b.logp.detach(), "k3", cfg.log_ratio_clamp), b.mask),
    )
    return LossOutput(loss, metrics)


def per_token_loss(b: surrogates.Batch, cfg: PolicyLossConfig, ref_logp, entropy):
    """(ℓoss (B, T), the surrogate, the KL values for the `kl` metric or None): surrogate + β·k − c_H·H.

    For `ratio="token"` every term depends on its own token only, so this may be evaluated on
    any subset of tokens (the hidden-state path does it chunk by chunk).
    """
    sur = surrogates.BY_RATIO[cfg.ratio](b, cfg)
    per_token, k = sur.loss, None
    if ref_logp is not None:
        k = kl_estimate(ref_logp, b.logp, cfg.kl_estimator or "k3", cfg.log_ratio_clamp)
        if cfg.kl_coef > 0:
            if cfg.kl_clamp is not None:
                k = k.clamp(-cfg.kl_clamp, cfg.kl_clamp)
            if cfg.kl_bias_correction:
                k = k * torch.exp((b.logp - b.old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)).detach()
            per_token = per_token + cfg.kl_coef * k
        else:  # the metric reports k3 when no KL enters the loss
            k = kl_estimate(ref_logp, b.logp, "k3", cfg.log_ratio_clamp)
    if entropy is not None and cfg.entropy_coef != 0:
        per_token = per_token - cfg.entropy_coef * entropy
    return per_token, sur, k


def prepare_batch(logp, advantages, mask, cfg, old_logp, ref_logp, entropy, group_ids, rewards, num_items, num_seqs):
    """Validate the inputs and zero every masked position, so padding can hold anything."""
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"config: expected a PolicyLossConfig (see rlkernels.presets), got {type(cfg).__name__}")
    check_tensor("logp", logp, ndim=2, dtypes=(torch.float32, torch.float64))
    check_tensor("mask", mask, ndim=2)
    check_same_shape("mask", mask, "logp", logp)
    mask = check_mask("mask", mask)
    B, T = logp.shape

    def per_token(name, t):
        if t is None:
            return None
        check_tensor(name, t, dtypes=FLOAT_DTYPES)
        check_same_shape(name, t, "logp", logp)
        return torch.where(mask, t.to(logp.dtype), torch.zeros((), dtype=logp.dtype, device=logp.device))

    logp_m = per_token("logp", logp)
    old = per_token("old_logp", old_logp)
    old = logp_m.detach() if old is None else old.detach()
    ref_logp = per_token("ref_logp", ref_logp)
    entropy = per_token("entropy", entropy)
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"ref_logp: required when kl_coef > 0 (kl_coef={cfg.kl_coef})")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy: required when entropy_coef != 0 (entropy_coef={cfg.entropy_coef})")
    if num_items is not None:
        check_real("num_items", num_items, 0, lo_open=True)
    if num_seqs is not None:
        check_real("num_seqs", num_seqs, 0, lo_open=True)

    lengths = mask.sum(-1).to(logp.dtype)
    adv, adv_row = _advantages(advantages, mask, cfg, logp)
    if cfg.ratio == "snis":
        if rewards is None:
            raise ValueError("rewards: required for ratio='snis' (it takes rewards in place of advantages)")
        check_tensor("rewards", rewards, shape=(B,), dtypes=FLOAT_DTYPES)
        rewards = rewards.to(logp.dtype).detach()
    group, num_groups = None, 0
    if cfg.ratio in _GROUPED_RATIOS:
        if group_ids is None and cfg.group_size is None:
            raise ValueError(f"group_ids: ratio={cfg.ratio!r} needs group_ids or config.group_size")
        group, num_groups = group_index(
            B, group_ids, None if group_ids is not None else cfg.group_size, logp.device, ref_name="logp rows"
        )
    b = surrogates.Batch(logp_m, old, mask, lengths, adv, adv_row, group, num_groups, rewards)
    return b, ref_logp, entropy


def _advantages(advantages, mask, cfg, logp):
    """(A per token, A per row or None); sequence-level ratios need one advantage per row."""
    if advantages is None:
        if cfg.ratio == "snis":
            return None, None
        raise ValueError(f"advantages: required for ratio={cfg.ratio!r}")
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    B, T = logp.shape
    if advantages.shape == (B,):
        row = advantages.to(logp.dtype).detach()
        return row[:, None].expand(B, T), row
    if advantages.shape != (B, T):
        raise ValueError(f"advantages: expected shape ({B},) or ({B}, {T}) matching logp, got {tuple(advantages.shape)}")
    adv = torch.where(mask, advantages.to(logp.dtype).detach(), torch.zeros((), dtype=logp.dtype, device=logp.device))
    if cfg.ratio not in SEQUENCE_RATIOS:
        return adv, None
    row = adv.sum(-1) / mask.sum(-1).clamp(min=1)
    spread = torch.where(mask, adv - row[:, None], torch.zeros_like(adv)).abs().amax()
    # Not under torch.compile: a data-dependent check would break the graph.
    if not torch.compiler.is_compiling() and bool(spread > 1e-6 * (1 + row.abs().max())):
        raise ValueError(
            f"advantages: ratio={cfg.ratio!r} needs one advantage per row, but a (B, T) advantage varies "
            "within a row; pass (B,) advantages, or use ratio='sequence_token' for per-token advantages"
        )
    return row[:, None].expand(B, T), row
