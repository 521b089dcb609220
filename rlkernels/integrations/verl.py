"""rlkernels' policy losses as verl policy losses: `actor.policy_loss.loss_mode=rlkernels_<preset>`.

`register()` adds one verl policy loss per preset of docs/math.md §9 (`rlkernels_ppo`,
`rlkernels_grpo`, ..., `rlkernels_snis`) to `verl.trainer.ppo.core_algos`'s registry, and one per preset a
user registers (`presets.register`, e.g. for an objective of `register_objective`), before or after `register()`:
verl's registry then resolves `rlkernels_<name>` when verl looks it up, so `presets.unregister` removes it too
(with Ray, the worker's setup hook registers the plug-in as well, then calls `register()`). Each has
verl's signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights)` and returns what verl's own losses return: `(pg_loss, metrics)`.
verl computes `log_prob` in its actor; these losses are the `[B, T]` math (`policy_loss`), so
they bring the presets verl lacks (FSPO, GEPO, SNIS, LUSPO, VESPO, GSPO's sequence ratio, delta)
and one definition of each, not the kernels. `register()` must run in every process that computes
the actor loss; with Ray workers, e.g. `ray.init(runtime_env={"worker_process_setup_hook":
"rlkernels.integrations.verl.register"})`. `register(fused_kernels=True)` also puts rlkernels'
hidden-state log-prob/entropy op in verl's fused-kernel path (`model.use_fused_kernels=True`; see
verl_fused.py); by default verl's own kernels stay untouched.

How verl's settings map onto `PolicyLossConfig` (the preset chooses the algorithm, verl's
config its numbers, as verl's own losses read them). The clip and aggregation rows are verl's for every
objective; the objective-specific rows are declared in each objective's registry entry (`Objective.verl`:
keys, verl's defaults, fixed fields and aggregation), a plug-in's scalars there too:

| verl | rlkernels |
|---|---|
| `loss_agg_mode="token-mean"` | `agg="token_mean"`, `num_items = batch_num_tokens / dp_size` |
| `"token-sum"` | `agg="token_mean"`, `num_items = 1 / dp_size` |
| `"seq-mean-token-sum"` | `agg="seq_mean_token_sum"`, `num_seqs = global_batch_size / dp_size` |
| `"seq-mean-token-mean"` | `agg="seq_mean_token_mean"`, `num_seqs = global_batch_size / dp_size` |
| `"seq-mean-token-sum-norm"` | `agg="constant"`, `norm_length = loss_scale_factor` (None: the padded length) |
| `clip_ratio_low` / `clip_ratio_high` (else `clip_ratio`) | `clip_low` / `clip_high` (DPPO's divergence thresholds for `dppo_*`), except for `fspo` (its √L band is `fspo_c_*`) and the presets whose objective reads no clip (`snis`, `gpg`, `sapo`, `kl_cov`, `dro`, `vespo`, `topr`, a plug-in registered with `clip=False`) |
| `clip_ratio_c` | `dual_clip`, for the presets that have a dual clip (`ppo`) |
| `rollout_n` | `group_size` of `gepo` / `snis` (rows of a group must be contiguous and whole in each micro-batch) |
| `rollout_is_weights` | `is_weights`: they multiply the per-token loss before aggregation, as in verl's losses (for `gmpo`, their per-row geometric mean, as verl's `geo_mean`; `gspo` and `luspo` are then evaluated in the GSPO-token form, as verl's `gspo`: each token's weight scales its own gradient; `vespo` takes them into its sequence ratio, as the VESPO authors' verl loss does; docs/math.md §7) |
| `tau_pos` / `tau_neg` | `sapo_tau_pos` / `sapo_tau_neg` of `sapo` (whose `loss_agg_mode` is always `"seq-mean-token-mean"`, as verl's `sapo`) |
| `clip_ratio_c` | `ratio_cap` of `dppo_tv` / `dppo_kl` (verl: `config.get("clip_ratio_c", 20.0)`) |
| `policy_loss.clip_cov_ratio` / `clip_cov_lb` / `clip_cov_ub` | the same fields of `clip_cov` |
| `policy_loss.kl_cov_ratio` / `ppo_kl_coef` | `kl_cov_ratio` / `kl_cov_coef` of `kl_cov` |
| `policy_loss.dro_beta` | `dro_beta` of `dro` (required, as by verl's `dro`) |
| `policy_loss.vespo.k_pos` / `lambda_pos` / `k_neg` / `lambda_neg` | `vespo_k_pos` / ... of `vespo` (the keys the VESPO authors' verl loss reads; absent: the preset's) |
| `policy_loss.<name>` (or its `verl_keys=` key) | a plug-in's own scalar `<name>` (`register_objective(scalars=...)`; absent: the preset's; its range checked under verl's key) |

The counts come from `config.global_batch_info` (verl fills `dp_size`, `batch_num_tokens`,
`global_batch_size`; when absent they are the micro-batch's own, as in verl's `agg_loss`).
The KL and entropy terms are 0 here: verl adds them outside the policy loss (`actor.use_kl_loss` with
`kl_loss_type`, `entropy_coeff`). `kl_estimator(kl_loss_type)` names rlkernels' estimator equal to verl's
(docs/math.md §6): `low_var_kl`/`k3` is `"low_var_kl"` (k3 clamped to ±10, not the `grpo` preset's unclamped
`"k3"`), `kl`/`k1` is `"kl"`, `mse`/`k2` is `"mse"`, `abs` is `"abs"`, and each `+` form is the same name with `+`.
`**overrides` of `register()` / `policy_loss_fn()` replace any field last.

verl's own losses and these: `vanilla` = `rlkernels_ppo` (verl always applies the dual clip;
`clip_ratio_c` very large turns it off, = `rlkernels_dapo`/`grpo` with verl's clip ratios);
`gspo` = `rlkernels_gspo_token` (and `rlkernels_gspo`: the same value and gradient, with
`rollout_is_weights` too); `cispo` = `rlkernels_cispo`; `geo_mean` =
`rlkernels_gmpo` under `seq-mean-token-mean` (verl's `geo_mean` ignores `loss_agg_mode` and
averages over all rows, empty ones included: `rlkernels_geo_mean` does exactly that);
`register()` also adds `rlkernels_vanilla` (= `rlkernels_ppo`), `rlkernels_geo_mean` and
`rlkernels_bypass_mode` (`bypass_mode_fn`: verl's rejection sampling and IS weights from
`policy_loss.rollout_correction`, then REINFORCE or PPO-clip against the sampler's log-probs), so
every verl mode has an `rlkernels_` twin under its name;
`sapo`, `gpg`, `dppo_tv`, `dppo_kl`, `clip_cov`,
`kl_cov`, `dro` = `rlkernels_<same name>` (Clip-Cov draws its tokens from torch's RNG as verl
does: the same state, the same tokens). Differences in guards: rlkernels clamps every
exponentiated log-ratio to ±20 (verl's `gspo` clamps at +10, `geo_mean` not at all) and gives 0,
not NaN, for an empty mask. In metrics: a token whose rollout weight is 0 (IcePop) is not counted
in `actor/pg_clipfrac` (docs/math.md §10; verl counts it).
"""
from __future__ import annotations

import functools
import math
import re
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from .. import presets as _presets
from .._checks import check_mask, check_real, check_tensor
from . import PRESET_PREFIX as PREFIX, _versions
from ..losses import PolicyLossConfig, objectives as _objectives, policy_loss, rollout_rejection_mask
from ..losses import rollout_is_weights as is_weights_of  # verl's argument takes the name
from ..losses.spec import masked_mean
from .verl_fused import FusedLinearForPPO, linear_cross_entropy, patch_fused_kernels

# verl 0.9.1's policy-loss modes whose preset has another name (sapo, gspo, gpg, dppo_*, clip_cov, kl_cov,
# dro and cispo are presets of the same name); `register()` adds rlkernels_<mode> for them too.
VERL_MODES = {"vanilla": "ppo", "geo_mean": "gmpo"}


# verl's kl_penalty names → rlkernels' estimator computing the same (verl's k1, k2 do not clamp Δ; its k3 clamps k3)
_VERL_KL = {"kl": "kl", "k1": "kl", "mse": "mse", "k2": "mse", "abs": "abs", "low_var_kl": "low_var_kl",
            "k3": "low_var_kl"}


def kl_estimator(kl_loss_type: str) -> str:
    """The `PolicyLossConfig.kl_estimator` equal to verl's `kl_penalty(..., kl_loss_type)`, value and gradient."""
    base = kl_loss_type[:-1] if isinstance(kl_loss_type, str) and kl_loss_type.endswith("+") else kl_loss_type
    if base not in _VERL_KL:
        raise ValueError(f"kl_loss_type: expected one of {tuple(_VERL_KL)}, optionally with '+', got {kl_loss_type!r} "
                         "('full' needs whole distributions; verl 0.9.1 does not implement it either)")
    return _VERL_KL[base] + kl_loss_type[len(base):]


def _get(config, name, default=None):
    """A field of verl's ActorConfig, an omegaconf DictConfig or a dict."""
    if config is None:
        return default
    if hasattr(config, "get"):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _number(field: str, value, positive: bool = False) -> float:
    """A number of verl's config (or its text) as a finite float, > 0 when `positive`; errors name the field."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: expected a number, got {value!r}") from None
    return check_real(field, number, 0.0 if positive else None, lo_open=True)


def aggregation(loss_agg_mode: str, mask: torch.Tensor, config=None) -> Tuple[dict, dict]:
    """(config fields, counts for `policy_loss`) that reproduce verl's `agg_loss(loss_agg_mode, **global_batch_info)`."""
    info = dict(_get(config, "global_batch_info", {}) or {})
    dp = _number("global_batch_info.dp_size", info.get("dp_size") or 1, positive=True)
    tokens, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    seqs = None if seqs is None else _number("global_batch_info.global_batch_size", seqs, positive=True) / dp
    if loss_agg_mode == "token-mean":
        tokens = None if tokens is None else _number("global_batch_info.batch_num_tokens", tokens, positive=True) / dp
        return {"agg": "token_mean"}, {"num_items": tokens, "num_seqs": None}
    if loss_agg_mode == "token-sum":
        return {"agg": "token_mean"}, {"num_items": 1.0 / dp, "num_seqs": None}
    if loss_agg_mode == "seq-mean-token-sum":
        return {"agg": "seq_mean_token_sum"}, {"num_items": None, "num_seqs": seqs}
    if loss_agg_mode == "seq-mean-token-mean":
        return {"agg": "seq_mean_token_mean"}, {"num_items": None, "num_seqs": seqs}
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = info.get("loss_scale_factor", _get(config, "loss_scale_factor"))
        scale = _number("loss_scale_factor", mask.shape[-1] if scale is None else scale, positive=True)
        if scale != int(scale):
            raise ValueError(f"loss_scale_factor: expected a positive integer, got {scale!r}")
        return {"agg": "constant", "norm_length": int(scale)}, {"num_items": None, "num_seqs": seqs}
    raise ValueError(
        "loss_agg_mode: expected one of 'token-mean', 'token-sum', 'seq-mean-token-sum', "
        f"'seq-mean-token-mean', 'seq-mean-token-sum-norm', got {loss_agg_mode!r}"
    )


def loss_config(preset: str, config=None, **overrides) -> PolicyLossConfig:
    """The preset with verl's settings (module docstring), KL and entropy off, then `overrides`."""
    base = _presets.fields(preset)
    fields = {"kl_estimator": None, "kl_coef": 0.0, "entropy_coef": 0.0}
    if config is not None and _takes_verl_clip(base):
        clip = _get(config, "clip_ratio")
        fields["clip_low"] = _get(config, "clip_ratio_low", clip if clip is not None else base.get("clip_low"))
        fields["clip_high"] = _get(config, "clip_ratio_high", clip if clip is not None else base.get("clip_high"))
    if base.get("dual_clip") is not None:
        fields["dual_clip"] = _number("clip_ratio_c", _get(config, "clip_ratio_c", base["dual_clip"]))
    if base.get("ratio") in _objectives.GROUPED_RATIOS and _get(config, "rollout_n") is not None:
        fields["group_size"] = int(_get(config, "rollout_n"))
    if config is not None:
        fields.update(_objective_fields(preset, base["objective"], config, overrides))
    return _presets.get(preset, **{**fields, **overrides})


def _takes_verl_clip(preset_fields: dict) -> bool:
    """Whether verl's clip_ratio_low/high are the preset's clip_low/clip_high: its objective reads them (its
    registry entry's `clip`: a plug-in's too), except FSPO's trajectory ratio, whose band is fspo_c_low/high."""
    objective = preset_fields["objective"]
    return _objectives.get(objective).clip is not None and not (
        objective == "clip" and preset_fields.get("ratio") == "sequence_sum")


def _objective_fields(preset: str, objective: str, config, overrides) -> dict:
    """The fields and scalars of the objective that verl's ActorConfig sets, by the keys of its registry entry
    (`Objective.verl`), as verl's own loss functions read them; absent, verl's default or the preset's."""
    entry = _objectives.get(objective)
    fields = dict(entry.verl.fixed)
    for field, (key, default) in entry.verl.keys.items():
        value = _lookup(config, key)
        if value is None and field in entry.required and field not in overrides:
            raise ValueError(f"{key}: required (a positive value) for {PREFIX}{preset}, as for verl's {objective}")
        value = default if value is None else value
        if value is not None:
            fields[field] = _number(key, value)
            if field in entry.scalars:  # its range, under verl's name
                _objectives.check_scalar(key, fields[field], entry.scalars[field])
    return fields


def _lookup(config, key: str):
    """verl's setting at dotted `key` ("policy_loss.vespo.k_pos"), or None."""
    for part in key.split("."):
        config = _get(config, part)
    return config


def verl_mode_fn(mode: str, **overrides) -> Callable:
    """verl's policy-loss mode `mode`, under verl's name, computed by its preset. `geo_mean` also
    aggregates as verl's does: the mean over the micro-batch's rows, empty ones included, whatever
    `loss_agg_mode` and the global counts say."""
    if mode not in VERL_MODES:
        return policy_loss_fn(mode, **overrides)
    fn = policy_loss_fn(VERL_MODES[mode], _all_rows=mode == "geo_mean", **overrides)
    fn.__name__ = f"{PREFIX}{mode}"
    return fn


def policy_loss_fn(preset: str, _all_rows: bool = False, **overrides) -> Callable:
    """A verl policy loss (verl's signature and return value) for `preset`."""
    _presets.fields(preset)  # validates the name

    def loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        mask = _mask(response_mask)
        if rollout_is_weights is not None:
            check_tensor("rollout_is_weights", rollout_is_weights, shape=tuple(response_mask.shape),
                         device=response_mask.device)
        if _all_rows:
            agg_fields, counts = {"agg": "seq_mean_token_mean"}, {"num_items": None,
                                                                  "num_seqs": float(response_mask.shape[0])}
        else:
            fixed = _objectives.get(_presets.fields(preset)["objective"]).verl.loss_agg_mode
            agg_fields, counts = aggregation(fixed or loss_agg_mode, response_mask, config)
        cfg = loss_config(preset, config, **{**agg_fields, **overrides})
        logp = log_prob if log_prob.dtype in (torch.float32, torch.float64) else log_prob.float()
        advantages = advantages.to(logp.dtype)
        kwargs = dict(old_logp=old_log_prob.to(logp.dtype), **counts)
        if cfg.ratio == "snis":  # SNIS takes rewards: verl's per-row "advantage" is read as the reward
            kwargs["rewards"] = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            advantages = None
        if rollout_is_weights is not None:
            cfg, kwargs["is_weights"] = _rollout_weights(cfg, rollout_is_weights.to(logp.dtype), mask)
        out = policy_loss(logp, advantages, mask, cfg, **kwargs)
        return out.loss, _metrics(out.metrics, logp, old_log_prob, advantages, mask, cfg)

    loss_fn.__name__ = f"{PREFIX}{preset}"
    loss_fn.__doc__ = f"verl policy loss for the rlkernels `{preset}` preset (rlkernels.integrations.verl)."
    return _in_verl_terms(loss_fn, preset)


# rlkernels' words in loss errors, and verl's: a verl user chooses loss_mode and passes (B, T) advantages
_VERL_WORDS = (("one advantage per row", "one advantage per response"),
               ("a (B, T) advantage varies within a row",
                "the advantages vary within a response (per-token advantages, e.g. algorithm.adv_estimator=gae)"),
               ("pass (B,) advantages, or use", "use"),
               ("needs group_ids or config.group_size", "needs the group size, actor.rollout_n (verl sets it from "
                                                        "actor_rollout_ref.rollout.n)"))


def _in_verl_terms(loss_fn: Callable, preset: str) -> Callable:
    """`loss_fn` whose ValueErrors name verl's settings: `ratio='sequence_token'` becomes the loss_mode with that
    ratio (`loss_mode=rlkernels_gspo_token`), this preset's own first."""
    def mode(match):
        ratio = match.group(1)
        names = [preset] + list(_presets.NAMES)
        name = next((n for n in names if _presets.fields(n).get("ratio") == ratio), None)
        return f"loss_mode={PREFIX}{name}" if name else match.group(0)

    @functools.wraps(loss_fn)
    def verl_loss(*args, **kwargs):
        try:
            return loss_fn(*args, **kwargs)
        except ValueError as e:
            message = str(e)
            for ours, verls in _VERL_WORDS:
                message = message.replace(ours, verls)
            raise ValueError(re.sub(r"ratio='(\w+)'", mode, message)) from None

    return verl_loss


def _mask(response_mask: torch.Tensor) -> torch.Tensor:
    """verl's `response_mask` as a bool mask. verl weights each token by a fractional mask; rlkernels' losses take
    0/1 masks, so other values are refused (checked on the device)."""
    return check_mask("response_mask", check_tensor("response_mask", response_mask, ndim=2))


def _rollout_weights(cfg: PolicyLossConfig, weights: torch.Tensor, mask: torch.Tensor):
    """(config, `is_weights`) with which `policy_loss` applies verl's `rollout_is_weights` as verl's
    losses do (`pg_losses * rollout_is_weights`, then `agg_loss`), where `is_weights` alone would not.

    A sequence ratio (`gspo`, `luspo`) is evaluated in its GSPO-token form, as verl's `gspo`: the same
    value, and the weight of token t scales the gradient of ℓ_t alone (through the sequence ratio,
    each token's gradient would carry the mean of its row's weights). `vespo` needs nothing: it takes
    the weights into its sequence ratio, as the VESPO authors' verl loss does (docs/math.md §7)."""
    if cfg.ratio == "sequence" and cfg.objective != "cispo":  # CISPO's loss is per token already
        cfg = cfg.replace(ratio="sequence_token")
    if cfg.ratio == "geometric":  # verl's geo_mean: one weight per row, the geometric mean of its tokens'
        log_w = torch.where(mask, torch.log(weights + 1e-10), weights.new_zeros(()))
        weights = torch.exp(log_w.sum(-1) / (mask.sum(-1) + 1e-8))
    return cfg, weights


def _metrics(metrics, logp, old_logp, advantages, mask, cfg) -> Dict[str, float]:
    """verl's three policy-loss metrics, then every rlkernels metric under `actor/rlkernels/`."""
    with torch.no_grad():
        log_ratio = (logp.detach() - old_logp.to(logp.dtype)).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        lower = torch.zeros((), dtype=logp.dtype, device=logp.device)
        if cfg.dual_clip is not None and cfg.ratio == "token" and advantages is not None:
            adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
            w = log_ratio.exp()
            clipped = torch.maximum(-adv * w, -adv * w.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
            lower = masked_mean(((clipped > -cfg.dual_clip * adv) & (adv < 0)).to(logp.dtype), mask)
        out = {
            "actor/pg_clipfrac": float(metrics["clip_frac"]),
            "actor/ppo_kl": float(masked_mean(-log_ratio, mask)),
            "actor/pg_clipfrac_lower": float(lower),
        }
    out.update({f"actor/rlkernels/{k}": float(v) for k, v in metrics.items()})
    return out


def bypass_mode_fn(**overrides) -> Callable:
    """verl's `bypass_mode`: `old_log_prob` is the sampler's, and `policy_loss.rollout_correction` says
    what to do with the gap. Its rejection tests (`rollout_rs` / `rollout_rs_threshold`) shrink the
    mask; then `loss_type="reinforce"` is `rlkernels_gpg` (−A·ℓ) weighted by the IS weights of
    `rollout_is` / `rollout_is_threshold` / `rollout_is_batch_normalize` (none without `rollout_is`),
    and `"ppo_clip"` (verl's default) is `rlkernels_vanilla` against the sampler's log-probs, unweighted
    (its ratio is the correction)."""
    reinforce, ppo_clip = policy_loss_fn("gpg", **overrides), policy_loss_fn("ppo", **overrides)

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        rc = _get(_get(config, "policy_loss"), "rollout_correction")
        if rc is None:
            raise ValueError("policy_loss.rollout_correction: required by rlkernels_bypass_mode, as by verl's bypass_mode")
        loss_type = _get(rc, "loss_type", "ppo_clip")
        if loss_type not in ("reinforce", "ppo_clip"):
            raise ValueError(f"rollout_correction.loss_type: expected 'reinforce' or 'ppo_clip', got {loss_type!r}")
        with torch.no_grad():  # verl's ratio here: the current policy over the sampler's
            current, mask = log_prob.detach(), _mask(response_mask)
            kept = mask
            if _get(rc, "rollout_rs") is not None:
                kept = _rejection_mask(current, old_log_prob, mask, _get(rc, "rollout_rs"), _get(rc, "rollout_rs_threshold"))
            weights = None
            if loss_type == "reinforce" and _get(rc, "rollout_is") is not None:
                weights = is_weights_of(current, old_log_prob, mask, level=_get(rc, "rollout_is"),
                                        batch_normalize=bool(_get(rc, "rollout_is_batch_normalize", False)),
                                        **_is_bounds(_get(rc, "rollout_is_threshold", 2.0)))
        kept = kept.to(response_mask.dtype)
        if loss_type == "reinforce":
            return reinforce(old_log_prob, log_prob, advantages, kept, loss_agg_mode, config, weights)
        return ppo_clip(old_log_prob, log_prob, advantages, kept, loss_agg_mode, config, None)

    loss_fn.__name__ = f"{PREFIX}bypass_mode"
    return loss_fn


def _is_bounds(threshold) -> dict:
    """`rollout_is_weights` bounds from verl's `rollout_is_threshold`: a number truncates at it, "lower_upper"
    keeps the weights inside the band and zeroes the others (IcePop)."""
    field = "rollout_correction.rollout_is_threshold"
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (_number(field, x, positive=True) for x in threshold.split("_", 1))
        return dict(mode="mask", lower=lower, upper=upper)
    return dict(mode="truncate", upper=_number(field, threshold, positive=True))


def _rejection_mask(current, rollout, mask, options: str, thresholds):
    """verl's `rollout_rs`: every comma-separated option (`token_k1`, `seq_mean_k3`, ...) a test of
    `rollout_rejection_mask` on the same mask, all of them kept. A k1 option's threshold is "lower_upper"
    in ratio space (a single value u: 1/u_u), compared in log space; the others' a single upper bound."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if thresholds is None:
        raise ValueError("rollout_correction.rollout_rs_threshold: required with rollout_rs, as by verl")
    specs = [t.strip() for t in str(thresholds).split(",") if t.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_correction.rollout_rs_threshold: expected 1 or {len(names)} thresholds, got {thresholds!r}")
    specs = specs * len(names) if len(specs) == 1 else specs
    kept = mask
    for name, spec in zip(names, specs):
        level, _, estimator = name.rpartition("_")
        if level not in ("token", "seq_sum", "seq_mean", "seq_max") or estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"rollout_correction.rollout_rs: unknown option {name!r}")
        field = f"rollout_correction.rollout_rs_threshold ({name})"
        if estimator == "k1":
            low, _, high = spec.rpartition("_")
            high = _number(field, high, positive=True)
            low = _number(field, low, positive=True) if low else 1.0 / high
            if not low <= high:
                raise ValueError(f"{field}: expected 0 < lower <= upper, got {spec!r}")
            bounds = dict(lower=math.log(low), upper=math.log(high))
        else:
            if "_" in spec:
                raise ValueError(f"{field}: expected one positive bound, got {spec!r}")
            bounds = dict(upper=_number(field, spec, positive=True))
        kept = kept & rollout_rejection_mask(current, rollout, mask, estimator=estimator, level=level,
                                                                **bounds)
    return kept


class _PresetLosses(dict):
    """verl's registry of policy losses (`core_algos.POLICY_LOSS_REGISTRY`, which `register_policy_loss` writes and
    `get_policy_loss_fn` reads with `in`, `[]` and `keys()`), in which `prefix + name` is a verl loss for every
    preset `presets.NAMES` holds when verl looks it up: registered after `register()` or before, and gone once
    unregistered. An entry stored under the same name (verl's, or `register(presets=[...])`'s) wins."""

    def __init__(self, entries):
        super().__init__(entries)
        self.prefixes = {}  # prefix -> overrides of the register() call that made it

    def _preset(self, key) -> Optional[Tuple[str, dict]]:
        """(preset, overrides) that `key` names now, or None."""
        for prefix, overrides in self.prefixes.items():
            if isinstance(key, str) and key.startswith(prefix) and key[len(prefix):] in _presets.NAMES:
                return key[len(prefix):], overrides
        return None

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or self._preset(key) is not None

    def __missing__(self, key):
        found = self._preset(key)
        if found is None:
            raise KeyError(key)
        return policy_loss_fn(found[0], **found[1])

    def get(self, key, default=None):
        return self[key] if key in self else default

    def keys(self) -> list:
        looked_up = [prefix + name for prefix in self.prefixes for name in _presets.NAMES]
        return list(dict.fromkeys([*super().keys(), *looked_up]))


def register(presets: Optional[Iterable[str]] = None, prefix: str = PREFIX, fused_kernels: bool = False,
             **overrides) -> list:
    """Register `prefix + name` for each preset (default: all, those a user registers later included: see
    `_PresetLosses`) with verl; returns the names registered. `fused_kernels=True`: also route verl's fused-kernel
    log-prob/entropy path (`use_fused_kernels=True`) through rlkernels' hidden-state op
    (`verl_fused.patch_fused_kernels`); off by default, so that registering the losses changes nothing else in verl."""
    _versions.check("verl")
    from verl.trainer.ppo import core_algos

    if fused_kernels:
        patch_fused_kernels()
    chosen = list(_presets.NAMES if presets is None else presets)
    names = [prefix + preset for preset in chosen]
    if presets is None:  # resolved at lookup (these overrides win over an earlier call's, as a re-registration)
        if not isinstance(core_algos.POLICY_LOSS_REGISTRY, _PresetLosses):
            core_algos.POLICY_LOSS_REGISTRY = _PresetLosses(core_algos.POLICY_LOSS_REGISTRY)
        core_algos.POLICY_LOSS_REGISTRY.prefixes[prefix] = overrides
        for name in names:
            core_algos.POLICY_LOSS_REGISTRY.pop(name, None)
    else:
        for preset, name in zip(chosen, names):
            core_algos.register_policy_loss(name)(policy_loss_fn(preset, **overrides))
    for mode, preset in VERL_MODES.items():  # verl's own names for the same losses
        if preset in chosen:
            core_algos.register_policy_loss(prefix + mode)(verl_mode_fn(mode, **overrides))
            names.append(prefix + mode)
    if {"gpg", "ppo"} <= set(chosen):  # bypass_mode's two losses
        core_algos.register_policy_loss(prefix + "bypass_mode")(bypass_mode_fn(**overrides))
        names.append(prefix + "bypass_mode")
    return names


__all__ = ["register", "policy_loss_fn", "verl_mode_fn", "VERL_MODES", "loss_config", "aggregation", "PREFIX",
           "kl_estimator", "patch_fused_kernels", "linear_cross_entropy", "FusedLinearForPPO"]
