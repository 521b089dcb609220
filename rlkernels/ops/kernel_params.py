"""A token-level `PolicyLossConfig` as the parameters of the fused kernels.

Which objectives and KL estimators the kernels have, and their parameters, is the table of
`kernels.token_loss_params` (where +inf means "no bound"); this module fills its `TokenLossParams`
from a config (`ops._plan` decides which configs those parameters express).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..kernels import token_loss_params as k
from ..losses import PolicyLossConfig
from ..losses.spec import separate_entropy_bonus

# the objectives of the forward kernel and the KL estimators, by their config names (kernels.token_loss_params)
_OBJECTIVES = {e.name: e.id for e in k.OBJECTIVES if k.FWD in e.ops}
_KL = {e.name: e.id for e in k.KL_ESTIMATORS}


def _bound(x: Optional[float]) -> float:
    return math.inf if x is None else float(x)


def token_loss_params(config: PolicyLossConfig) -> k.TokenLossParams:
    """The kernels' parameters of a config that `_plan.kernel_supports`."""
    if not (config.ratio == "token" and config.objective in _OBJECTIVES):
        raise ValueError(f"config: the fused kernels evaluate token-level {', '.join(_OBJECTIVES)} losses only, got "
                         f"ratio={config.ratio!r}, objective={config.objective!r}")
    return _params(config, _OBJECTIVES[config.objective], with_token_terms=True)


def token_terms_params(config: PolicyLossConfig, reinforce: bool = False) -> k.TokenLossParams:
    """The KL and entropy terms of any config, for `policy_token_loss` called without advantages (A = 0), or
    with REINFORCE's surrogate −A·ℓ where `reinforce` (SNIS's advantage comes in that call). At A = 0 the
    surrogate is the clip objective without bounds, −A·w: 0, with derivative and clip flags 0, whatever ℓ
    (w = e^clamp(ℓ − ℓ_old) is finite); REINFORCE's −A·ℓ would be 0·(−∞) = NaN at a token of probability 0."""
    if reinforce:
        return _params(config, k.REINFORCE, with_token_terms=True)
    return dataclasses.replace(_params(config, k.CLIP, with_token_terms=True), clip_low=math.inf,
                               clip_high=math.inf, delta=math.inf, dual_clip=math.inf)


def surrogate_params(config: PolicyLossConfig, objective: str) -> k.TokenLossParams:
    """`objective` ("clip" or "reinforce") with the config's clip bounds, and no KL or entropy term."""
    return _params(config, _OBJECTIVES[objective], with_token_terms=False)


def log_band_params(config: PolicyLossConfig, low: float, high: float, log_ratio_clamp: float) -> k.TokenLossParams:
    """PPO's clip objective with the ratio band [e^−low, e^high] and nothing else (no delta, dual clip, KL or
    entropy term): −A·e^min(r, high) for A > 0, |A|·e^max(r, −low) for A < 0, r = clamp(x − x_old) at
    `log_ratio_clamp`. A clip in log space (GMPO's per token; FSPO's per row, shifted to the band's edge)."""
    return dataclasses.replace(_params(config, k.CLIP, with_token_terms=False), clip_low=-math.expm1(-low),
                               clip_high=_expm1_or_inf(high), delta=math.inf, dual_clip=math.inf,
                               log_ratio_clamp=float(log_ratio_clamp))


def _expm1_or_inf(x: float) -> float:
    """e^x − 1, or +inf (no bound) where a double overflows (x > 709.78: GMPO's clip_high is not capped), as
    torch's exp gives."""
    try:
        return math.expm1(x)
    except OverflowError:
        return math.inf


def covariance_params(config: PolicyLossConfig) -> k.TokenLossParams:
    """The per-token loss of Clip-Cov (PPO's clip; a chosen token has A = 0 and counts as clipped) or KL-Cov (−A·w:
    the clip objective without bounds, plus the chosen tokens' penalty), with the KL and entropy terms."""
    params = dataclasses.replace(_params(config, k.CLIP, with_token_terms=True),
                                 objective=k.CLIP_COV if config.objective == "clip_cov" else k.KL_COV)
    if config.objective == "clip_cov":
        return params
    return dataclasses.replace(params, clip_low=math.inf, clip_high=math.inf, delta=math.inf, dual_clip=math.inf)


def covariance_choice_params(config: PolicyLossConfig) -> k.CovarianceChoiceParams:
    """`covariance_choice`'s parameters: Clip-Cov's candidates and k, each chosen token 1 (its surrogate is dropped);
    KL-Cov's k, each chosen token kl_cov_coef (its penalty's coefficient)."""
    clip_cov = config.objective == "clip_cov"
    return k.CovarianceChoiceParams(
        objective=k.CHOOSE_CLIP_COV if clip_cov else k.CHOOSE_KL_COV,
        fraction=float(config.clip_cov_ratio if clip_cov else config.kl_cov_ratio),
        cov_lb=float(config.clip_cov_lb), cov_ub=float(config.clip_cov_ub), clip_low=_bound(config.clip_low),
        clip_high=_bound(config.clip_high), log_ratio_clamp=float(config.log_ratio_clamp),
        scale=1.0 if clip_cov else float(config.kl_cov_coef))


# The parameters each call decides (the objective, and which token terms are in the loss); every other one is its
# config field, None being the table's default ("no bound", or 0 for dro_beta).
_DECIDED = ("objective", "kl_estimator", "kl_coef", "kl_bias_correction", "entropy_coef")


def _params(config: PolicyLossConfig, objective: int, with_token_terms: bool) -> k.TokenLossParams:
    kl_in_loss = config.kl_coef > 0 and with_token_terms
    fields = {p.name: p.default if getattr(config, p.field) is None else float(getattr(config, p.field))
              for p in k.PARAMS if p.name not in _DECIDED}
    return k.TokenLossParams(
        **fields,
        objective=objective,
        kl_estimator=_KL[config.kl_estimator] if kl_in_loss else k.KL_NONE,
        kl_coef=float(config.kl_coef) if kl_in_loss else 0.0,
        kl_bias_correction=bool(config.kl_bias_correction) and kl_in_loss,
        # an entropy bonus aggregated apart from the loss is added outside the kernels (`_loss_step`)
        entropy_coef=float(config.entropy_coef) if with_token_terms and not separate_entropy_bonus(config) else 0.0,
    )
