"""The presets of docs/math.md §9. Each returns a `PolicyLossConfig`; any field can be overridden."""
from __future__ import annotations

from .config import PolicyLossConfig

# Sequence-level ratios give one surrogate per row; rows are averaged (docs/math.md §5, §8).
_PER_ROW = "seq_mean_token_mean"

_PRESETS = {
    "ppo": dict(ratio="token", objective="clip", clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token_mean"),
    "grpo": dict(ratio="token", objective="clip", clip_low=0.2, clip_high=0.2, kl_estimator="k3", kl_coef=0.04,
                 agg="seq_mean_token_mean"),
    "dr_grpo": dict(ratio="token", objective="clip", clip_low=0.2, clip_high=0.2, agg="constant"),
    "dapo": dict(ratio="token", objective="clip", clip_low=0.2, clip_high=0.28, agg="token_mean"),
    "gspo": dict(ratio="sequence", objective="clip", clip_low=3e-4, clip_high=4e-4, agg=_PER_ROW),
    "gspo_token": dict(ratio="sequence_token", objective="clip", clip_low=3e-4, clip_high=4e-4,
                       agg="seq_mean_token_mean"),
    "fspo": dict(ratio="sequence_sum", objective="clip", fspo_c_low=0.03, fspo_c_high=0.03, agg=_PER_ROW),
    "gepo": dict(ratio="group_expectation", objective="clip", clip_low=0.2, clip_high=0.2, agg=_PER_ROW),
    "cispo": dict(ratio="token", objective="cispo", clip_low=None, clip_high=4.0, agg="token_mean"),
    "gmpo": dict(ratio="geometric", objective="clip", clip_low=0.4, clip_high=0.4, agg=_PER_ROW),
    "snis": dict(ratio="snis", objective="reinforce", agg=_PER_ROW),
}

NAMES = tuple(_PRESETS)


def get(name: str, **overrides) -> PolicyLossConfig:
    """The preset called `name` with `overrides` applied."""
    if name not in _PRESETS:
        raise ValueError(f"preset: expected one of {NAMES}, got {name!r}")
    unknown = set(overrides) - {f.name for f in PolicyLossConfig.__dataclass_fields__.values()}
    if unknown:
        raise ValueError(f"overrides: unknown PolicyLossConfig fields {sorted(unknown)}")
    return PolicyLossConfig(**{**_PRESETS[name], **overrides})


def _preset(name):
    def make(**overrides) -> PolicyLossConfig:
        return get(name, **overrides)

    make.__name__ = name
    make.__doc__ = f"The `{name}` preset (docs/math.md §9, Presets): {_PRESETS[name]}."
    return make


ppo = _preset("ppo")
grpo = _preset("grpo")
dr_grpo = _preset("dr_grpo")
dapo = _preset("dapo")
gspo = _preset("gspo")
gspo_token = _preset("gspo_token")
fspo = _preset("fspo")
gepo = _preset("gepo")
cispo = _preset("cispo")
gmpo = _preset("gmpo")
snis = _preset("snis")
