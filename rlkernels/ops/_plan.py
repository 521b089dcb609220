"""Which step evaluates a config's loss with a backend's kernels: the one decision, made in `plan`.

* FORWARD: `policy_token_fwd` evaluates the loss in the pass over the logits (a token-level config whose
  every term is per token).
* SEQUENCE: the pass gives ℓ and H, then `_sequence_step` with `policy_token_loss` (sequence-level ratios,
  and token-level configs whose surrogate weights need ℓ or H first).
* COVARIANCE: the pass gives ℓ and H, then `_covariance_step` (Clip-Cov, KL-Cov).
* AUTOGRAD: the pass gives ℓ and H, then the `(B, T)` loss of `losses/` and its autograd.

`plan` decides, from the table of `kernels.token_loss_params` and the backend's `supports`, and never warns;
the fused ops call `warn_general_path` with its result.
"""
from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Optional

from ..kernels import Kernels
from ..kernels.token_loss_params import FWD, KL_ESTIMATORS, OBJECTIVES
from ..losses import PolicyLossConfig
from ..losses.spec import objectives
from ._sequence_step import takes as sequence_step_takes

# the forward kernel's objectives and the kernels' KL estimators, by their config names (the table)
_FORWARD_OBJECTIVES = frozenset(e.name for e in OBJECTIVES if FWD in e.ops)
_KL = frozenset(e.name for e in KL_ESTIMATORS)


class Step(enum.Enum):
    FORWARD = "forward"
    SEQUENCE = "sequence"
    COVARIANCE = "covariance"
    AUTOGRAD = "autograd"


@dataclasses.dataclass(frozen=True)
class Plan:
    step: Step
    # for a token-level config on AUTOGRAD: what the kernels lack ("objective='x' with off_policy_mask", ...)
    lacking: Optional[str] = None


def plan(config: PolicyLossConfig, kernels: Kernels, forward: bool = True) -> Plan:
    """The step that evaluates `config` with backend `kernels`; `forward=False` where the pass over the logits
    cannot run `policy_token_fwd` (a vocabulary-sharded head)."""
    if forward and kernels.supports("policy_token_fwd") is None and kernel_supports(config):
        return Plan(Step.FORWARD)
    if kernels.supports("policy_token_loss") is None and _kernel_terms(config) and (
            sequence_step_takes(config) or _token_objective(config)):
        return Plan(Step.SEQUENCE)
    if kernels.supports("covariance_choice") is None and _covariance(config):
        return Plan(Step.COVARIANCE)
    # a plug-in objective has no kernel entry by design: nothing to warn about
    plugin = objectives.get(config.objective).plugin
    return Plan(Step.AUTOGRAD, _lacking(config) if config.ratio == "token" and not plugin else None)


def kernel_supports(config: PolicyLossConfig) -> bool:
    """Whether the forward kernel evaluates this config's loss itself (every term of it is per token;
    the off-policy and entropy masks need row means or quantiles of the kernel's outputs first)."""
    return (_token_objective(config) and config.off_policy_mask is None and config.top_entropy_quantile is None
            and _kernel_terms(config))


def _token_objective(config: PolicyLossConfig) -> bool:
    """The config's surrogate is one of the forward kernel's objectives at the token's own ratio."""
    return config.ratio == "token" and config.objective in _FORWARD_OBJECTIVES


def _covariance(config: PolicyLossConfig) -> bool:
    """`_covariance_step` evaluates this config (Clip-Cov, KL-Cov) with `policy_token_loss`."""
    return (config.ratio == "token" and objectives.get(config.objective).chooses_tokens
            and config.off_policy_mask is None
            and config.top_entropy_quantile is None and _kernel_terms(config))


def _kernel_terms(config: PolicyLossConfig) -> bool:
    """The kernels' parameters express the config's KL term: none, or one of the table's estimators times at
    most the token's own ratio (other estimators and a KL times the row's ratio take the general path)."""
    return config.kl_coef == 0 or (config.kl_estimator in _KL and not _row_bias_correction(config))


def _row_bias_correction(config: PolicyLossConfig) -> bool:
    """A KL term times its row's sequence ratio: it couples the row's tokens, which no per-token formula has."""
    return config.kl_bias_correction and config.kl_bias_ratio == "sequence" and config.kl_coef > 0


def _lacking(config: PolicyLossConfig) -> str:
    masks = [name for name in ("off_policy_mask", "top_entropy_quantile") if getattr(config, name) is not None]
    masks += ["kl_bias_ratio='sequence'"] if _row_bias_correction(config) else []
    masks += [f"kl_estimator={config.kl_estimator!r}"] if config.kl_coef > 0 and config.kl_estimator not in _KL else []
    return f"objective={config.objective!r}" + "".join(f" with {name}" for name in masks)


_warned = set()


def warn_general_path(p: Plan, backend: str) -> None:
    """Say once per (backend, what) that a compiled backend leaves a token-level loss to autograd (a new objective
    its kernels do not implement yet): same values, more launches."""
    key = (backend, p.lacking)
    if p.lacking is None or backend == "torch" or key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"the {backend} kernels do not evaluate {p.lacking} yet; using the general path (same values, "
                  "more launches)")
