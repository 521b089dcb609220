"""One config type for every policy objective of docs/math.md §4-§9, validated on construction."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

RATIOS = ("token", "sequence", "sequence_token", "sequence_sum", "group_expectation", "geometric", "snis")
# Ratios that produce one importance weight per row: one advantage per row (docs/math.md §5).
SEQUENCE_RATIOS = ("sequence", "sequence_sum", "group_expectation", "geometric", "snis")
OBJECTIVES = ("clip", "cispo", "reinforce")
KL_ESTIMATORS = (None, "k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")

# Which surrogate each ratio can feed (docs/math.md, "Surrogates").
_VALID_OBJECTIVES = {
    "token": ("clip", "cispo", "reinforce"),
    "sequence": ("clip",),
    "sequence_token": ("clip",),
    "sequence_sum": ("clip",),
    "group_expectation": ("clip",),
    "geometric": ("clip",),
    "snis": ("reinforce",),
}
# delta / dual_clip act on a ratio clipped in ratio space, not on the log-space clips.
_RATIO_SPACE_CLIP = ("token", "sequence", "sequence_token", "group_expectation")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Hyperparameters of a policy loss; see docs/math.md §4-§9 and `rlkernels.presets`."""

    ratio: str = "token"
    objective: str = "clip"
    clip_low: Optional[float] = 0.2
    clip_high: Optional[float] = 0.2
    delta: Optional[float] = None
    dual_clip: Optional[float] = None
    fspo_c_low: float = 0.03
    fspo_c_high: float = 0.03
    kl_estimator: Optional[str] = None
    kl_coef: float = 0.0
    kl_clamp: Optional[float] = None
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    agg: str = "token_mean"
    norm_length: Optional[int] = None
    log_ratio_clamp: float = 20.0
    group_size: Optional[int] = None

    def __post_init__(self):
        _choice("ratio", self.ratio, RATIOS)
        _choice("objective", self.objective, OBJECTIVES)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("agg", self.agg, AGGREGATIONS)
        if self.objective not in _VALID_OBJECTIVES[self.ratio]:
            raise ValueError(
                f"objective: {self.objective!r} cannot be used with ratio={self.ratio!r}; "
                f"expected one of {_VALID_OBJECTIVES[self.ratio]}"
            )
        _number("clip_low", self.clip_low, low=0.0, optional=self.objective == "cispo")
        _number("clip_high", self.clip_high, low=0.0, optional=self.objective == "cispo")
        if self.ratio in _RATIO_SPACE_CLIP and self.clip_low is not None and self.clip_low >= 1:
            raise ValueError(f"clip_low: expected a value in [0, 1) for a ratio-space clip, got {self.clip_low}")
        for name in ("delta", "dual_clip"):
            value = getattr(self, name)
            if value is None:
                continue
            _number(name, value, low=1.0, strict=True)
            if self.objective != "clip" or self.ratio not in _RATIO_SPACE_CLIP:
                raise ValueError(
                    f"{name}: only valid with objective='clip' and ratio in {_RATIO_SPACE_CLIP}, "
                    f"got objective={self.objective!r}, ratio={self.ratio!r}"
                )
        _number("fspo_c_low", self.fspo_c_low, low=0.0)
        _number("fspo_c_high", self.fspo_c_high, low=0.0)
        _number("kl_coef", self.kl_coef, low=0.0)
        if self.kl_coef > 0 and self.kl_estimator is None:
            raise ValueError("kl_estimator: kl_coef > 0 needs an estimator ('k1', 'k2' or 'k3'), got None")
        _number("kl_clamp", self.kl_clamp, low=0.0, strict=True, optional=True)
        if not isinstance(self.kl_bias_correction, bool):
            raise TypeError(f"kl_bias_correction: expected a bool, got {type(self.kl_bias_correction).__name__}")
        _number("entropy_coef", self.entropy_coef)
        _integer("norm_length", self.norm_length, optional=True)
        _number("log_ratio_clamp", self.log_ratio_clamp, low=0.0, strict=True)
        _integer("group_size", self.group_size, optional=True)

    def replace(self, **overrides) -> "PolicyLossConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **overrides)


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


def _number(name, value, *, low=None, strict=False, optional=False):
    if value is None:
        if optional:
            return
        raise ValueError(f"{name}: expected a number, got None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name}: expected a value {'>' if strict else '>='} {low}, got {value}")


def _integer(name, value, *, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
