"""One config type for every policy objective of docs/math.md §4-§9, validated on construction."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Tuple, Union

from .._checks import check_choice, check_int, check_real
from .._token_loss_table import BOOL, KL_ESTIMATOR_ID, OBJECTIVE_ID, PARAMS, REAL, Param
from . import objectives
from .kl import BASE_ESTIMATORS, STRAIGHT_THROUGH
from .objectives import RATIOS

# Ratios that produce one importance weight per row: one advantage per row (docs/math.md §5).
SEQUENCE_RATIOS = ("sequence", "sequence_sum", "group_expectation", "geometric", "snis")
# Schulman's k1, k2, k3 of a clamped Δ; verl's kl_penalty options under verl's names (docs/math.md §6)
KL_ESTIMATORS = (None,) + BASE_ESTIMATORS + STRAIGHT_THROUGH
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")

# delta / dual_clip act on a ratio clipped in ratio space, not on the log-space clips.
_RATIO_SPACE_CLIP = ("token", "sequence", "sequence_token", "group_expectation")


def _field_type(param: Param):
    kind = {REAL: float, BOOL: bool, OBJECTIVE_ID: str, KL_ESTIMATOR_ID: str}[param.kind]
    return Optional[kind] if param.optional else kind


# The fields of the kernels' scalars, made from the table (rlkernels/_token_loss_table.py): each parameter's config
# field with its type, default, doc (`metadata["doc"]`) and range (checked in `PolicyLossConfig.__post_init__`). A
# scalar added to the table is a config field at once.
KernelScalarFields = dataclasses.make_dataclass(
    "KernelScalarFields",
    [(p.field, _field_type(p), dataclasses.field(default=p.field_default, metadata={"doc": p.doc})) for p in PARAMS],
    frozen=True, namespace={"__module__": __name__, "__doc__": "The fields of PolicyLossConfig that the kernels take "
                            "as scalars, made from rlkernels/_token_loss_table.py: " + "; ".join(
                                f"{p.field}: {p.doc}" for p in PARAMS) + "."})


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(KernelScalarFields):
    """Hyperparameters of a policy loss; see docs/math.md §4-§9 and `rlkernels.presets`. The fields the kernels take
    as scalars (objective, clip_low, clip_high, delta, dual_clip, kl_estimator, kl_coef, ...: `KernelScalarFields`,
    each with its doc) come from the table of rlkernels/_token_loss_table.py; the others are declared here."""

    ratio: str = "token"
    fspo_c_low: float = 0.03
    fspo_c_high: float = 0.03
    # which ratio multiplies the bias-corrected KL: each token's own (DeepSeek-V3.2), or its row's sequence
    # ratio exp(mean_t (ℓ − ℓ_old)) (TRL's use_bias_correction_kl with importance_sampling_level="sequence")
    kl_bias_ratio: str = "token"
    # how the entropy bonus is aggregated: None, as the loss (c_H·H in each token's loss); "token_mean", the
    # mean of H over the call's masked tokens whatever the loss's aggregation and counts (TRL's bonus)
    entropy_agg: Optional[str] = None
    agg: str = "token_mean"
    norm_length: Optional[int] = None
    group_size: Optional[int] = None
    # Clip-Cov / KL-Cov (verl's policy_loss.clip_cov_* / kl_cov_ratio / ppo_kl_coef)
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    # How Clip-Cov draws its tokens: "device" (random keys on the inputs' device, no host sync) or "verl"
    # (verl's torch.randperm on the CPU generator: the same tokens as verl's code, one host sync per call)
    clip_cov_draw: str = "device"
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1
    # VESPO's gamma weight φ(w) = e^λ·w^k·e^{-λw}, (k, λ) for A ≥ 0 / A < 0 (TRL's vespo_*)
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold): a row with A < 0 whose
    # mean (ℓ_rollout − ℓ) exceeds this loses its surrogate term (docs/math.md §7); None: off
    off_policy_mask: Optional[float] = None
    # 80/20 rule (Wang et al. 2025; TRL's top_entropy_quantile): only the fraction ρ ∈ [0, 1] of the call's tokens
    # with the highest entropy keep their surrogate term (0: the highest alone; docs/math.md §7); None: all
    top_entropy_quantile: Optional[float] = None
    # Rollout correction from the sampler's log-probs (argument `rollout_logp`, docs/math.md §7): importance
    # weights ω = π_old/π_rollout per token or per row, truncated to [lower, upper] or zeroed outside it
    # (TRL's vllm_importance_sampling_mode, verl's rollout_is); None: off
    rollout_is: Optional[str] = None
    rollout_is_mode: str = "truncate"
    rollout_is_lower: Optional[float] = None
    rollout_is_upper: Optional[float] = 2.0
    rollout_is_batch_normalize: bool = False
    # rejection sampling (verl's rollout_rs): tests ("<level>_<k1|k2|k3>", lower, upper) on the statistics
    # of `rlkernels.rollout_rejection_mask`, level token / seq_sum / seq_mean / seq_max; a rejected token
    # leaves the mask
    rollout_rs: Tuple[Tuple[str, Optional[float], Optional[float]], ...] = ()
    # a plug-in objective's own scalars (`register_objective(scalars=...)`), name → value, each read as an attribute
    # (`config.spo_eps`); the undeclared ones take their defaults. Held as a tuple of (name, value) pairs (hashable)
    scalars: Union[Mapping[str, float], Tuple[Tuple[str, float], ...]] = ()

    @classmethod
    def of(cls, **fields) -> "PolicyLossConfig":
        """The config of `fields`, among them the objective's own scalars by name (`spo_eps=0.5`)."""
        own = {f.name for f in dataclasses.fields(cls)}
        extra = {name: fields.pop(name) for name in list(fields) if name not in own}
        if extra:
            declared = objectives.get(fields.get("objective", cls.objective)).scalars
            unknown = sorted(set(extra) - set(declared))
            if unknown:
                raise ValueError(f"fields: unknown PolicyLossConfig fields {unknown} (objective "
                                 f"{fields.get('objective', cls.objective)!r} declares the scalars {tuple(declared)})")
            fields["scalars"] = {**dict(fields.get("scalars", ())), **extra}
        return cls(**fields)

    def __getattr__(self, name):
        # only for names the instance lacks: a scalar of the objective's (not while unpickling, before `scalars` is set)
        scalars = self.__dict__.get("scalars", ())
        for key, value in scalars:
            if key == name:
                return value
        raise AttributeError(f"{type(self).__name__!r} has no field or scalar {name!r}")

    def __post_init__(self):
        check_choice("ratio", self.ratio, RATIOS)
        objective = objectives.get(self.objective)
        object.__setattr__(self, "scalars", _scalars(self.scalars, objective))
        if self.kl_estimator == "full":
            raise ValueError("kl_estimator: 'full' (verl's name) needs the whole distributions of π and π_ref, not "
                             "the sampled tokens' log-probs a policy loss takes (verl 0.9.1 raises "
                             f"NotImplementedError for it too); expected one of {KL_ESTIMATORS}")
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("agg", self.agg, AGGREGATIONS)
        if self.ratio not in objective.ratios:
            raise ValueError(
                f"objective: {self.objective!r} cannot be used with ratio={self.ratio!r}; "
                f"expected one of {objectives.taking(self.ratio)}"
            )
        # the ranges of the fields the kernels take too, declared once (rlkernels/_token_loss_table.py); the rules below
        # narrow some for some objectives
        for param in PARAMS:
            if param.kind == REAL:
                check_real(param.field, getattr(self, param.field), param.low, lo_open=param.strict,
                           optional=param.optional)
        self._check_clip(objective)
        check_real("fspo_c_low", self.fspo_c_low, 0.0)
        check_real("fspo_c_high", self.fspo_c_high, 0.0)
        if self.kl_coef > 0 and self.kl_estimator is None:
            raise ValueError(f"kl_estimator: kl_coef > 0 needs an estimator, one of {KL_ESTIMATORS[1:]}, got None")
        if not isinstance(self.kl_bias_correction, bool):
            raise TypeError(f"kl_bias_correction: expected a bool, got {type(self.kl_bias_correction).__name__}")
        check_choice("kl_bias_ratio", self.kl_bias_ratio, ("token", "sequence"))
        if self.entropy_agg is not None:
            check_choice("entropy_agg", self.entropy_agg, ("token_mean",))
        check_int("norm_length", self.norm_length, 1, optional=True)
        if self.agg == "constant" and self.norm_length is None:
            raise ValueError(
                "norm_length: agg='constant' (Dr. GRPO) divides by a constant length, got None; pass the maximum "
                "completion length (with the padded T the loss would change with the padding)"
            )
        check_int("group_size", self.group_size, 1, optional=True)
        if self.ratio_cap is not None and "ratio_cap" not in objective.fields:
            raise ValueError(f"ratio_cap: only valid with objective in {list(objectives.reading('ratio_cap'))}, "
                             f"got {self.objective!r}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            check_real(name, getattr(self, name), 0.0, lo_open=True)
            if getattr(self, name) > 1:
                raise ValueError(f"{name}: expected a fraction of the tokens in (0, 1], got {getattr(self, name)}")
        check_real("clip_cov_lb", self.clip_cov_lb)
        check_real("clip_cov_ub", self.clip_cov_ub)
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb: expected a value < clip_cov_ub ({self.clip_cov_ub}), got {self.clip_cov_lb}")
        check_choice("clip_cov_draw", self.clip_cov_draw, ("device", "verl"))
        check_real("kl_cov_coef", self.kl_cov_coef, 0.0)
        check_real("dro_beta", self.dro_beta, 0.0, lo_open=True, optional="dro_beta" not in objective.required)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_real(name, getattr(self, name), 0.0)
        check_real("off_policy_mask", self.off_policy_mask, optional=True)
        # 0 keeps the tokens of the largest entropy alone (TRL's top_entropy_quantile=0.0)
        check_real("top_entropy_quantile", self.top_entropy_quantile, 0.0, 1.0, optional=True)
        check_choice("rollout_is", self.rollout_is, (None, "token", "sequence"))
        check_choice("rollout_is_mode", self.rollout_is_mode, ("truncate", "mask"))
        check_real("rollout_is_lower", self.rollout_is_lower, 0.0, optional=True)
        check_real("rollout_is_upper", self.rollout_is_upper, 0.0, lo_open=True, optional=True)
        if None not in (self.rollout_is_lower, self.rollout_is_upper) and self.rollout_is_lower > self.rollout_is_upper:
            raise ValueError(f"rollout_is_lower: expected a value <= rollout_is_upper ({self.rollout_is_upper}), "
                             f"got {self.rollout_is_lower}")
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise TypeError(f"rollout_is_batch_normalize: expected a bool, got {type(self.rollout_is_batch_normalize).__name__}")
        object.__setattr__(self, "rollout_rs", _rejection_tests(self.rollout_rs))
        if self.off_policy_mask is not None and self.ratio == "snis":
            raise ValueError("off_policy_mask: reads the sign of the advantage, and ratio='snis' takes rewards")

    def _check_clip(self, objective) -> None:
        """clip_low / clip_high as the objective reads them (`Objective.clip`), delta and the dual clip."""
        needs_clip = objective.clip in ("ratio", "divergence")
        check_real("clip_low", self.clip_low, 0.0, optional=not needs_clip)
        # CISPO's clip_high may be negative: TRL caps its weight at ε_high, which may be below 1.
        band = objective.clip == "band"
        check_real("clip_high", self.clip_high, -1.0 if band else 0.0, lo_open=band, optional=not needs_clip)
        if (self.ratio in _RATIO_SPACE_CLIP and objective.clip in ("ratio", "band")
                and self.clip_low is not None and self.clip_low >= 1):
            raise ValueError(f"clip_low: expected a value in [0, 1) for a ratio-space clip, got {self.clip_low}")
        # delta caps the unclipped branch at min(w, δ): any δ > 0, as TRL takes; the dual clip's c·|A| needs c > 1
        for name, lo in (("delta", 0.0), ("dual_clip", 1.0)):
            value = getattr(self, name)
            if value is None:
                continue
            check_real(name, value, lo, lo_open=True)
            if name not in objective.fields or self.ratio not in _RATIO_SPACE_CLIP:
                raise ValueError(
                    f"{name}: only valid with objective in {list(objectives.reading(name))} and ratio in "
                    f"{_RATIO_SPACE_CLIP}, got objective={self.objective!r}, ratio={self.ratio!r}"
                )

    def rejection_tests(self):
        """`rollout_rs` as keyword arguments of `rlkernels.rollout_rejection_mask`, one dict per test."""
        return [dict(level=name.rpartition("_")[0], estimator=name.rpartition("_")[2], lower=lo, upper=hi)
                for name, lo, hi in self.rollout_rs]

    def replace(self, **overrides) -> "PolicyLossConfig":
        """A copy with some fields changed, the objective's scalars among them by name (validated again). A change of
        objective leaves the old one's scalars behind."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if overrides.get("objective", self.objective) != self.objective:
            fields["scalars"] = ()
        return PolicyLossConfig.of(**{**fields, **overrides})


def _scalars(given, objective) -> Tuple[Tuple[str, float], ...]:
    """`scalars` checked against the objective's declared ones, every one of them present, in declaration order."""
    given = dict(given)
    unknown = sorted(set(given) - set(objective.scalars))
    if unknown:
        raise ValueError(f"scalars: objective {objective.name!r} declares {tuple(objective.scalars)}, got {unknown}")
    return tuple((name, objectives.check_scalar(name, given.get(name, scalar.default), scalar))
                 for name, scalar in objective.scalars.items())


objectives.reserve(f.name for f in dataclasses.fields(PolicyLossConfig))
_RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


def _rejection_tests(tests) -> tuple:
    """`rollout_rs` validated and as a tuple of (name, lower, upper) tuples (hashable, as the config)."""
    if not isinstance(tests, (tuple, list)):
        raise TypeError(f"rollout_rs: expected a sequence of (name, lower, upper), got {type(tests).__name__}")
    out = []
    for test in tests:
        if not isinstance(test, (tuple, list)) or len(test) != 3 or not isinstance(test[0], str):
            raise ValueError(f"rollout_rs: expected (name, lower, upper) tests, got {test!r}")
        name, lower, upper = test
        level, _, estimator = name.rpartition("_")
        if level not in _RS_LEVELS or estimator not in ("k1", "k2", "k3") or (level, estimator) == ("seq_max", "k1"):
            raise ValueError(f"rollout_rs: unknown test {name!r}; expected <level>_<k1|k2|k3> with level in "
                             f"{_RS_LEVELS} (no seq_max_k1)")
        lower = check_real(f"rollout_rs[{name}] lower", lower, optional=True)
        upper = check_real(f"rollout_rs[{name}] upper", upper, optional=True)
        if None not in (lower, upper) and lower > upper:
            raise ValueError(f"rollout_rs: {name}'s lower bound {lower} is above its upper bound {upper}")
        out.append((name, lower, upper))
    return tuple(out)
