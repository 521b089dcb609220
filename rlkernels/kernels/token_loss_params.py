"""The table of the per-token objectives and KL estimators that the fused kernels evaluate (docs/math.md).

One entry per objective or estimator: its id, the kernel parameters it reads and the kernel ops that
evaluate it. The parameters reach every backend as one packed argument, `TokenLossParams.packed()`, in
the order of `PARAMS`: the C++ ops read it at the offsets of csrc/include/rlkernels/token_loss_layout.h,
the Triton kernels at `OFFSET` (python_tests/test_token_loss_table.py checks both against this table).

The kernels know nothing of `PolicyLossConfig`; `ops/kernel_params.py` translates a token-level config
into these numbers once per call (each `Param.field` names the config field a value comes from). "No
bound" is encoded as +inf, so every kernel runs the same branch-free formula: clamp(w, 1 − inf, 1 + inf)
= w, min(w, inf) = w, min(ℓoss, inf·|A|) = ℓoss.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Tuple

CLIP, CISPO, REINFORCE, SAPO, DPPO_TV, DPPO_KL, DRO, TOPR = 0, 1, 2, 3, 4, 5, 6, 9  # objective
# Clip-Cov and KL-Cov: CLIP with the per-token `chosen` of `covariance_choice` (kernels/__init__.py)
CLIP_COV, KL_COV = 7, 8
CHOOSE_CLIP_COV, CHOOSE_KL_COV = 0, 1  # covariance_choice's objective
KL_NONE, KL_K1, KL_K2, KL_K3, KL_ABS, KL_LOW_VAR_KL_PLUS = 0, 1, 2, 3, 4, 5  # KL_NONE: no KL term in the loss
LOW_VAR_KL_BOUND = 10.0  # verl's low_var_kl clamps its k3 to ±10
NUM_STATS = 7  # columns of `stats`, in this order:
STATS = ("loss", "clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy")

# The kernel ops that evaluate an entry (kernels/__init__.py)
FWD, LOSS = "policy_token_fwd", "policy_token_loss"


@dataclasses.dataclass(frozen=True)
class Param:
    """One scalar of the packed parameters: accepted when > low (≥ low unless strict), +inf only if inf_ok."""
    name: str
    low: float
    strict: bool
    inf_ok: bool
    default: float
    field: str  # the PolicyLossConfig field it comes from (ops/kernel_params.py; None there: `default`)


INF = math.inf
# The packed layout, in order. objective, kl_estimator and kl_bias_correction are small integers as floats.
PARAMS: Tuple[Param, ...] = (
    Param("objective", 0, False, False, CLIP, "objective"),
    Param("clip_low", 0, False, True, INF, "clip_low"),
    # > −1: CISPO's cap 1 + clip_high may be below 1 (TRL's ε_high < 1); PolicyLossConfig says where.
    Param("clip_high", -1, True, True, INF, "clip_high"),
    Param("delta", 0, True, True, INF, "delta"),  # any δ > 0, as TRL
    Param("dual_clip", 1, True, True, INF, "dual_clip"),
    Param("kl_estimator", 0, False, False, KL_NONE, "kl_estimator"),
    Param("kl_coef", 0, False, False, 0.0, "kl_coef"),
    Param("kl_clamp", 0, True, True, INF, "kl_clamp"),
    Param("kl_bias_correction", 0, False, False, 0, "kl_bias_correction"),
    Param("entropy_coef", -INF, True, False, 0.0, "entropy_coef"),
    Param("log_ratio_clamp", 0, True, True, 20.0, "log_ratio_clamp"),
    Param("sapo_tau_pos", 0, True, False, 1.0, "sapo_tau_pos"),
    Param("sapo_tau_neg", 0, True, False, 1.0, "sapo_tau_neg"),
    Param("ratio_cap", 0, True, True, INF, "ratio_cap"),
    Param("dro_beta", 0, False, False, 0.0, "dro_beta"),
)
OFFSET = {p.name: i for i, p in enumerate(PARAMS)}
NUM_PARAMS = len(PARAMS)


@dataclasses.dataclass(frozen=True)
class Entry:
    """An objective or KL estimator: its config name, kernel id, the PARAMS it reads and the ops that evaluate it."""
    name: str
    id: int
    params: Tuple[str, ...]
    ops: Tuple[str, ...] = (FWD, LOSS)


_RATIO = ("log_ratio_clamp",)
OBJECTIVES: Tuple[Entry, ...] = (
    Entry("clip", CLIP, _RATIO + ("clip_low", "clip_high", "delta", "dual_clip")),
    Entry("cispo", CISPO, _RATIO + ("clip_low", "clip_high")),
    Entry("reinforce", REINFORCE, ()),
    Entry("sapo", SAPO, _RATIO + ("sapo_tau_pos", "sapo_tau_neg")),
    Entry("dppo_tv", DPPO_TV, _RATIO + ("clip_low", "clip_high", "ratio_cap")),
    Entry("dppo_kl", DPPO_KL, _RATIO + ("clip_low", "clip_high", "ratio_cap")),
    Entry("dro", DRO, ("dro_beta",)),
    Entry("topr", TOPR, _RATIO),
    # the tokens of `covariance_choice` first (ops/_covariance_step.py), so never in the forward kernel
    Entry("clip_cov", CLIP_COV, _RATIO + ("clip_low", "clip_high", "delta", "dual_clip"), (LOSS,)),
    Entry("kl_cov", KL_COV, _RATIO, (LOSS,)),
)
_KL = ("kl_coef", "kl_clamp", "kl_bias_correction", "log_ratio_clamp")
KL_ESTIMATORS: Tuple[Entry, ...] = (
    Entry("k1", KL_K1, _KL),
    Entry("k2", KL_K2, _KL),
    Entry("k3", KL_K3, _KL),
    # verl's: Δ unclamped (abs), or only in the value (low_var_kl+, whose gradient is that of ½(ℓ − ℓ_ref)²)
    Entry("abs", KL_ABS, _KL),
    Entry("low_var_kl+", KL_LOW_VAR_KL_PLUS, _KL),
)


@dataclasses.dataclass(frozen=True)
class TokenLossParams:
    objective: int  # an OBJECTIVES id
    clip_low: float  # the ratio's lower bound is 1 − clip_low (inf: none); DPPO: the divergence bound for A < 0
    clip_high: float  # upper bound 1 + clip_high (inf: none); DPPO: the divergence bound for A > 0
    delta: float  # unclipped branch uses min(w, delta) (inf: none)
    dual_clip: float  # for A < 0 the loss is min(ℓoss, −dual_clip·A) (inf: none)
    kl_estimator: int  # KL_NONE or a KL_ESTIMATORS id; the estimator of the KL *loss* term
    kl_coef: float  # β (0 with KL_NONE)
    kl_clamp: float  # the KL term is clamped to [−kl_clamp, kl_clamp] (inf: none)
    kl_bias_correction: bool  # the KL term times the clamped ratio w (differentiated through w too)
    entropy_coef: float  # c_H: ℓoss −= c_H·H
    log_ratio_clamp: float  # c: log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are clamped to [−c, c]
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where A > 0
    sapo_tau_neg: float = 1.0  # and where A ≤ 0
    ratio_cap: float = math.inf  # DPPO's weight is min(w, ratio_cap) (inf: none)
    dro_beta: float = 0.0  # DRO's β

    def packed(self) -> Tuple[float, ...]:
        """The one argument of the kernel ops: every field as a float, in the order of PARAMS."""
        return tuple(float(getattr(self, p.name)) for p in PARAMS)


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
