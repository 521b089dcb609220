"""The scalars of the per-token loss that the fused forward kernels evaluate (docs/math.md).

The kernels know nothing of `PolicyLossConfig`; `ops/` translates a token-level config into
these numbers once per call. "No bound" is encoded as +inf, so every kernel runs the same
branch-free formula: clamp(w, 1 − inf, 1 + inf) = w, min(w, inf) = w, min(ℓoss, inf·|A|) = ℓoss.
"""
from __future__ import annotations

import dataclasses
import math

CLIP, CISPO, REINFORCE, SAPO, DPPO_TV, DPPO_KL, DRO = 0, 1, 2, 3, 4, 5, 6  # objective
# Clip-Cov and KL-Cov: CLIP with the per-token `chosen` of `covariance_choice` (kernels/__init__.py)
CLIP_COV, KL_COV = 7, 8
CHOOSE_CLIP_COV, CHOOSE_KL_COV = 0, 1  # covariance_choice's objective
KL_NONE, KL_K1, KL_K2, KL_K3 = 0, 1, 2, 3  # kl_estimator (KL_NONE: no KL term in the loss)
NUM_STATS = 7  # columns of `stats`, in this order:
STATS = ("loss", "clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy")


@dataclasses.dataclass(frozen=True)
class TokenLossParams:
    objective: int  # CLIP, CISPO, REINFORCE, SAPO, DPPO_TV, DPPO_KL, DRO, CLIP_COV or KL_COV
    clip_low: float  # the ratio's lower bound is 1 − clip_low (inf: none); DPPO: the divergence bound for A < 0
    clip_high: float  # upper bound 1 + clip_high (inf: none); DPPO: the divergence bound for A > 0
    delta: float  # unclipped branch uses min(w, delta) (inf: none)
    dual_clip: float  # for A < 0 the loss is min(ℓoss, −dual_clip·A) (inf: none)
    kl_estimator: int  # KL_NONE, KL_K1, KL_K2, KL_K3; the estimator of the KL *loss* term
    kl_coef: float  # β (0 with KL_NONE)
    kl_clamp: float  # the KL term is clamped to [−kl_clamp, kl_clamp] (inf: none)
    kl_bias_correction: bool  # the KL term times the clamped ratio w (differentiated through w too)
    entropy_coef: float  # c_H: ℓoss −= c_H·H
    log_ratio_clamp: float  # c: log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are clamped to [−c, c]
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where A > 0
    sapo_tau_neg: float = 1.0  # and where A ≤ 0
    ratio_cap: float = math.inf  # DPPO's weight is min(w, ratio_cap) (inf: none)
    dro_beta: float = 0.0  # DRO's β


@dataclasses.dataclass(frozen=True)
class CovarianceChoiceParams:
    objective: int  # CHOOSE_CLIP_COV or CHOOSE_KL_COV
    fraction: float  # k = max(⌊fraction·N⌋, 1) tokens, N the masked ones
    cov_lb: float  # Clip-Cov: a candidate's covariance lies in (cov_lb, cov_ub)
    cov_ub: float
    clip_low: float  # Clip-Cov: PPO's clip bounds 1 − clip_low, 1 + clip_high; a clipped token is no candidate
    clip_high: float
    log_ratio_clamp: float
    scale: float  # a chosen token's output
