"""The registry of policy objectives (docs/math.md §5): one `Objective` per name, with its surrogate at each
ratio it takes, what it reads of the config and its presets (§9). `PolicyLossConfig` validates against it,
`policy_loss` evaluates through it, `rlkernels.presets` lists its presets, the docs' lists are checked against it, and
`register_objective` adds a user's objective written in plain PyTorch (docs/design.md, "Adding an objective").

A surrogate is `f(b: Batch, cfg) -> Surrogate` over `(B, T)`; `surrogates.at(weight, f)` evaluates a
ratio-taking `f(w, b, cfg)` at the weight of a ratio, so one function serves every ratio of an objective.
"""
from __future__ import annotations

import dataclasses
import functools
import keyword
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from . import surrogates as s
from . import token_formulas
from .._token_loss_table import OBJECTIVES as _KERNEL_OBJECTIVES
from .batch import Batch

RATIOS = ("token", "sequence", "sequence_token", "sequence_sum", "group_expectation", "geometric", "snis")
# the ratios over a whole prompt group (group_size or group_ids), which a batch must hold whole
GROUPED_RATIOS = ("group_expectation", "snis")
# the ratios a plug-in may take: those whose importance weight is one (B, T) tensor (the others are formulas)
PLUGIN_RATIOS = {"token": s.token_ratio, "sequence": s.sequence_ratio, "sequence_token": s.sequence_token_ratio}
CLIP_KINDS = (None, "ratio", "band", "divergence")


@dataclasses.dataclass(frozen=True)
class Objective:
    """A policy objective.

    `surrogates`: ratio → `f(b, cfg) -> Surrogate`, one per ratio it takes. `clip`: what `clip_low` / `clip_high`
    are to it: None (not read), "ratio" (the bounds 1 − ε_low, 1 + ε_high of w, both required; `delta` and
    `dual_clip` act on them), "band" (the same bounds, either may be None: CISPO's weight band, whose upper bound
    may lie below 1), "divergence" (DPPO's thresholds on a divergence, both required). `fields`: the other config
    fields it reads; `required`: those of them that must be set. `weights_in_ratio`: importance weights enter its
    ratio instead of weighting each token's loss (VESPO). `presets`: its built-in presets, name → the other
    `PolicyLossConfig` fields they set (`rlkernels.presets`, in the registry's order). `plugin`: registered by a
    user."""

    name: str
    surrogates: Mapping[str, Callable[[Batch, object], s.Surrogate]]
    clip: Optional[str] = None
    fields: Tuple[str, ...] = ()
    required: Tuple[str, ...] = ()
    weights_in_ratio: bool = False
    presets: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    plugin: bool = False

    @property
    def ratios(self) -> Tuple[str, ...]:
        return tuple(self.surrogates)


_REGISTRY: Dict[str, Objective] = {}


def _declare(objective: Objective) -> Objective:
    assert objective.clip in CLIP_KINDS and set(objective.ratios) <= set(RATIOS), objective
    assert not set(objective.presets) & set(presets()), f"{objective.name}: a preset of that name exists"
    _REGISTRY[objective.name] = objective
    return objective


def get(name: str) -> Objective:
    """The objective called `name`; an unknown name is an error listing the known ones."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"objective: expected one of {names()}, got {name!r}")
    return _REGISTRY[name]


def names() -> Tuple[str, ...]:
    """Every objective's name, built-ins in declaration order, then plug-ins."""
    return tuple(_REGISTRY)


def taking(ratio: str) -> Tuple[str, ...]:
    """The objectives that take `ratio`."""
    return tuple(name for name, o in _REGISTRY.items() if ratio in o.surrogates)


def presets() -> Dict[str, dict]:
    """Every built-in preset, name → its `PolicyLossConfig` fields (`ratio` and `objective` first), in the
    registry's order (`rlkernels.presets` adds the users' own)."""
    return {name: {"ratio": fields["ratio"], "objective": o.name, **fields}
            for o in _REGISTRY.values() for name, fields in o.presets.items()}


def reading(field: str) -> Tuple[str, ...]:
    """The objectives that read config field `field` (`Objective.fields`)."""
    return tuple(name for name, o in _REGISTRY.items() if field in o.fields)


# ---- the built-in objectives (docs/math.md §5) and their presets (§9) -----------------------------------------
# Sequence-level ratios give one surrogate per row; rows are averaged (docs/math.md §5, §8).
_PER_ROW = "seq_mean_token_mean"
_declare(Objective("clip", {
    "token": s.at(s.token_ratio, s.clip), "sequence": s.at(s.sequence_ratio, s.clip),
    "sequence_token": s.at(s.sequence_token_ratio, s.clip), "sequence_sum": s.fspo,
    "group_expectation": s.group_expectation, "geometric": s.geometric,
}, clip="ratio", fields=("delta", "dual_clip", "fspo_c_low", "fspo_c_high"), presets={
    "ppo": dict(ratio="token", clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token_mean"),
    "grpo": dict(ratio="token", clip_low=0.2, clip_high=0.2, kl_estimator="k3", kl_coef=0.04,
                 agg="seq_mean_token_mean"),
    # Dr. GRPO divides by a constant: `norm_length` (the maximum completion length) has no default.
    "dr_grpo": dict(ratio="token", clip_low=0.2, clip_high=0.2, agg="constant"),
    "dapo": dict(ratio="token", clip_low=0.2, clip_high=0.28, agg="token_mean"),
    "gspo": dict(ratio="sequence", clip_low=3e-4, clip_high=4e-4, agg=_PER_ROW),
    "gspo_token": dict(ratio="sequence_token", clip_low=3e-4, clip_high=4e-4, agg="seq_mean_token_mean"),
    "fspo": dict(ratio="sequence_sum", fspo_c_low=0.03, fspo_c_high=0.03, agg=_PER_ROW),
    "gepo": dict(ratio="group_expectation", clip_low=0.2, clip_high=0.2, agg=_PER_ROW),
    "gmpo": dict(ratio="geometric", clip_low=0.4, clip_high=0.4, agg=_PER_ROW),
    "luspo": dict(ratio="sequence", clip_low=3e-4, clip_high=4e-4, agg="seq_mean_token_sum"),
}))
_declare(Objective("cispo", {"token": s.at(s.token_ratio, s.cispo), "sequence": s.at(s.sequence_ratio, s.cispo)},
                   clip="band", presets={"cispo": dict(ratio="token", clip_low=None, clip_high=4.0, agg="token_mean")}))
_declare(Objective("reinforce", {"token": s.at(s.token_ratio, s.reinforce), "snis": s.snis}, presets={
    "snis": dict(ratio="snis", agg=_PER_ROW), "gpg": dict(ratio="token", agg="token_mean")}))
_declare(Objective("sapo", {"token": s.at(s.token_ratio, s.sapo), "sequence": s.at(s.sequence_ratio, s.sapo),
                            "sequence_token": s.at(s.sequence_token_ratio, s.sapo)},
                   fields=("sapo_tau_pos", "sapo_tau_neg"), presets={
                       "sapo": dict(ratio="token", sapo_tau_pos=1.0, sapo_tau_neg=1.05, agg="seq_mean_token_mean")}))
for _divergence, _bound in (("tv", 0.15), ("kl", 0.05)):
    _declare(Objective(f"dppo_{_divergence}", {"token": s.at(s.token_ratio, functools.partial(s.dppo,
                                                                                           divergence=_divergence))},
                       clip="divergence", fields=("ratio_cap",), presets={
                           f"dppo_{_divergence}": dict(ratio="token", clip_low=_bound, clip_high=_bound,
                                                       agg="token_mean")}))
_declare(Objective("clip_cov", {"token": s.at(s.token_ratio, s.clip_cov)}, clip="ratio",
                   fields=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "clip_cov_draw"), presets={
                       "clip_cov": dict(ratio="token", clip_low=0.2, clip_high=0.2, clip_cov_ratio=2e-4,
                                        clip_cov_lb=1.0, clip_cov_ub=5.0, agg="token_mean")}))
_declare(Objective("kl_cov", {"token": s.at(s.token_ratio, s.kl_cov)}, fields=("kl_cov_ratio", "kl_cov_coef"),
                   presets={"kl_cov": dict(ratio="token", kl_cov_ratio=2e-4, kl_cov_coef=0.1, agg="token_mean")}))
_declare(Objective("dro", {"token": s.at(s.token_ratio, s.dro)}, fields=("dro_beta",), required=("dro_beta",),
                   presets={"dro": dict(ratio="token", dro_beta=0.1, agg="token_mean")}))
_declare(Objective("vespo", {"sequence_sum": s.vespo}, weights_in_ratio=True,
                   fields=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), presets={
                       "vespo": dict(ratio="sequence_sum", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                     vespo_lambda_neg=2.0, agg="token_mean")}))
_declare(Objective("topr", {"token": s.at(s.token_ratio, s.topr), "sequence_sum": s.at(s.trajectory_ratio, s.topr)},
                   presets={"topr": dict(ratio="token", clip_low=None, clip_high=None, agg="token_mean")}))
# GPPO: the clip family whose held tokens keep the gradient β·bound·A·∇ℓ, β its two fields (`surrogates.clip`)
_declare(Objective("gppo", {"token": s.at(s.token_ratio, functools.partial(s.clip, preserve=("gppo_beta_low",
                                                                                             "gppo_beta_high")))},
                   clip="ratio", fields=("dual_clip", "gppo_beta_low", "gppo_beta_high"), presets={
                       # Klear-Reasoner's run: DAPO's clip-higher bounds, verl's dual clip at 10, β₁ = β₂ = 1
                       "gppo": dict(ratio="token", clip_low=0.2, clip_high=0.28, dual_clip=10.0, gppo_beta_low=1.0,
                                    gppo_beta_high=1.0, agg="token_mean")}))
# SPO (Xie et al., 2025): its spec generated from its formula in the table; the paper's ε
_declare(Objective("spo", {"token": s.at(s.token_ratio, token_formulas.spo)}, fields=("spo_eps",),
                   presets={"spo": dict(ratio="token", spo_eps=0.2, agg="token_mean")}))

# A kernel objective of the table declared nowhere above: its spec is the one generated from its formula
# (token_formulas.py), at the token ratio, reading the table's parameters; presets come from rlkernels.presets.
for _entry in _KERNEL_OBJECTIVES:
    if _entry.name not in _REGISTRY:
        _bounds = {"clip_low", "clip_high"} & set(_entry.params)
        _declare(Objective(_entry.name, {"token": s.at(s.token_ratio, getattr(token_formulas, _entry.name))},
                           clip="band" if _bounds else None,
                           fields=tuple(p for p in _entry.params if p not in _bounds | {"log_ratio_clamp"})))


# ---- plug-ins -------------------------------------------------------------------------------------------------
def register_objective(name: str, surrogate: Callable, *, ratios: Tuple[str, ...] = ("token",), clip: bool = False,
                       replace: bool = False) -> Objective:
    """Add a policy objective written in plain PyTorch, usable wherever a built-in one is (`PolicyLossConfig`,
    `policy_loss`, the fused ops on logits or hidden states, through their general path: autograd of the
    `(B, T)` loss after the kernels' pass over the vocabulary).

    `surrogate(*, ratio, advantages, logp, old_logp, mask, config)` returns the per-token loss `(B, T)`, or
    `(loss, clipped_low, clipped_high)` with two bool `(B, T)` tensors for the clip metrics. Its inputs, all
    `(B, T)`: `ratio` the importance weight of the config's ratio, differentiable ("token": w = e^clamp(ℓ − ℓ_old)
    per token; "sequence": GSPO's s_i on each token of its row; "sequence_token": GSPO-token's), `advantages`,
    `logp` (ℓ, differentiable), `old_logp` (detached; ℓ itself on-policy), `mask` (bool); masked positions hold 0
    and their loss is ignored. `config` is the call's `PolicyLossConfig` (with `clip=True` its `clip_low` and
    `clip_high` are required and bound the ratio as PPO's: 1 − ε_low, 1 + ε_high). `ratios`: which of "token",
    "sequence", "sequence_token" it takes. `replace`: replace a plug-in of the same name (a built-in never).
    Presets for it: `rlkernels.presets.register(name, objective=name, ...)`."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"name: expected an identifier, got {name!r}")
    if name in _REGISTRY and not (replace and _REGISTRY[name].plugin):
        raise ValueError(f"name: objective {name!r} exists" + ("" if _REGISTRY[name].plugin else " (a built-in)")
                         + ("; pass replace=True to replace it" if _REGISTRY[name].plugin else ""))
    if not callable(surrogate):
        raise TypeError(f"surrogate: expected a callable, got {type(surrogate).__name__}")
    ratios = (ratios,) if isinstance(ratios, str) else tuple(ratios)
    if not ratios or any(r not in PLUGIN_RATIOS for r in ratios):
        raise ValueError(f"ratios: expected a non-empty subset of {tuple(PLUGIN_RATIOS)}, got {ratios!r}")
    if not isinstance(clip, bool):
        raise TypeError(f"clip: expected a bool, got {type(clip).__name__}")
    plugin = _Plugin(name, surrogate)
    return _declare(Objective(name, {r: s.at(PLUGIN_RATIOS[r], plugin) for r in ratios},
                              clip="ratio" if clip else None, plugin=True))


def unregister_objective(name: str) -> None:
    """Remove plug-in `name` (a built-in never)."""
    if get(name).plugin is False:
        raise ValueError(f"name: {name!r} is a built-in objective")
    del _REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class _Plugin:
    """A user's surrogate as a ratio-taking one: its output checked, so that a wrong shape is an error naming it."""

    name: str
    fn: Callable

    def __call__(self, w: torch.Tensor, b: Batch, cfg) -> s.Surrogate:
        out = self.fn(ratio=w, advantages=b.adv, logp=b.logp, old_logp=b.old_logp, mask=b.mask, config=cfg)
        loss, low, high = out if isinstance(out, tuple) and len(out) == 3 else (out, None, None)
        shape = tuple(b.logp.shape)
        if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != shape or not loss.is_floating_point():
            raise ValueError(f"objective {self.name!r}: its surrogate must return a floating (B, T) = {shape} loss "
                             f"(or (loss, clipped_low, clipped_high)), got {_describe(loss)}")
        flags = []
        for what, flag in (("clipped_low", low), ("clipped_high", high)):
            if flag is None:
                flag = torch.zeros(shape, dtype=torch.bool, device=loss.device)
            elif not isinstance(flag, torch.Tensor) or tuple(flag.shape) != shape or flag.dtype != torch.bool:
                raise ValueError(f"objective {self.name!r}: {what} must be a bool (B, T) = {shape} tensor, "
                                 f"got {_describe(flag)}")
            flags.append(flag)
        return s.Surrogate(loss, w.detach(), *flags)


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
