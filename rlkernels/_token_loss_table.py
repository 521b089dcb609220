"""The table of the per-token objectives, KL estimators and parameters that the fused kernels evaluate (docs/math.md).

Each is declared here once. An objective or estimator: its config name, kernel id, the parameters it reads, the ops
that evaluate it and its formula (the kernel contract, `kernels/__init__.py`). A parameter: its name, meaning, range,
kernel default and config field with its default. The kernels take the parameters packed, in the order of `PARAMS`;
`kernels/token_loss_params.py` derives from this table the ids' names, the Python record, the offsets and the Triton
constants at import, and writes the C++ header (`python -m rlkernels.kernels.gen_token_loss_header`).
`PolicyLossConfig`'s fields of the parameters are made from it at import, with their defaults, docs and ranges
(`losses/config.py`). Kernels and losses do not know each other; both may read this shared helper (docs/design.md §1).

"No bound" is +inf, so every kernel runs the same branch-free formula: clamp(w, 1 − inf, 1 + inf) = w,
min(w, inf) = w, min(ℓoss, inf·|A|) = ℓoss.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Tuple

CHOOSE_CLIP_COV, CHOOSE_KL_COV = 0, 1  # covariance_choice's objective
KL_NONE = 0  # no KL term in the loss; the KL estimators' ids are theirs in KL_ESTIMATORS
LOW_VAR_KL_BOUND = 10.0  # verl's low_var_kl clamps its k3 to ±10
STATS = ("loss", "clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy")  # the columns of `stats`

# The kernel ops that evaluate an entry (kernels/__init__.py)
FWD, LOSS = "policy_token_fwd", "policy_token_loss"

INF = math.inf
REAL, BOOL, OBJECTIVE_ID, KL_ESTIMATOR_ID = "real", "bool", "objective id", "kl_estimator id"  # Param.kind
KERNEL_DEFAULT = "the kernels' default"  # Param.config_default: the config's default is the kernels' (or None)


@dataclasses.dataclass(frozen=True)
class Param:
    """One scalar of the packed parameters: a real accepted when > low (≥ low unless strict), +inf only if inf_ok;
    or a bool or an id (an integer below the count of its table), packed as a float. Its `PolicyLossConfig` field
    `field` holds a real, a bool or the entry's name, None only if `optional` (then the kernels' default: for a
    bound, none), and defaults to `config_default`."""
    name: str
    doc: str  # what it is: the comment of its field in the C++ struct, the Python record and the config
    default: float  # the kernels' value where the config field is None
    field: str  # the PolicyLossConfig field it comes from (ops/kernel_params.py)
    low: float = 0.0
    strict: bool = False
    inf_ok: bool = False
    kind: str = REAL
    optional: bool = False
    config_default: object = KERNEL_DEFAULT  # KERNEL_DEFAULT: None where optional, else `default`

    @property
    def field_default(self):
        """The config field's default."""
        if self.config_default != KERNEL_DEFAULT:
            return self.config_default
        return None if self.optional else bool(self.default) if self.kind == BOOL else float(self.default)


_BOUND = dict(inf_ok=True, optional=True)  # a bound: +inf or None is none
# The packed layout, in order.
PARAMS: Tuple[Param, ...] = (
    Param("objective", "an OBJECTIVES id (the config: its name, or a plug-in's of losses/objectives.py)", 0,
          "objective", kind=OBJECTIVE_ID, config_default="clip"),
    Param("clip_low", "the ratio's lower bound is 1 − clip_low (inf: none); DPPO: the divergence bound for A < 0",
          INF, "clip_low", 0, **_BOUND, config_default=0.2),
    # > −1: CISPO's cap 1 + clip_high may be below 1 (TRL's ε_high < 1); PolicyLossConfig says where.
    Param("clip_high", "upper bound 1 + clip_high (inf: none); DPPO: the divergence bound for A > 0",
          INF, "clip_high", -1, True, **_BOUND, config_default=0.2),
    Param("delta", "the unclipped branch uses min(w, delta) (inf: none); any δ > 0, as TRL", INF, "delta", 0, True,
          **_BOUND),
    Param("dual_clip", "for A < 0 the loss is min(ℓoss, −dual_clip·A) (inf: none)", INF, "dual_clip", 1, True,
          **_BOUND),
    Param("kl_estimator", "KL_NONE or a KL_ESTIMATORS id: the estimator of the KL loss term (the config: its name, "
          "or one of verl's that losses/kl.py computes, docs/math.md §6)", KL_NONE, "kl_estimator",
          kind=KL_ESTIMATOR_ID, optional=True),
    Param("kl_coef", "β ≥ 0 of the KL term (0 without one)", 0.0, "kl_coef"),
    Param("kl_clamp", "the KL term is clamped to [−kl_clamp, kl_clamp] (inf: none)", INF, "kl_clamp", 0, True,
          **_BOUND),
    Param("kl_bias_correction", "the KL term times the clamped ratio w (differentiated through w too)", 0,
          "kl_bias_correction", kind=BOOL),
    Param("entropy_coef", "c_H: ℓoss −= c_H·H", 0.0, "entropy_coef", -INF, True, False),
    Param("log_ratio_clamp", "c: log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are clamped to [−c, c]", 20.0,
          "log_ratio_clamp", 0, True, True),
    Param("sapo_tau_pos", "SAPO's gate temperature τ where A > 0", 1.0, "sapo_tau_pos", 0, True, False),
    Param("sapo_tau_neg", "and where A ≤ 0", 1.0, "sapo_tau_neg", 0, True, False, config_default=1.05),
    Param("ratio_cap", "DPPO's weight is min(w, ratio_cap), truncated IS (inf: none)", INF, "ratio_cap", 0, True,
          **_BOUND),
    Param("dro_beta", "DRO's β of the ½β(ℓ − ℓ_old)² penalty (verl's policy_loss.dro_beta; the config requires it "
          "with objective 'dro')", 0.0, "dro_beta", 0, False, False, optional=True),
    Param("gppo_beta_low", "GPPO's β₁ (Klear-Reasoner's; 1 in its runs): a token the clip holds below "
          "(w < 1 − clip_low, A < 0) is −β₁·(1 − clip_low)·A·w/sg(w)", 1.0, "gppo_beta_low", 0, True, False),
    Param("gppo_beta_high", "GPPO's β₂: above (w > 1 + clip_high, A > 0), −β₂·(1 + clip_high)·A·w/sg(w)", 1.0,
          "gppo_beta_high", 0, True, False),
    Param("spo_eps", "SPO's ε of the |A|/(2ε)·(w − 1)² penalty", 0.2, "spo_eps", 0, True, False),
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """An objective or KL estimator: its config name, kernel id, the PARAMS it reads, the ops that evaluate it and
    its formula (for an objective: the surrogate s and its clip flags, of w = e^clamp(ℓ − ℓ_old, ±c), A and ℓ; the
    derivatives are torch's autograd of losses/, kernels/__init__.py). The kernels name its id by its upper-case
    name (CLIP, KL_K3; token_loss_params.py, the generated header's kClip, kKlK3)."""
    name: str
    id: int
    params: Tuple[str, ...]
    ops: Tuple[str, ...] = (FWD, LOSS)
    doc: str = ""
    # The per-token formula, once: lines `name = expression` defining the surrogate s and the flags flag_low /
    # flag_high, of ℓ (logp), ℓ_old, A (adv), w, d = ℓ − ℓ_old, chosen and the parameters; kernels/derive_token_loss.py
    # says the language. gen_token_loss_header derives ∂s/∂ℓ from it and writes the kernels' branches
    # (triton/token_loss_surrogates.py, token_loss_surrogates.h) and the PyTorch spec (losses/token_formulas.py).
    # A guard is part of the formula: the dual clip's cap −c·A is written with A = −1 where A ≥ 0, as inf·0 would be
    # NaN in the lane `where` does not take.
    formula: str = ""


_RATIO = ("log_ratio_clamp",)
_CLIP = _RATIO + ("clip_low", "clip_high", "delta", "dual_clip")
_DPPO = _RATIO + ("clip_low", "clip_high", "ratio_cap")
_BAND = """
lo = 1 - clip_low
hi = 1 + clip_high
"""
# δ as a clamp (w ≥ 0), not a minimum: at w = δ the whole gradient passes, as TRL's clamp(max=δ); the dual clip's
# minimum halves it at a tie, as torch.minimum (verl's torch.min) does.
_CLIP_FORMULA = _BAND + """
unclipped = -adv*clamp(w, 0, delta)
clipped = -adv*clamp(w, lo, hi)
ppo = maximum(unclipped, clipped)
cap = -dual_clip*where(adv < 0, adv, -1)
clip = where(adv < 0, minimum(ppo, cap), ppo)
held_low = (w < lo) & (adv < 0)
held_high = (w > hi) & (adv > 0)
"""
_DPPO_FORMULA = """
prob = sg(exp(logp))
prob_old = exp(old_logp)
inside = select(adv > 0, inside_pos, inside_neg)
s = -adv*sg(clamp(w, 0, ratio_cap))*logp*mask(inside)
flag_low = ~inside & (adv < 0)
flag_high = ~inside & (adv > 0)
"""
OBJECTIVES: Tuple[Entry, ...] = (
    Entry("clip", 0, _CLIP, doc="u = −A·min(w, δ), k = −A·clamp(w, 1 − ε_low, 1 + ε_high), s = max(u, k), and for "
          "A < 0 s = min(s, −dual_clip·A); clip_low = w < 1 − ε_low and A < 0, clip_high = w > 1 + ε_high and A > 0",
          formula=_CLIP_FORMULA + """
s = clip
flag_low = held_low
flag_high = held_high
"""),
    Entry("cispo", 1, _RATIO + ("clip_low", "clip_high"), doc="s = −clamp(w, 1 − ε_low, 1 + ε_high)·A·ℓ (the "
          "clamped w a constant); clip_low = w < 1 − ε_low, clip_high = w > 1 + ε_high", formula=_BAND + """
weight = sg(clamp(w, lo, hi))
s = -weight*adv*logp
flag_low = w < lo
flag_high = w > hi
"""),
    Entry("reinforce", 2, (), doc="s = −A·ℓ; no flags", formula="s = -adv*logp"),
    Entry("sapo", 3, _RATIO + ("sapo_tau_pos", "sapo_tau_neg"),
          doc="s = −A·σ(τ(w − 1))·4/τ, τ = sapo_tau_pos where A > 0, else sapo_tau_neg; no flags", formula="""
tau = where(adv > 0, sapo_tau_pos, sapo_tau_neg)
gate = sigmoid(tau*(w - 1))
s = -adv*gate*4/tau
"""),
    Entry("dppo_tv", 4, _DPPO, doc="with p = e^ℓ, p_old = e^ℓ_old, a token is inside when A > 0 and p − p_old ≤ "
          "ε_high, or A ≤ 0 and p − p_old ≥ −ε_low; s = −A·min(w, ratio_cap)·ℓ inside (the weight a constant), 0 "
          "outside; clip_low = outside and A < 0, clip_high = outside and A > 0", formula="""
prob = sg(exp(logp))
prob_old = exp(old_logp)
inside_pos = prob - prob_old <= clip_high
inside_neg = prob - prob_old >= -clip_low
""" + _DPPO_FORMULA.replace("prob = sg(exp(logp))\nprob_old = exp(old_logp)\n", "")),
    Entry("dppo_kl", 5, _DPPO, doc="DPPO_TV's, with the divergence D = p_old·(ℓ_old − ℓ) + (1 − p_old)·log((1 − "
          "p_old + 1e-8)/(1 − p + 1e-8)) of the Bernoulli distributions: inside when A > 0 and (D ≤ ε_high or "
          "p ≤ p_old), or A ≤ 0 and (D ≤ ε_low or p ≥ p_old)", formula="""
prob = sg(exp(logp))
prob_old = exp(old_logp)
kl = prob_old*(old_logp - logp) + (1 - prob_old)*log((1 - prob_old + BERNOULLI_EPS)/(1 - prob + BERNOULLI_EPS))
inside_pos = (kl <= clip_high) | (prob <= prob_old)
inside_neg = (kl <= clip_low) | (prob >= prob_old)
""" + _DPPO_FORMULA.replace("prob = sg(exp(logp))\nprob_old = exp(old_logp)\n", "")),
    Entry("dro", 6, ("dro_beta",),
          doc="s = −(A·ℓ − ½β(ℓ − ℓ_old)²), β = dro_beta (the log-ratio unclamped); no flags",
          formula="s = -(adv*logp - dro_beta/2*d**2)"),
    # The tokens of `covariance_choice` come first (ops/_covariance_step.py): a choice over the whole batch (its
    # covariance's means and the top-k or random draw), which no per-token formula can make; these formulas read
    # its outcome, policy_token_loss's `chosen`, so they are never in the forward kernel.
    Entry("clip_cov", 7, _CLIP, (LOSS,), "CLIP, except where chosen ≠ 0: A = 0 in the surrogate (s = 0, no "
          "gradient) and clip_low = A < 0, clip_high = A > 0 (the token counts as clipped on A's side)",
          formula=_CLIP_FORMULA + """
s = where(Ne(chosen, 0), 0, clip)
flag_low = held_low | (Ne(chosen, 0) & (adv < 0))
flag_high = held_high | (Ne(chosen, 0) & (adv > 0))
"""),
    Entry("kl_cov", 8, _RATIO, (LOSS,), "CLIP with every bound inf (s = −A·w), plus chosen·|ℓ − ℓ_old| where "
          "chosen ≠ 0 (the difference unclamped; its derivative sign(ℓ − ℓ_old), 0 at 0)",
          formula="s = -adv*w + where(Ne(chosen, 0), chosen*Abs(d), 0)"),
    Entry("topr", 9, _RATIO, doc="s = −A·ℓ where A ≥ 0, −clamp(w, 0, 1)·A·ℓ where A < 0 (the clamped w a "
          "constant); clip_high = w > 1 and A < 0", formula="""
weight = sg(where(adv < 0, clamp(w, 0, 1), 1))
s = -weight*adv*logp
flag_high = (w > 1) & (adv < 0)
"""),
    Entry("gppo", 10, _RATIO + ("clip_low", "clip_high", "dual_clip", "gppo_beta_low", "gppo_beta_high"),
          doc="CLIP without δ, except that a token the clip holds (CLIP's clip_low or clip_high) has s = "
          "−β·b·A·w/sg(w), b its bound (1 − ε_low, 1 + ε_high), β gppo_beta_low / gppo_beta_high: CLIP's value at "
          "β = 1, the gradient −β·b·A; then the dual clip; CLIP's flags", formula=_BAND + """
held_low = (w < lo) & (adv < 0)
held_high = (w > hi) & (adv > 0)
unclipped = -adv*w
clipped = -adv*clamp(w, lo, hi)
ppo = maximum(unclipped, clipped)
bound = where(held_low, gppo_beta_low*lo, gppo_beta_high*hi)
kept = -adv*bound*w/sg(w)
preserved = where(held_low | held_high, kept, ppo)
cap = -dual_clip*where(adv < 0, adv, -1)
s = where(adv < 0, minimum(preserved, cap), preserved)
flag_low = held_low
flag_high = held_high
"""),
    Entry("spo", 11, _RATIO + ("spo_eps",), doc="SPO (Xie et al., 2025): s = −(A·w − |A|/(2ε)·(w − 1)²), ε = spo_eps; "
          "no flags", formula="s = -(adv*w - Abs(adv)/(2*spo_eps)*(w - 1)**2)"),
)
_KL = ("kl_coef", "kl_clamp", "kl_bias_correction", "log_ratio_clamp")
KL_ESTIMATORS: Tuple[Entry, ...] = (
    Entry("k1", 1, _KL),
    Entry("k2", 2, _KL),
    Entry("k3", 3, _KL),
    Entry("abs", 4, _KL, doc="verl's abs: |Δ| of the unclamped Δ"),
    Entry("low_var_kl+", 5, _KL,
          doc="verl's low_var_kl+: the value clamp(k3(Δ_c), ±10), the gradient of ½(ℓ − ℓ_ref)²"),
)
