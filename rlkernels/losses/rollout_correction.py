"""Rollout correction: the importance weights ω = π_old/π_rollout that make up for the gap between
the engine that sampled (vLLM, SGLang) and the policy being trained, to pass as `is_weights` to
the losses (docs/math.md §7), and rejection sampling, a mask of the tokens or rows whose policies
drifted too far apart. TRL's four `vllm_importance_sampling_mode`s and verl's `rollout_is` /
`rollout_is_threshold` / `rollout_is_batch_normalize` are settings of `rollout_is_weights`; each of
verl's `rollout_rs` options is a setting of `rollout_rejection_mask`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import FLOAT_DTYPES, check_mask, check_real, check_tensor
from .._dtypes import acc_dtype

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")
ESTIMATORS = ("k1", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


def rollout_is_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: Optional[float] = 2.0,
    lower: Optional[float] = None,
    batch_normalize: bool = False,
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """Detached `(B, T)` weights, 0 on padding, from the trainer's `old_logp` and the sampler's
    `rollout_logp` (both `(B, T)`).

    `level="token"`: ω_t = exp(ℓ_old − ℓ_rollout) per token; `"sequence"`: the row's product,
    exp(Σ_t (ℓ_old − ℓ_rollout)), on each of its tokens. The log-ratio is clamped to
    ±`log_ratio_clamp`; a NaN rollout log-prob (a token the engine could not score) counts as 0.
    `mode="truncate"`: ω clamped to [lower, upper] (truncated IS; TRL's `*_truncate` with
    clip_min/clip_max, verl's single threshold). `"mask"`: ω kept inside [lower, upper], 0 outside
    (IcePop; TRL's `*_mask`, verl's "lower_upper" threshold). `None` is no bound.
    `batch_normalize`: ω divided by its mean over the tokens (token level) or the non-empty rows
    (sequence level) of this call, as verl's `rollout_is_batch_normalize` within one process.
    """
    mask = _check_log_probs(old_logp, rollout_logp, mask)
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {LEVELS}, got {level!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    upper = None if upper is None else check_real("upper", upper, 0, lo_open=True)
    lower = None if lower is None else check_real("lower", lower, 0)
    if upper is not None and lower is not None and lower > upper:
        raise ValueError(f"lower: expected a value <= upper ({upper}), got {lower}")
    if not isinstance(batch_normalize, bool):
        raise TypeError(f"batch_normalize: expected a bool, got {type(batch_normalize).__name__}")
    clamp = check_real("log_ratio_clamp", log_ratio_clamp, 0, lo_open=True)

    dtype = acc_dtype(old_logp)
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    log_ratio = torch.where(mask, torch.nan_to_num(old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype),
                                                   nan=0.0), zero)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    w = torch.exp(log_ratio.clamp(-clamp, clamp))
    if mode == "truncate":
        if lower is not None or upper is not None:  # torch.clamp refuses two None bounds
            w = w.clamp(min=lower, max=upper)
    else:
        inside = torch.ones_like(mask)
        if lower is not None:
            inside = inside & (w >= lower)
        if upper is not None:
            inside = inside & (w <= upper)
        w = torch.where(inside, w, zero)
    w = torch.where(mask, w, zero)
    if batch_normalize:
        if level == "token":
            mean = w.sum() / mask.sum().clamp(min=1)
        else:  # one weight per non-empty row
            rows = mask.any(-1)
            mean = torch.where(rows, w.amax(-1), zero).sum() / rows.sum().clamp(min=1)
        w = torch.where(mean > 1e-8, w / mean, w)  # an all-zero batch stays as it is (no sync)
    return w


def rollout_rejection_mask(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k1",
    level: str = "token",
    lower: Optional[float] = None,
    upper: Optional[float] = None,
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """The `(B, T)` bool mask of the tokens of `mask` that pass one rejection test (docs/math.md §7).

    With r = clamp(ℓ_old − ℓ_rollout, ±log_ratio_clamp) per token, the statistic is `estimator`'s
    k1 = −r, k2 = r²/2 or k3 = e^r − 1 − r, per token (`level="token"`: tokens are rejected one
    by one) or its row's sum, mean or max over the tokens of `mask` (`"seq_sum"`, `"seq_mean"`,
    `"seq_max"`: a row is kept or rejected whole). A token is kept when lower ≤ statistic ≤ upper
    (`None`: no bound); a NaN statistic (a token the sampler could not score) is rejected. Several
    tests combine as the logical and of their masks, each from the same `mask`.
    """
    mask = _check_log_probs(old_logp, rollout_logp, mask)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    if level not in REJECTION_LEVELS:
        raise ValueError(f"level: expected one of {REJECTION_LEVELS}, got {level!r}")
    if level == "seq_max" and estimator == "k1":
        raise ValueError("estimator: 'k1' has no 'seq_max' level (k1 is signed); use 'k2' or 'k3'")
    upper = None if upper is None else check_real("upper", upper)
    lower = None if lower is None else check_real("lower", lower)
    if upper is not None and lower is not None and lower > upper:
        raise ValueError(f"lower: expected a value <= upper ({upper}), got {lower}")
    clamp = check_real("log_ratio_clamp", log_ratio_clamp, 0, lo_open=True)

    dtype = acc_dtype(old_logp)
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    r = (old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)).clamp(-clamp, clamp)
    stat = -r if estimator == "k1" else 0.5 * r.square() if estimator == "k2" else torch.expm1(r) - r
    if level != "token":
        if level == "seq_max":
            top = torch.where(mask, stat, float("-inf")).amax(-1) if stat.shape[-1] else zero.expand(stat.shape[0])
            row = torch.where(mask.any(-1), top, zero)  # a row without tokens: 0, as verl
        else:
            row = torch.where(mask, stat, zero).sum(-1)
            if level == "seq_mean":
                row = row / mask.sum(-1).clamp(min=1)
        stat = row[:, None].expand_as(r)
    keep = stat == stat  # not NaN
    if lower is not None:
        keep = keep & (stat >= lower)
    if upper is not None:
        keep = keep & (stat <= upper)
    return mask & keep


def _check_log_probs(old_logp, rollout_logp, mask) -> Tensor:
    """Both functions' `(B, T)` inputs checked; returns the mask as bool."""
    check_tensor("old_logp", old_logp, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("rollout_logp", rollout_logp, shape=tuple(old_logp.shape), dtypes=FLOAT_DTYPES, device=old_logp.device)
    check_tensor("mask", mask, shape=tuple(old_logp.shape), device=old_logp.device)
    return check_mask("mask", mask)
