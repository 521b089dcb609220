"""The presets of docs/math.md §9. Each returns a `PolicyLossConfig`; any field can be overridden."""
from __future__ import annotations

from .config import PolicyLossConfig

# Sequence-level ratios give one surrogate per row; rows are averaged (docs/math.md §5, §8).
_PER_ROW = "seq_mean_token_mean"

_PRESETS = {
    "ppo": dict(ratio="token", objective="clip", clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token_mean"),
    "grpo": dict(ratio="token", objective="clip", clip_low=0.2, clip_high=0.2, kl_estimator="k3", kl_coef=0.04,
                 agg="seq_mean_token_mean"),
    # Dr. GRPO divides by a constant: `norm_length` (the maximum completion length) has no default.
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
    # Added after the first eleven (the order of NAMES is stable; new presets are appended).
    "gpg": dict(ratio="token", objective="reinforce", agg="token_mean"),
    "sapo": dict(ratio="token", objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, agg="seq_mean_token_mean"),
    "dppo_tv": dict(ratio="token", objective="dppo_tv", clip_low=0.15, clip_high=0.15, agg="token_mean"),
    "dppo_kl": dict(ratio="token", objective="dppo_kl", clip_low=0.05, clip_high=0.05, agg="token_mean"),
    "clip_cov": dict(ratio="token", objective="clip_cov", clip_low=0.2, clip_high=0.2, clip_cov_ratio=2e-4,
                     clip_cov_lb=1.0, clip_cov_ub=5.0, agg="token_mean"),
    "kl_cov": dict(ratio="token", objective="kl_cov", kl_cov_ratio=2e-4, kl_cov_coef=0.1, agg="token_mean"),
    "dro": dict(ratio="token", objective="dro", dro_beta=0.1, agg="token_mean"),
    "luspo": dict(ratio="sequence", objective="clip", clip_low=3e-4, clip_high=4e-4, agg="seq_mean_token_sum"),
    "vespo": dict(ratio="sequence_sum", objective="vespo", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                  vespo_lambda_neg=2.0, agg="token_mean"),
    "topr": dict(ratio="token", objective="topr", clip_low=None, clip_high=None, agg="token_mean"),
    # Klear-Reasoner's run: DAPO's clip-higher bounds, verl's dual clip at 10, β₁ = β₂ = 1
    "gppo": dict(ratio="token", objective="gppo", clip_low=0.2, clip_high=0.28, dual_clip=10.0, gppo_beta_low=1.0,
                 gppo_beta_high=1.0, agg="token_mean"),
}

NAMES = tuple(_PRESETS)
_BUILT_IN = frozenset(_PRESETS)


def fields(name: str) -> dict:
    """The fields preset `name` sets (a copy; the others keep `PolicyLossConfig`'s defaults)."""
    if name not in _PRESETS:
        raise ValueError(f"preset: expected one of {NAMES}, got {name!r}")
    return dict(_PRESETS[name])


def get(name: str, **overrides) -> PolicyLossConfig:
    """The preset called `name` with `overrides` applied."""
    merged = {**fields(name), **overrides}
    unknown = set(overrides) - {f.name for f in PolicyLossConfig.__dataclass_fields__.values()}
    if unknown:
        raise ValueError(f"overrides: unknown PolicyLossConfig fields {sorted(unknown)}")
    if merged.get("agg") == "constant" and merged.get("norm_length") is None:
        raise ValueError(
            f"norm_length: the {name!r} preset divides the summed loss by a constant length (Dr. GRPO) and has no "
            f"default; pass the maximum completion length, e.g. presets.{name}(norm_length=max_completion_length)"
        )
    return PolicyLossConfig(**merged)


def register(name: str, *, replace: bool = False, **preset_fields) -> None:
    """Add preset `name` with these `PolicyLossConfig` fields (a user's, say for an objective of
    `register_objective`); it joins `NAMES`, so the trainer and the verl adapter offer it. Validated now."""
    global NAMES
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected an identifier, got {name!r}")
    if name in _PRESETS and (not replace or name in _BUILT_IN):
        raise ValueError(f"name: preset {name!r} exists" + (" (a built-in)" if name in _BUILT_IN else
                                                             "; pass replace=True to replace it"))
    # validated as a config (a Dr. GRPO-like preset leaves norm_length to its caller, as `get` says)
    PolicyLossConfig(**{**preset_fields, **({"norm_length": 1} if preset_fields.get("agg") == "constant" else {})})
    _PRESETS[name] = dict(preset_fields)
    NAMES = tuple(_PRESETS)


def unregister(name: str) -> None:
    """Remove a user's preset."""
    global NAMES
    if name in _BUILT_IN or name not in _PRESETS:
        raise ValueError(f"name: expected a registered user preset, got {name!r}")
    del _PRESETS[name]
    NAMES = tuple(_PRESETS)


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
gpg = _preset("gpg")
sapo = _preset("sapo")
dppo_tv = _preset("dppo_tv")
dppo_kl = _preset("dppo_kl")
clip_cov = _preset("clip_cov")
kl_cov = _preset("kl_cov")
dro = _preset("dro")
luspo = _preset("luspo")
vespo = _preset("vespo")
topr = _preset("topr")
gppo = _preset("gppo")
