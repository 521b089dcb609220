"""The table of the per-token objectives, KL estimators and parameters that the fused kernels evaluate (docs/math.md).

Each is declared here once. An objective or estimator: its config name, kernel id, the parameters it reads and
the kernel ops that evaluate it. A parameter: its name, meaning, range, kernel default and config field. The
kernels take the parameters packed, in the order of `PARAMS`; `kernels/token_loss_params.py` derives from this
table the Python record, the offsets and the Triton constants at import, and writes the C++ header
(`python -m rlkernels.kernels.gen_token_loss_header`). `PolicyLossConfig` checks its fields of the parameters'
names against the same ranges (`losses/config.py`). Kernels and losses do not know each other; both may read
this shared helper (docs/design.md §1).

"No bound" is +inf, so every kernel runs the same branch-free formula: clamp(w, 1 − inf, 1 + inf) = w,
min(w, inf) = w, min(ℓoss, inf·|A|) = ℓoss.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Tuple

CLIP, CISPO, REINFORCE, SAPO, DPPO_TV, DPPO_KL, DRO, TOPR, GPPO = 0, 1, 2, 3, 4, 5, 6, 9, 10  # objective
# Clip-Cov and KL-Cov: CLIP with the per-token `chosen` of `covariance_choice` (kernels/__init__.py)
CLIP_COV, KL_COV = 7, 8
CHOOSE_CLIP_COV, CHOOSE_KL_COV = 0, 1  # covariance_choice's objective
KL_NONE, KL_K1, KL_K2, KL_K3, KL_ABS, KL_LOW_VAR_KL_PLUS = 0, 1, 2, 3, 4, 5  # KL_NONE: no KL term in the loss
LOW_VAR_KL_BOUND = 10.0  # verl's low_var_kl clamps its k3 to ±10
STATS = ("loss", "clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy")  # the columns of `stats`

# The kernel ops that evaluate an entry (kernels/__init__.py)
FWD, LOSS = "policy_token_fwd", "policy_token_loss"

INF = math.inf
REAL, BOOL, OBJECTIVE_ID, KL_ESTIMATOR_ID = "real", "bool", "objective id", "kl_estimator id"  # Param.kind


@dataclasses.dataclass(frozen=True)
class Param:
    """One scalar of the packed parameters: a real accepted when > low (≥ low unless strict), +inf only if inf_ok;
    or a bool or an id (an integer below the count of its table), packed as a float."""
    name: str
    doc: str  # what it is: the comment of its field in the C++ struct and the Python record
    default: float  # the kernels' value where the config field is None
    field: str  # the PolicyLossConfig field it comes from (ops/kernel_params.py)
    low: float = 0.0
    strict: bool = False
    inf_ok: bool = False
    kind: str = REAL


# The packed layout, in order.
PARAMS: Tuple[Param, ...] = (
    Param("objective", "an OBJECTIVES id", CLIP, "objective", kind=OBJECTIVE_ID),
    Param("clip_low", "the ratio's lower bound is 1 − clip_low (inf: none); DPPO: the divergence bound for A < 0",
          INF, "clip_low", 0, False, True),
    # > −1: CISPO's cap 1 + clip_high may be below 1 (TRL's ε_high < 1); PolicyLossConfig says where.
    Param("clip_high", "upper bound 1 + clip_high (inf: none); DPPO: the divergence bound for A > 0",
          INF, "clip_high", -1, True, True),
    Param("delta", "the unclipped branch uses min(w, delta) (inf: none); any δ > 0, as TRL", INF, "delta", 0, True, True),
    Param("dual_clip", "for A < 0 the loss is min(ℓoss, −dual_clip·A) (inf: none)", INF, "dual_clip", 1, True, True),
    Param("kl_estimator", "KL_NONE or a KL_ESTIMATORS id: the estimator of the KL loss term", KL_NONE,
          "kl_estimator", kind=KL_ESTIMATOR_ID),
    Param("kl_coef", "β ≥ 0 of the KL term (0 without one)", 0.0, "kl_coef"),
    Param("kl_clamp", "the KL term is clamped to [−kl_clamp, kl_clamp] (inf: none)", INF, "kl_clamp", 0, True, True),
    Param("kl_bias_correction", "the KL term times the clamped ratio w (differentiated through w too)", 0,
          "kl_bias_correction", kind=BOOL),
    Param("entropy_coef", "c_H: ℓoss −= c_H·H", 0.0, "entropy_coef", -INF, True, False),
    Param("log_ratio_clamp", "c: log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are clamped to [−c, c]", 20.0,
          "log_ratio_clamp", 0, True, True),
    Param("sapo_tau_pos", "SAPO's gate temperature τ where A > 0", 1.0, "sapo_tau_pos", 0, True, False),
    Param("sapo_tau_neg", "and where A ≤ 0", 1.0, "sapo_tau_neg", 0, True, False),
    Param("ratio_cap", "DPPO's weight is min(w, ratio_cap) (inf: none)", INF, "ratio_cap", 0, True, True),
    Param("dro_beta", "DRO's β of the ½β(ℓ − ℓ_old)² penalty", 0.0, "dro_beta", 0, False, False),
    Param("gppo_beta_low", "GPPO's β₁: a token the clip holds below (w < 1 − clip_low, A < 0) is "
          "−β₁·(1 − clip_low)·A·w/sg(w)", 1.0, "gppo_beta_low", 0, True, False),
    Param("gppo_beta_high", "GPPO's β₂: above (w > 1 + clip_high, A > 0), −β₂·(1 + clip_high)·A·w/sg(w)", 1.0,
          "gppo_beta_high", 0, True, False),
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """An objective or KL estimator: its config name, kernel id, the PARAMS it reads and the ops that evaluate it."""
    name: str
    id: int
    params: Tuple[str, ...]
    ops: Tuple[str, ...] = (FWD, LOSS)
    doc: str = ""  # a note (the comment of its C++ enumerator)


_RATIO = ("log_ratio_clamp",)
_CLIP = _RATIO + ("clip_low", "clip_high", "delta", "dual_clip")
OBJECTIVES: Tuple[Entry, ...] = (
    Entry("clip", CLIP, _CLIP),
    Entry("cispo", CISPO, _RATIO + ("clip_low", "clip_high")),
    Entry("reinforce", REINFORCE, ()),
    Entry("sapo", SAPO, _RATIO + ("sapo_tau_pos", "sapo_tau_neg")),
    Entry("dppo_tv", DPPO_TV, _RATIO + ("clip_low", "clip_high", "ratio_cap")),
    Entry("dppo_kl", DPPO_KL, _RATIO + ("clip_low", "clip_high", "ratio_cap")),
    Entry("dro", DRO, ("dro_beta",)),
    Entry("topr", TOPR, _RATIO),
    # the tokens of `covariance_choice` first (ops/_covariance_step.py), so never in the forward kernel
    Entry("clip_cov", CLIP_COV, _CLIP, (LOSS,), "kClip, and a chosen token has loss 0 and counts as clipped on A's side"),
    Entry("kl_cov", KL_COV, _RATIO, (LOSS,), "kClip without bounds (−A·w), plus chosen·|ℓ − ℓ_old| on a chosen token"),
    Entry("gppo", GPPO, _RATIO + ("clip_low", "clip_high", "dual_clip", "gppo_beta_low", "gppo_beta_high"),
          doc="kClip, but a token the clip holds keeps a gradient"),
)
_KL = ("kl_coef", "kl_clamp", "kl_bias_correction", "log_ratio_clamp")
KL_ESTIMATORS: Tuple[Entry, ...] = (
    Entry("k1", KL_K1, _KL),
    Entry("k2", KL_K2, _KL),
    Entry("k3", KL_K3, _KL),
    Entry("abs", KL_ABS, _KL, doc="verl's abs: |Δ| of the unclamped Δ"),
    Entry("low_var_kl+", KL_LOW_VAR_KL_PLUS, _KL,
          doc="verl's low_var_kl+: the value clamp(k3(Δ_c), ±10), the gradient of ½(ℓ − ℓ_ref)²"),
)
