"""The registry of policy objectives (docs/math.md §5): one `Objective` per name, with its surrogate at each
ratio it takes and what it reads of the config. `PolicyLossConfig` validates against it, `policy_loss` evaluates
through it, the docs' lists are checked against it, and `register_objective` adds a user's objective written in
plain PyTorch (docs/design.md, "Adding an objective").

A surrogate is `f(b: Batch, cfg) -> Surrogate` over `(B, T)`; `surrogates.at(weight, f)` evaluates a
ratio-taking `f(w, b, cfg)` at the weight of a ratio, so one function serves every ratio of an objective.
"""
from __future__ import annotations

import dataclasses
import keyword
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from . import surrogates as s
from .batch import Batch

RATIOS = ("token", "sequence", "sequence_token", "sequence_sum", "group_expectation", "geometric", "snis")
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
    ratio instead of weighting each token's loss (VESPO). `plugin`: registered by a user."""

    name: str
    surrogates: Mapping[str, Callable[[Batch, object], s.Surrogate]]
    clip: Optional[str] = None
    fields: Tuple[str, ...] = ()
    required: Tuple[str, ...] = ()
    weights_in_ratio: bool = False
    plugin: bool = False

    @property
    def ratios(self) -> Tuple[str, ...]:
        return tuple(self.surrogates)


_REGISTRY: Dict[str, Objective] = {}


def _declare(objective: Objective) -> Objective:
    assert objective.clip in CLIP_KINDS and set(objective.ratios) <= set(RATIOS), objective
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


def reading(field: str) -> Tuple[str, ...]:
    """The objectives that read config field `field` (`Objective.fields`)."""
    return tuple(name for name, o in _REGISTRY.items() if field in o.fields)


# ---- the built-in objectives (docs/math.md §5) ------------------------------------------------------------
_declare(Objective("clip", {
    "token": s.at(s.token_ratio, s.clip), "sequence": s.at(s.sequence_ratio, s.clip),
    "sequence_token": s.at(s.sequence_token_ratio, s.clip), "sequence_sum": s.fspo,
    "group_expectation": s.group_expectation, "geometric": s.geometric,
}, clip="ratio", fields=("delta", "dual_clip", "fspo_c_low", "fspo_c_high")))
_declare(Objective("cispo", {"token": s.at(s.token_ratio, s.cispo), "sequence": s.at(s.sequence_ratio, s.cispo)},
                   clip="band"))
_declare(Objective("reinforce", {"token": s.at(s.token_ratio, s.reinforce), "snis": s.snis}))
_declare(Objective("sapo", {"token": s.at(s.token_ratio, s.sapo), "sequence": s.at(s.sequence_ratio, s.sapo),
                            "sequence_token": s.at(s.sequence_token_ratio, s.sapo)},
                   fields=("sapo_tau_pos", "sapo_tau_neg")))
for _name in ("dppo_tv", "dppo_kl"):
    _declare(Objective(_name, {"token": s.at(s.token_ratio, s.dppo)}, clip="divergence", fields=("ratio_cap",)))
_declare(Objective("clip_cov", {"token": s.at(s.token_ratio, s.clip_cov)}, clip="ratio",
                   fields=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "clip_cov_draw")))
_declare(Objective("kl_cov", {"token": s.at(s.token_ratio, s.kl_cov)}, fields=("kl_cov_ratio", "kl_cov_coef")))
_declare(Objective("dro", {"token": s.at(s.token_ratio, s.dro)}, fields=("dro_beta",), required=("dro_beta",)))
_declare(Objective("vespo", {"sequence_sum": s.vespo}, weights_in_ratio=True,
                   fields=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")))
# GPPO: PPO's clip whose held tokens keep the gradient β·bound·A·∇ℓ (`surrogates.clip_objective`)
_declare(Objective("gppo", {"token": s.at(s.token_ratio, s.clip)}, clip="ratio",
                   fields=("dual_clip", "gppo_beta_low", "gppo_beta_high")))
_declare(Objective("topr", {"token": s.at(s.token_ratio, s.topr), "sequence_sum": s.at(s.trajectory_ratio, s.topr)}))


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
