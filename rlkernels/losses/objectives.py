"""The registry of policy objectives (docs/math.md §5): one `Objective` per name, with its surrogate at each
ratio it takes, what it reads of the config and its presets (§9). `PolicyLossConfig` validates against it,
`policy_loss` evaluates through it, `rlkernels.presets` lists its presets, the docs' lists are checked against it, and
`register_objective` adds a user's objective written in plain PyTorch (docs/design.md, "Adding an objective").
The entry is the objective's only description: the verl and TRL adapters read its foreign names (`Objective.verl`,
`Objective.trl`), the ops its sequence-level evaluators and whether it chooses tokens over the whole call.

A surrogate is `f(b: Batch, cfg) -> Surrogate` over `(B, T)`; `surrogates.at(weight, f)` evaluates a
ratio-taking `f(w, b, cfg)` at the weight of a ratio, so one function serves every ratio of an objective. The
per-token ones of the kernels' objectives are `token_formulas` (generated from the table's formulas, the spec);
the sequence-level ones and the covariance choice are `surrogates`.
"""
from __future__ import annotations

import dataclasses
import keyword
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import torch

from .._checks import check_real
from . import surrogates as s
from . import token_formulas as f
from .._token_loss_table import OBJECTIVES as _KERNEL_OBJECTIVES
from .batch import Batch

RATIOS = ("token", "sequence", "sequence_token", "sequence_sum", "group_expectation", "geometric", "snis")
# the ratios over a whole prompt group (group_size or group_ids), which a batch must hold whole
GROUPED_RATIOS = ("group_expectation", "snis")
# the ratios a plug-in may take: those whose importance weight is one (B, T) tensor (GMPO's and SNIS's are formulas
# of the objective, not weights): "sequence_sum" is the trajectory ratio π(τ)/μ(τ) (TOPR's), "group_expectation" GEPO's
PLUGIN_RATIOS = {"token": s.token_ratio, "sequence": s.sequence_ratio, "sequence_token": s.sequence_token_ratio,
                 "sequence_sum": s.trajectory_ratio, "group_expectation": s.group_expectation_ratio}
CLIP_KINDS = (None, "ratio", "band", "divergence")


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A real hyperparameter that a plug-in objective declares (`register_objective(scalars=...)`): its default and
    range (`low` < value when `low_open`, else ≤; value ≤ `high`). A `PolicyLossConfig` holds it in `scalars` and
    reads it as an attribute (`config.spo_eps`); presets, verl's key and TRL's argument set it as any field."""

    default: float
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Verl:
    """How verl's actor config sets an objective's fields (`integrations/verl.py`, `loss_config`). `keys`: field →
    (verl's key, dotted from the actor config, e.g. "policy_loss.clip_cov_ratio"; the value verl's loss takes when
    the key is absent, None for the preset's). `fixed`: fields set whatever the config says (Clip-Cov draws verl's
    tokens). `loss_agg_mode`: the aggregation verl's loss of the same name always uses, whatever `loss_agg_mode`."""

    keys: Mapping[str, Tuple[str, Optional[float]]] = dataclasses.field(default_factory=dict)
    fixed: Mapping[str, object] = dataclasses.field(default_factory=dict)
    loss_agg_mode: Optional[str] = None


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
    user. `chooses_tokens`: its loss first chooses tokens by the whole call's covariance of A and ℓ (Clip-Cov,
    KL-Cov): the per-token kernels evaluate it after that choice (`ops/_covariance_step.py`). `sequence_steps`:
    sequence-level ratio → the evaluator of `ops/_sequence_step.py` (`EVALUATORS`) that computes it at given
    log-probs in a few launches, without autograd; a ratio without one takes the general path. `scalars`: a plug-in's own hyperparameters, name → `Scalar`. Its foreign names, which the adapters look
    up: `verl` (`Verl`: verl's keys for its fields and scalars, its fixed aggregation) and `trl`: field → the
    `GRPOConfig` argument that sets it (TRL's own for the built-ins; a plug-in's scalar's, on a user's args)."""

    name: str
    surrogates: Mapping[str, Callable[[Batch, object], s.Surrogate]]
    clip: Optional[str] = None
    fields: Tuple[str, ...] = ()
    required: Tuple[str, ...] = ()
    weights_in_ratio: bool = False
    presets: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    plugin: bool = False
    chooses_tokens: bool = False
    sequence_steps: Mapping[str, str] = dataclasses.field(default_factory=dict)
    scalars: Mapping[str, Scalar] = dataclasses.field(default_factory=dict)
    verl: Verl = Verl()
    trl: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ratios(self) -> Tuple[str, ...]:
        return tuple(self.surrogates)


_REGISTRY: Dict[str, Objective] = {}


def _declare(objective: Objective) -> Objective:
    # raised, not asserted: `python -O` drops asserts, and a wrong entry must not load
    if objective.clip not in CLIP_KINDS:
        raise ValueError(f"objective {objective.name!r}: clip expected one of {CLIP_KINDS}, got {objective.clip!r}")
    if not objective.ratios or not set(objective.ratios) <= set(RATIOS):
        raise ValueError(f"objective {objective.name!r}: ratios expected a non-empty subset of {RATIOS}, "
                         f"got {objective.ratios}")
    taken = set(objective.presets) & set(presets())
    if taken:
        raise ValueError(f"objective {objective.name!r}: presets {sorted(taken)} exist")
    if not set(objective.sequence_steps) <= set(objective.ratios) - {"token"}:
        raise ValueError(f"objective {objective.name!r}: sequence_steps for ratios it does not take at sequence "
                         f"level: {sorted(objective.sequence_steps)}")
    unknown = (set(objective.verl.keys) | set(objective.trl)) - set(objective.fields) - set(objective.scalars)
    if unknown:
        raise ValueError(f"objective {objective.name!r}: verl keys or TRL arguments for fields it does not read: "
                         f"{sorted(unknown)}")
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
    "token": s.at(s.token_ratio, f.clip), "sequence": s.at(s.sequence_ratio, f.clip),
    "sequence_token": s.at(s.sequence_token_ratio, f.clip), "sequence_sum": s.fspo,
    "group_expectation": s.at(s.group_expectation_ratio, f.clip), "geometric": s.geometric,
}, sequence_steps={"sequence": "gspo", "sequence_token": "gspo_token", "sequence_sum": "fspo",
                   "group_expectation": "gepo", "geometric": "geometric"}, clip="ratio", fields=("delta", "dual_clip", "fspo_c_low", "fspo_c_high"), presets={
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
_declare(Objective("cispo", {"token": s.at(s.token_ratio, f.cispo), "sequence": s.at(s.sequence_ratio, f.cispo)},
                   clip="band", sequence_steps={"sequence": "sequence_cispo"}, presets={"cispo": dict(ratio="token", clip_low=None, clip_high=4.0, agg="token_mean")}))
_declare(Objective("reinforce", {"token": s.at(s.token_ratio, f.reinforce), "snis": s.snis},
                   sequence_steps={"snis": "snis"}, presets={
    "snis": dict(ratio="snis", agg=_PER_ROW), "gpg": dict(ratio="token", agg="token_mean")}))
_declare(Objective("sapo", {"token": s.at(s.token_ratio, f.sapo), "sequence": s.at(s.sequence_ratio, f.sapo),
                            "sequence_token": s.at(s.sequence_token_ratio, f.sapo)},
                   sequence_steps={"sequence": "gspo", "sequence_token": "gspo_token"},
                   fields=("sapo_tau_pos", "sapo_tau_neg"), presets={
                       "sapo": dict(ratio="token", sapo_tau_pos=1.0, sapo_tau_neg=1.05, agg="seq_mean_token_mean")},
                   # verl's sapo reads tau_pos / tau_neg and always aggregates seq-mean-token-mean
                   verl=Verl(keys={"sapo_tau_pos": ("tau_pos", 1.0), "sapo_tau_neg": ("tau_neg", 1.05)},
                             loss_agg_mode="seq-mean-token-mean"),
                   trl={"sapo_tau_pos": "sapo_temperature_pos", "sapo_tau_neg": "sapo_temperature_neg"}))
for _divergence, _bound in (("tv", 0.15), ("kl", 0.05)):
    _declare(Objective(f"dppo_{_divergence}", {"token": s.at(s.token_ratio, getattr(f, f"dppo_{_divergence}"))},
                       clip="divergence", fields=("ratio_cap",), presets={
                           f"dppo_{_divergence}": dict(ratio="token", clip_low=_bound, clip_high=_bound,
                                                       agg="token_mean")},
                       # verl: config.get("clip_ratio_c", 20.0) caps the detached ratio
                       verl=Verl(keys={"ratio_cap": ("clip_ratio_c", 20.0)})))
_declare(Objective("clip_cov", {"token": s.at(s.token_ratio, s.clip_cov)}, clip="ratio", chooses_tokens=True,
                   fields=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "clip_cov_draw"), presets={
                       "clip_cov": dict(ratio="token", clip_low=0.2, clip_high=0.2, clip_cov_ratio=2e-4,
                                        clip_cov_lb=1.0, clip_cov_ub=5.0, agg="token_mean")},
                   verl=Verl(keys={"clip_cov_ratio": ("policy_loss.clip_cov_ratio", 2e-4),
                                   "clip_cov_lb": ("policy_loss.clip_cov_lb", 1.0),
                                   "clip_cov_ub": ("policy_loss.clip_cov_ub", 5.0)},
                             fixed={"clip_cov_draw": "verl"})))  # verl's tokens
_declare(Objective("kl_cov", {"token": s.at(s.token_ratio, s.kl_cov)}, chooses_tokens=True,
                   fields=("kl_cov_ratio", "kl_cov_coef"),
                   presets={"kl_cov": dict(ratio="token", kl_cov_ratio=2e-4, kl_cov_coef=0.1, agg="token_mean")},
                   verl=Verl(keys={"kl_cov_ratio": ("policy_loss.kl_cov_ratio", 2e-4),
                                   "kl_cov_coef": ("policy_loss.ppo_kl_coef", 1.0)})))
_declare(Objective("dro", {"token": s.at(s.token_ratio, f.dro)}, fields=("dro_beta",), required=("dro_beta",),
                   presets={"dro": dict(ratio="token", dro_beta=0.1, agg="token_mean")},
                   verl=Verl(keys={"dro_beta": ("policy_loss.dro_beta", None)})))  # required, as by verl's dro
_declare(Objective("vespo", {"sequence_sum": s.vespo}, weights_in_ratio=True, sequence_steps={"sequence_sum": "vespo"},
                   fields=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), presets={
                       "vespo": dict(ratio="sequence_sum", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                     vespo_lambda_neg=2.0, agg="token_mean")},
                   # the keys the VESPO authors' verl loss reads; TRL's arguments have the fields' names
                   verl=Verl(keys={f"vespo_{k}": (f"policy_loss.vespo.{k}", None)
                                   for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}),
                   trl={f"vespo_{k}": f"vespo_{k}" for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}))
_declare(Objective("topr", {"token": s.at(s.token_ratio, f.topr), "sequence_sum": s.at(s.trajectory_ratio, f.topr)},
                   presets={"topr": dict(ratio="token", clip_low=None, clip_high=None, agg="token_mean")}))
# GPPO: the clip family whose held tokens keep the gradient β·bound·A·∇ℓ, β its two fields
_declare(Objective("gppo", {"token": s.at(s.token_ratio, f.gppo)},
                   clip="ratio", fields=("dual_clip", "gppo_beta_low", "gppo_beta_high"), presets={
                       # Klear-Reasoner's run: DAPO's clip-higher bounds, verl's dual clip at 10, β₁ = β₂ = 1
                       "gppo": dict(ratio="token", clip_low=0.2, clip_high=0.28, dual_clip=10.0, gppo_beta_low=1.0,
                                    gppo_beta_high=1.0, agg="token_mean")}))
# SPO (Xie et al., 2025): the paper's ε
_declare(Objective("spo", {"token": s.at(s.token_ratio, f.spo)}, fields=("spo_eps",),
                   presets={"spo": dict(ratio="token", spo_eps=0.2, agg="token_mean")}))

# A kernel objective of the table declared nowhere above: its spec is the one generated from its formula
# (token_formulas.py), at the token ratio, reading the table's parameters; presets come from rlkernels.presets.
for _entry in _KERNEL_OBJECTIVES:
    if _entry.name not in _REGISTRY:
        _bounds = {"clip_low", "clip_high"} & set(_entry.params)
        _declare(Objective(_entry.name, {"token": s.at(s.token_ratio, getattr(f, _entry.name))},
                           clip="band" if _bounds else None,
                           fields=tuple(p for p in _entry.params if p not in _bounds | {"log_ratio_clamp"})))


# ---- plug-ins -------------------------------------------------------------------------------------------------
def register_objective(name: str, surrogate: Callable, *, ratios: Tuple[str, ...] = ("token",), clip: bool = False,
                       scalars: Optional[Mapping[str, Union[float, Scalar]]] = None,
                       verl_keys: Optional[Mapping[str, str]] = None, trl_args: Optional[Mapping[str, str]] = None,
                       replace: bool = False) -> Objective:
    """Add a policy objective written in plain PyTorch, usable wherever a built-in one is (`PolicyLossConfig`,
    `policy_loss`, the fused ops on logits or hidden states, through their general path: autograd of the
    `(B, T)` loss after the kernels' pass over the vocabulary).

    `surrogate(*, ratio, advantages, logp, old_logp, mask, config)` returns the per-token loss `(B, T)`, or
    `(loss, clipped_low, clipped_high)` with two bool `(B, T)` tensors for the clip metrics. Its inputs, all
    `(B, T)`: `ratio` the importance weight of the config's ratio, differentiable ("token": w = e^clamp(ℓ − ℓ_old)
    per token; "sequence": GSPO's s_i on each token of its row; "sequence_token": GSPO-token's; "sequence_sum": the
    trajectory ratio π(τ)/μ(τ), TOPR's; "group_expectation": GEPO's p_i / Ê_g over the row's prompt group, which needs
    `group_size` or `group_ids`), `advantages`,
    `logp` (ℓ, differentiable), `old_logp` (detached; ℓ itself on-policy), `mask` (bool); masked positions hold 0
    and their loss is ignored. `config` is the call's `PolicyLossConfig` (with `clip=True` its `clip_low` and
    `clip_high` are required and bound the ratio as PPO's: 1 − ε_low, 1 + ε_high). `ratios`: which of "token",
    "sequence", "sequence_token", "sequence_sum", "group_expectation" it takes.

    `scalars`: its own hyperparameters, name → default (a number) or `Scalar` (default and range); each is validated
    by the config, read as `config.<name>`, and set like any field: `PolicyLossConfig(scalars={name: value})`,
    `presets.register(..., name=value)`, `presets.get(preset, name=value)`, `config.replace(name=value)`, verl's
    `policy_loss.<name>` (or the key `verl_keys` gives it) and TRL's argument `<name>` on the trainer's args (or
    the one `trl_args` gives it). `replace`: replace a plug-in of the same name (a built-in never).
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
    declared = _scalars(scalars)
    verl = _foreign("verl_keys", verl_keys, declared, lambda n: f"policy_loss.{n}")
    trl = _foreign("trl_args", trl_args, declared, lambda n: n)
    plugin = _Plugin(name, surrogate)
    return _declare(Objective(name, {r: s.at(PLUGIN_RATIOS[r], plugin) for r in ratios},
                              clip="ratio" if clip else None, plugin=True, scalars=declared,
                              verl=Verl(keys={n: (key, None) for n, key in verl.items()}), trl=trl))


def _scalars(scalars) -> Dict[str, Scalar]:
    """A plug-in's `scalars` argument as name → `Scalar`, checked: new identifiers, defaults in their ranges."""
    if scalars is None:
        return {}
    if not isinstance(scalars, Mapping):
        raise TypeError(f"scalars: expected a mapping of name → default or Scalar, got {type(scalars).__name__}")
    taken = _RESERVED
    out = {}
    for name, scalar in scalars.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name in taken:
            raise ValueError(f"scalars: expected identifiers that are not PolicyLossConfig fields, got {name!r}")
        scalar = scalar if isinstance(scalar, Scalar) else Scalar(scalar)
        check_scalar(f"scalars[{name!r}] default", scalar.default, scalar)
        out[name] = scalar
    return out


def check_scalar(what: str, value, scalar: Scalar) -> float:
    """`value` as a float in `scalar`'s range; else an error naming `what`."""
    return float(check_real(what, value, scalar.low, scalar.high, lo_open=scalar.low_open))


def _foreign(argument: str, names: Optional[Mapping[str, str]], declared, default: Callable[[str], str]):
    """verl keys or TRL arguments of a plug-in's scalars: `default(name)` unless `names` gives another."""
    names = dict(names or {})
    if set(names) - set(declared) or not all(isinstance(v, str) and v for v in names.values()):
        raise ValueError(f"{argument}: expected a mapping of its scalars {tuple(declared)} to non-empty names, "
                         f"got {names!r}")
    return {name: names.get(name, default(name)) for name in declared}


def unregister_objective(name: str) -> None:
    """Remove plug-in `name` (a built-in never), and the presets of it (`presets.register`): neither the trainer
    nor verl nor TRL offers them any longer."""
    if get(name).plugin is False:
        raise ValueError(f"name: {name!r} is a built-in objective")
    for drop in _ON_UNREGISTER:
        drop(name)
    del _REGISTRY[name]


# What the modules built on this one (which import it, so it cannot import them) tell it: the names no scalar may
# take (the config's fields: `config.py`) and what goes with a plug-in (its presets: `presets.py`).
_RESERVED: set = set()
_ON_UNREGISTER: list = []


def reserve(names) -> None:
    """No plug-in scalar may be called one of `names`."""
    _RESERVED.update(names)


def on_unregister(drop: Callable[[str], None]) -> None:
    """`drop(objective)` runs when a plug-in is unregistered, before it goes."""
    _ON_UNREGISTER.append(drop)


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
