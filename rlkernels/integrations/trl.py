"""TRL's `GRPOTrainer` with rlkernels' hidden-state path: `apply()` (every `trl.GRPOTrainer` built afterwards
in this process: scripts, `accelerate launch` recipes, and TRL's GRPO script through `rlkernels trl grpo`),
`RLKernelsGRPOTrainer`, or `patch_trl_grpo_trainer(trainer)` on a trainer already built.

Either way two methods change:
* `_get_per_token_logps_and_entropies` (old and reference log-probs, and the log-probs of
  TRL's own loss when that is used): `linear_token_logprobs` on the backbone's last hidden
  state, never the `(B, T, V)` logits.
* `_compute_loss`: one `fused_linear_policy_loss` call from the hidden states to the loss, its
  gradients for the hidden states and the head computed in the same pass (token-level
  importance sampling) or in a second one (sequence level), with the aggregation set so that
  value and gradient equal TRL's, gradient accumulation included.

TRL's loss in `PolicyLossConfig` terms (`ε_low = epsilon`, `ε_high = epsilon_high or epsilon`,
`delta`, KL `k3` with `kl_coef = beta` (`use_bias_correction_kl` → `kl_bias_correction`, the KL
times the token ratio with its gradient, at sequence level the row's sequence ratio:
`kl_bias_ratio="sequence"`); `importance_sampling_level` token → `ratio="token"`,
sequence → `ratio="sequence"`, whose row loss is broadcast to the row's tokens, as TRL does).
vLLM importance sampling correction (on by default with `use_vllm`): TRL's
`importance_sampling_ratio`, in any of its four modes, is passed as `is_weights` (docs/math.md §7);
`off_policy_mask_threshold` → `off_policy_mask`, read against `sampling_per_token_logps` when TRL has them;
`top_entropy_quantile` → `top_entropy_quantile`.
`B` = rows of the micro-batch (empty rows included, as TRL's `.mean()`), `G` = gradient
accumulation steps in training (1 in evaluation):

| `loss_type` | `agg` | counts | preset it differs from (docs/math.md §9) |
|---|---|---|---|
| `grpo` | `seq_mean_token_mean` | `num_seqs = B·G` | `grpo` (TRL's β defaults to 0) |
| `bnpo` | `token_mean` | `num_items = max(local tokens, 1)·G` | none (local-batch token mean) |
| `dr_grpo` | `constant`, `norm_length = max_completion_length` | `num_seqs = B·G` | `dr_grpo` (norm = padded T) |
| `dapo` | `token_mean` | `num_items = num_items_in_batch / processes · G / steps_per_generation` (train) | `dapo` (global count) |
| `cispo` | `objective="cispo"`, `clip_low=None`, `clip_high = epsilon_high − 1` (ε_high < 1 too; at sequence level the cap applies to the sequence ratio) | as `dapo` | `cispo` (TRL caps at ε_high) |
| `sapo` | `objective="sapo"`, τ± = `sapo_temperature_pos/neg`, `seq_mean_token_mean` | as `grpo` | `sapo` |
| `luspo` | clip as `grpo`, `seq_mean_token_sum` | as `grpo` | `luspo` (TRL's ε) |
| `vespo` | `ratio="sequence_sum"`, `objective="vespo"`, TRL's `vespo_k_*`/`vespo_lambda_*` | as `dapo` | `vespo` |
| `rlkernels_<preset>` | the preset as declared (a user's too: `presets.register`), its `agg` | by its `agg`: `token_mean` as `dapo`, `seq_mean_*` as `grpo`, `constant` as `dr_grpo` (`norm_length` default `max_completion_length`) | itself |

`loss_type="rlkernels_<preset>"` selects any registered preset, a user's plug-in objective included (TRL does not
check `loss_type`, so `GRPOConfig`, recipes and `rlkernels trl grpo --loss_type` take it). The preset chooses the
loss: its objective, ratio, clip and aggregation; TRL's `epsilon`, `epsilon_high`, `delta` and
`importance_sampling_level` (but for the ratio of `use_bias_correction_kl`, as in TRL) are its own loss types'
settings and do not apply. The arguments the objective's registry entry names (`Objective.trl`: `sapo_temperature_*`
for `sapo`, `vespo_*` for `vespo`, a plug-in's scalar `<name>` on a user's args) set its fields, where the args
carry them. TRL supplies the rest, as for its own loss types: β (the preset's KL
replaced by TRL's k3 with `kl_coef = beta`, none at β = 0, when TRL has no reference model), the entropy bonus, the off-policy and top-entropy masks, vLLM's IS weights and the
counts. An unknown preset is a ValueError when the trainer is built; so are the presets whose ratio needs whole
prompt groups in each micro-batch (`gepo`, `snis`: TRL shuffles rows across micro-batches), and the batches TRL would
otherwise compute itself (below): TRL has no such loss.

The entropy bonus is mapped for every loss type: TRL normalises it as a token mean of its own,
`entropy_agg="token_mean"` with c_H = coef / G, over the high-entropy tokens alone with
`top_entropy_quantile < 1` (the tokens the policy term acts on, as TRL restricts it); its adaptive
coefficient is moved as TRL moves it; TRL's `policy_loss` and `entropy_coef` metrics.
`top_entropy_quantile < 1` on several processes takes its quantile over every process's tokens, as TRL
does (`entropy_quantile_group`). Everything else runs TRL's own `_compute_loss` on rlkernels' log-probs,
with a warning that says why: a MoE auxiliary loss of a model that does not form it with its module's
`load_balancing_loss_func` (Mixtral, Qwen-MoE, OLMoE, ... do: their backbone's router logits give
it, added as TRL adds it); multimodal inputs. Why multimodal batches (`pixel_values`, `image_grid_thw`, ...) stay with TRL:
rlkernels' head needs the decoder's final hidden states and runs the decoder itself
(`backbone_outputs`: `model.model(input_ids, attention_mask)`), but a vision-language model
encodes the images and merges their features into the token embeddings inside its
`*ForConditionalGeneration.forward`, differently for each family (Qwen2-VL's `image_grid_thw` and
3-D positions, Gemma 3's token types, ...); calling that forward for its hidden states would also
compute the full logits the head exists to avoid. So such batches take TRL's own path, whole.
A head's announced logit scale is folded into the temperature and a final-logit cap (Gemma 2/3) is
the kernels' `softcap`; other heads that are not a plain linear layer are rejected with a
ValueError (`integrations/transformers.py`), by their config attribute or, when none announces the
transform, by `check_head` on the first batch (rlkernels' log-probs against `model(...).logits`).

The head's matmul runs in the dtype TRL's runs in: the autocast dtype under autocast (TRL's
default `bf16=True`), fp32 with `cast_lm_head_to_fp32`, else the weight's. Small differences:
rlkernels clamps log-ratios to ±20 in the loss (TRL does not). The metrics are TRL's, by TRL's
definitions (the clip ratios and VESPO's mean φ from the log-probs the fused pass returns). (TRL ≥ 1.x also avoids full logits for its log-probs,
with its own chunked head; what this adds is the loss and its gradient in the same pass, and one
tested definition.)
"""
from __future__ import annotations

import functools
import logging
import types
import warnings
from typing import Optional, Tuple

import torch

from . import PRESET_PREFIX, _versions

_versions.check("trl")
from trl import GRPOTrainer  # noqa: E402

# TRL's own methods, which the fallbacks below call: `apply()` replaces them on the class itself
_TRL_LOGPS, _TRL_LOSS = GRPOTrainer._get_per_token_logps_and_entropies, GRPOTrainer._compute_loss

from .. import presets as _presets
from ..losses import PolicyLossConfig
from ..losses import objectives as _objectives
from ..losses.objectives import GROUPED_RATIOS
from ..losses.spec import high_entropy_tokens, vespo_weight
from ..ops import fused_linear_policy_loss, linear_token_logprobs
from .transformers import (backbone_outputs, check_head, last_hidden_state, moe_aux_loss_function,
                           output_head)

_AGG = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "constant", "dapo": "token_mean",
        "cispo": "token_mean", "sapo": "seq_mean_token_mean", "luspo": "seq_mean_token_sum", "vespo": "token_mean"}
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
# the TRL loss type whose normaliser a preset's aggregation takes (`_counts`)
_AGG_COUNTS = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum": "grpo", "constant": "dr_grpo"}
# keyword arguments of a causal LM's forward that belong to its head, not to the backbone
_HEAD_KWARGS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "fused_lm_head", "return_dict")


def preset_of(loss_type) -> Optional[str]:
    """The preset `loss_type="rlkernels_<preset>"` selects; None for TRL's own loss types."""
    if not (isinstance(loss_type, str) and loss_type.startswith(PRESET_PREFIX)):
        return None
    name = loss_type[len(PRESET_PREFIX):]
    if name not in _presets.NAMES:
        raise ValueError(f"loss_type: expected one of TRL's {tuple(_AGG)} or {PRESET_PREFIX}<preset> with a registered "
                         f"preset (presets.register), one of {_presets.NAMES}; got {loss_type!r}")
    return name


def _loss_type_error(loss_type, why) -> ValueError:
    return ValueError(f"loss_type={loss_type!r}: rlkernels cannot compute it here because of {why}, and TRL has no "
                      "such loss to fall back on")


def loss_config(trainer) -> Tuple[Optional[PolicyLossConfig], str]:
    """(the `PolicyLossConfig` equal to the trainer's loss, "") or (None, why TRL's own loss is kept). A preset
    (`rlkernels_<preset>`) has no TRL loss to keep: what would keep TRL's is a ValueError."""
    args, loss_type = trainer.args, trainer.loss_type
    level = trainer.importance_sampling_level
    preset = preset_of(loss_type)
    reasons = [
        (preset is None and loss_type not in _AGG, f"loss_type={loss_type!r}"),
        (getattr(trainer, "aux_loss_enabled", False) and moe_aux_loss_function(_models(trainer)[0]) is None,
         "a MoE auxiliary loss the model does not form with load_balancing_loss_func"),
        (preset is None and level not in ("token", "sequence"), f"importance_sampling_level={level!r}"),
    ]
    for hit, why in reasons:
        if hit and preset is not None:
            raise _loss_type_error(loss_type, why)
        if hit:
            return None, why
    kl = dict(kl_estimator=None, kl_coef=0.0)
    if trainer.beta != 0.0:
        kl = dict(kl_estimator="k3", kl_coef=float(trainer.beta),
                  kl_bias_correction=bool(getattr(args, "use_bias_correction_kl", False)),
                  kl_bias_ratio="sequence" if level == "sequence" else "token")  # TRL's coef_1 at either level
    masks = {}  # of the policy term (docs/math.md §7)
    if trainer.off_policy_mask_threshold is not None:
        masks["off_policy_mask"] = float(trainer.off_policy_mask_threshold)
    if trainer.top_entropy_quantile < 1.0:
        masks["top_entropy_quantile"] = float(trainer.top_entropy_quantile)
    if preset is not None:
        own = _trl_arguments(args, _presets.fields(preset)["objective"])
        return _preset_config(trainer, preset, {**own, **kl, **masks}), ""
    ratio = level
    if loss_type == "cispo":
        clip = dict(objective="cispo", clip_low=None, clip_high=trainer.epsilon_high - 1.0)
    elif loss_type == "sapo":
        clip = dict(objective="sapo", **_trl_arguments(args, "sapo"))
    elif loss_type == "vespo":  # its own sequence ratio Σ_t log(π/π_old), whatever the level
        ratio = "sequence_sum"
        clip = dict(objective="vespo", **_trl_arguments(args, "vespo"))
    else:
        clip = dict(objective="clip", clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high, delta=args.delta)
    norm = dict(norm_length=trainer.max_completion_length) if loss_type == "dr_grpo" else {}
    try:
        cfg = PolicyLossConfig(ratio=ratio, agg=_AGG[loss_type], **clip, **kl, **norm, **masks)
    except (TypeError, ValueError) as err:  # e.g. delta <= 0, which TRL does not check
        return None, str(err)
    return cfg, ""


def _trl_arguments(args, objective: str) -> dict:
    """The fields and scalars of `objective` that the trainer's args set: the `GRPOConfig` arguments its registry
    entry names (`Objective.trl`: TRL's own, or a plug-in's scalar's, on a user's args), those that are set."""
    names = _objectives.get(objective).trl
    return {field: getattr(args, arg) for field, arg in names.items() if getattr(args, arg, None) is not None}


def _preset_config(trainer, preset, trl_fields) -> PolicyLossConfig:
    """`preset` as declared, with TRL's KL and masks (`trl_fields`) and, for a constant divisor the preset leaves
    open, TRL's `max_completion_length` (as its `dr_grpo`)."""
    fields = _presets.fields(preset)
    if fields.get("ratio") in GROUPED_RATIOS:
        raise _loss_type_error(trainer.loss_type, f"ratio={fields['ratio']!r}, which needs whole prompt groups in "
                                                  "each micro-batch (TRL shuffles rows across them)")
    if fields.get("agg") == "constant" and fields.get("norm_length") is None:
        trl_fields = {**trl_fields, "norm_length": trainer.max_completion_length}
    try:
        return _presets.get(preset, **trl_fields)
    except (TypeError, ValueError) as err:
        raise _loss_type_error(trainer.loss_type, f"TRL's settings: {err}") from None


def _normaliser(trainer, cfg) -> str:
    """The TRL loss type whose normaliser (`_counts`) and logging the loss takes: its own, or a preset's by `agg`."""
    return trainer.loss_type if preset_of(trainer.loss_type) is None else _AGG_COUNTS[cfg.agg]


def _quantile_group(trainer):
    """The process group of `top_entropy_quantile`'s quantile: every process, as TRL gathers them (None: one)."""
    return torch.distributed.group.WORLD if trainer.accelerator.num_processes > 1 else None


def _entropy_coef(trainer) -> float:
    """c_H of the coefficient TRL applies now, as rlkernels' separately aggregated entropy term; 0 without a bonus
    (TRL's adaptive bonus is off while the last window's entropy is above its target)."""
    if not getattr(trainer, "_entropy_bonus_enabled", False):
        return 0.0
    if getattr(trainer, "use_adaptive_entropy", False) and trainer._last_world_entropy > trainer.args.entropy_target:
        return 0.0
    accum = trainer.current_gradient_accumulation_steps if trainer.model.training else 1.0
    return float(trainer.entropy_coef) / accum


def _adapt_entropy_coef(trainer, entropy_sum, count) -> None:
    """TRL's adaptive entropy coefficient: the micro-batches' entropy sums and token counts add up over the
    accumulation window; at its optimizer step the window's mean over every process moves the coefficient one
    `entropy_coef_delta` up (entropy at or below `entropy_target`) or down, within its bounds."""
    stats = torch.stack([entropy_sum, count]).detach()
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if not trainer.accelerator.sync_gradients:
        return
    totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
    world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
    args = trainer.args
    if world_entropy <= args.entropy_target:
        trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
    else:
        trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
    trainer._last_world_entropy, trainer._entropy_window_stats = world_entropy, None


def _counts(trainer, loss_type, mask, inputs) -> dict:
    """num_items / num_seqs that turn our aggregation into TRL's normaliser for this micro-batch."""
    train = trainer.model.training
    accum = trainer.current_gradient_accumulation_steps if train else 1
    rows = mask.shape[0]
    if loss_type in ("grpo", "dr_grpo", "sapo", "luspo"):
        return {"num_seqs": float(rows * accum)}
    if loss_type == "bnpo":
        return {"num_items": max(float(mask.sum()), 1.0) * accum}
    items = max(float(inputs["num_items_in_batch"]), 1.0) / trainer.accelerator.num_processes
    if train:  # num_items_in_batch spans the generation batch: rescale it to one accumulation window
        items = items * accum / trainer.args.steps_per_generation
    return {"num_items": items}


def _head_params(model):
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"model.get_output_embeddings(): expected an nn.Linear head, got {type(head).__name__}")
    weight, bias = head.weight, head.bias
    try:  # FSDP2 shards parameters as DTensors; the head is used whole
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    return weight, bias


def _install_forward(model) -> None:
    """`model(..., rlkernels_head=fn)` runs the backbone and returns `fn(model, last_hidden_state)` (a dict); with
    `output_router_logits=True` as well, also the model's MoE load-balancing loss under "aux_loss".

    Going through `model(...)` keeps DDP / FSDP / accelerate wrappers in the loop; without the
    keyword the forward is the one the model had (TRL's, so generation is unchanged).
    """
    if getattr(model, "_rlkernels_forward", False):
        return
    output_head(model.config, 1.0)  # rejects heads we cannot reproduce, naming the attribute
    _head_params(model)
    previous = model.forward

    @functools.wraps(previous)
    def forward(*args, rlkernels_head=None, **kwargs):
        if rlkernels_head is None:
            return previous(*args, **kwargs)
        for name in _HEAD_KWARGS:
            kwargs.pop(name, None)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        outputs = backbone_outputs(model, *args, **kwargs)
        result = rlkernels_head(model, last_hidden_state(outputs))
        if kwargs.get("output_router_logits"):  # as the model's own forward forms it
            result["aux_loss"] = moe_aux_loss_function(model)(outputs.router_logits, kwargs.get("attention_mask"))
        return result

    model.forward = forward
    model._rlkernels_forward = True


def _models(trainer):
    """The modules whose forward gets the rlkernels keyword: the policy (its base model under PEFT), the reference."""
    unwrap = trainer.accelerator.unwrap_model
    policy = unwrap(trainer.model)
    policy = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    out = [policy]
    if getattr(trainer, "ref_model", None) is not None:
        out.append(unwrap(trainer.ref_model))
    return out


def _head_inputs(trainer, module, hidden, keep):
    """(hidden states scoring the last `keep` tokens, weight, bias), in the dtype the head's matmul runs in.

    Position t scores token t + 1. Under autocast TRL's head multiplies in the autocast dtype
    (in fp32 with `cast_lm_head_to_fp32`); rlkernels' ops run with autocast off, so the cast is
    made here, once: the same numbers as TRL's head.
    """
    weight, bias = _head_params(module)
    dtype, device = weight.dtype, hidden.device.type
    if torch.is_autocast_enabled(device) and not getattr(trainer.args, "cast_lm_head_to_fp32", False):
        dtype = torch.get_autocast_dtype(device)
    hidden = hidden[:, -keep - 1 : -1].to(dtype)
    return hidden, weight.to(dtype), None if bias is None else bias.to(dtype)


def _no_autocast(device):
    return torch.autocast(device_type=device.type, enabled=False)


def _logprobs_head(self, targets, return_entropy=False):
    """The head that `model(..., rlkernels_head=)` runs to score `targets`, the last tokens of its input."""
    def head(module, hidden):
        hidden, weight, bias = _head_inputs(self, module, hidden, targets.size(1))
        with _no_autocast(hidden.device):
            return linear_token_logprobs(hidden, weight, targets, bias=bias, return_entropy=return_entropy,
                                         **output_head(module.config, self.temperature))
    return head


def get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                      compute_entropy=False, compute_aux_loss=False, **multimodal):
    """TRL's `_get_per_token_logps_and_entropies` from hidden states (masked positions are 0, as TRL's)."""
    if compute_aux_loss or any(v is not None for v in multimodal.values()):
        return _TRL_LOGPS(
            self, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
    _check_head(self, model, input_ids, attention_mask)
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, am = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        head = _logprobs_head(self, ids[:, -logits_to_keep:], return_entropy=True)
        with self.accelerator.autocast():
            lp, ent = model(input_ids=ids, attention_mask=am, rlkernels_head=head)
        pad = am[:, -logits_to_keep:] == 0
        logps.append(lp.masked_fill(pad, 0.0))
        entropies.append(ent.masked_fill(pad, 0.0))
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None


def _check_head(self, model, input_ids, attention_mask) -> None:
    """rlkernels' log-probs against TRL's own (`model(...).logits`), once per model class (`check_head`)."""
    module = self.accelerator.unwrap_model(model)
    module = module.get_base_model() if hasattr(module, "get_base_model") else module

    def ours(ids, mask):
        return model(input_ids=ids, attention_mask=mask, rlkernels_head=_logprobs_head(self, ids[:, 1:]))

    with self.accelerator.autocast():
        check_head(module, input_ids, attention_mask, ours, self.temperature,
                   logits=lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits)


def compute_loss(self, model, inputs):
    """TRL's `_compute_loss` as one `fused_linear_policy_loss` call, or TRL's own where not covered."""
    cfg, why = loss_config(self)
    if cfg is None or any(inputs.get(k) is not None for k in _MULTIMODAL):
        why = why or "multimodal inputs"
        if preset_of(self.loss_type) is not None:
            raise _loss_type_error(self.loss_type, why)
        warned = self.__dict__.setdefault("_rlkernels_warned", set())
        if why not in warned:
            warned.add(why)
            warnings.warn(f"rlkernels: TRL computes this loss itself (log-probs still from rlkernels) because of {why}",
                          stacklevel=2)
        return _TRL_LOSS(self, model, inputs)

    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    mask = mask.bool()
    keep = completion_ids.size(1)
    loss_type = _normaliser(self, cfg)
    counts = _counts(self, loss_type, mask, inputs)
    entropy_coef = _entropy_coef(self)
    if entropy_coef:
        cfg = cfg.replace(entropy_coef=entropy_coef, entropy_agg="token_mean")
    # TRL's vLLM importance sampling correction: its truncated or masked ratio times the policy term.
    vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
    is_weights = inputs["importance_sampling_ratio"] if vllm_is else None

    def head(module, hidden):
        hidden, weight, bias = _head_inputs(self, module, hidden, keep)
        with _no_autocast(hidden.device):
            out = fused_linear_policy_loss(
                hidden, weight, completion_ids, inputs["advantages"], mask, cfg, bias=bias,
                old_logp=inputs.get("old_per_token_logps"), ref_logp=inputs.get("ref_per_token_logps"),
                is_weights=is_weights, rollout_logp=inputs.get("sampling_per_token_logps"),
                entropy_quantile_group=_quantile_group(self), **output_head(module.config, self.temperature), **counts)
        return {"loss": out.loss, "metrics": out.metrics, "logp": out.logp, "entropy": out.entropy}

    moe = {"output_router_logits": True} if getattr(self, "aux_loss_enabled", False) else {}
    with self.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, rlkernels_head=head, **moe)
    _log_metrics(self, loss_type, out["loss"], out["metrics"], out["entropy"], mask, cfg)
    _log_ratio_metrics(self, out["logp"], inputs, mask, cfg, is_weights)
    loss = out["loss"]
    if moe:  # TRL's MoE auxiliary loss, scaled for gradient accumulation as TRL scales it
        mode = "train" if self.model.training else "eval"
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + self.router_aux_loss_coef * out["aux_loss"] / normalizer
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(out["aux_loss"]).mean().item())
    return loss


def _log_metrics(self, loss_type, loss, metrics, entropy, mask, cfg):
    """TRL's KL, entropy and entropy-bonus metrics, as token-weighted means over all processes (and TRL's
    adaptive entropy coefficient moved as TRL moves it)."""
    mode = "train" if self.model.training else "eval"
    count = mask.sum().to(torch.float32)
    if getattr(self, "_entropy_bonus_enabled", False):  # TRL's loss without its bonus, and the coefficient
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        high = high_entropy_tokens(entropy, mask, cfg, _quantile_group(self))  # the bonus's tokens (docs/math.md §7)
        bonus_mask = mask if high is None else high
        bonus_count = bonus_mask.sum().to(torch.float32)
        bonus_sum = torch.where(bonus_mask, entropy, 0.0).sum()
        # cfg's c_H: the applied coef / G
        policy_loss = loss.detach() + cfg.entropy_coef * bonus_sum / bonus_count.clamp(min=1.0)
        if loss_type not in ("cispo", "dapo", "vespo"):  # TRL logs these before its accumulation divisor
            policy_loss = policy_loss * accum
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if getattr(self, "use_adaptive_entropy", False) and mode == "train":
            _adapt_entropy_coef(self, bonus_sum, bonus_count)
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def global_mean(value):
        totals = self.accelerator.reduce(torch.stack([value.float() * count, count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if self.beta != 0.0:
        self._metrics[mode]["kl"].append(global_mean(metrics["kl"]))
    self._metrics[mode]["entropy"].append(global_mean(metrics["entropy"]))


# the loss types whose clip ratios TRL logs (besides cispo's own)
_CLIP_LOGGED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _log_ratio_metrics(self, logp, inputs, mask, cfg, is_weights):
    """TRL's metrics of the ratio by TRL's definitions, from the log-probs the fused pass computed: the clip
    metrics (its ratio of each token, of each row at sequence level, capped at δ, against ε; means over the tokens, or
    rows, of every process; the smallest / largest per-row fraction over every process's rows) and VESPO's
    mean φ over the rows."""
    if self.loss_type not in _CLIP_LOGGED + ("cispo", "vespo"):
        return
    mode = "train" if self.model.training else "eval"
    old = inputs.get("old_per_token_logps")
    log_ratio = torch.where(mask, logp - (logp if old is None else old), 0.0)
    if self.loss_type == "vespo":  # φ of each row, the spec's (the same as TRL's, tested)
        c = cfg.log_ratio_clamp
        phi, _ = vespo_weight(log_ratio.clamp(-c, c).sum(-1), inputs["advantages"], cfg, is_weights, mask)
        totals = self.accelerator.reduce(torch.stack([phi.sum(), phi.new_tensor(float(phi.numel()))]), reduction="sum")
        self._metrics[mode]["vespo/phi_seq_mean"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return
    sequence = self.importance_sampling_level == "sequence"
    if sequence:
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    adv = inputs["advantages"]
    adv = adv[:, None] if adv.dim() == 1 else adv
    weight = torch.ones_like(ratio) if sequence else mask.to(ratio.dtype)  # TRL counts rows at sequence level

    def global_mean(flags):
        totals = self.accelerator.reduce(torch.stack([(flags * weight).sum(), weight.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def extreme_row_mean(flags, pick):  # NaN rows (no tokens) are left out, as TRL's nanmin / nanmax do
        rows = flags.squeeze(1) if sequence else (flags * mask).sum(-1) / mask.sum(-1)
        rows = self.accelerator.gather(rows)
        rows = rows[~rows.isnan()]
        return pick(rows).item() if rows.numel() else float("nan")

    if self.loss_type == "cispo":
        self._metrics[mode]["cispo_clip_ratio"].append(global_mean(((ratio > self.epsilon_high) & (adv > 0)).float()))
        return
    if cfg.delta is not None:  # TRL counts on its two-sided clip's ratio min(w, δ)
        ratio = ratio.clamp(max=cfg.delta)
    low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
    high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
    self._metrics[mode]["clip_ratio/low_mean"].append(global_mean(low))
    self._metrics[mode]["clip_ratio/high_mean"].append(global_mean(high))
    self._metrics[mode]["clip_ratio/region_mean"].append(global_mean(low + high))  # never both: A's sign
    self._metrics[mode]["clip_ratio/low_min"].append(extreme_row_mean(low, torch.min))
    self._metrics[mode]["clip_ratio/high_max"].append(extreme_row_mean(high, torch.max))


_LOG = logging.getLogger("rlkernels")


def describe(trainer) -> str:
    """One line: which rlkernels loss computes the trainer's `loss_type`, or why TRL's own loss stays."""
    cfg, why = loss_config(trainer)
    what = f"loss_type={trainer.loss_type!r} (importance_sampling_level={trainer.importance_sampling_level!r})"
    if cfg is None:
        return f"rlkernels: {what} stays TRL's own loss because of {why}; the log-probs are rlkernels'"
    bounds = "" if cfg.clip_low is None and cfg.clip_high is None else f", clip ({cfg.clip_low}, {cfg.clip_high})"
    kl = f", KL {cfg.kl_estimator} × {cfg.kl_coef:g}" if cfg.kl_coef else ""
    return (f"rlkernels: {what} is computed by rlkernels' fused_linear_policy_loss: objective {cfg.objective}, "
            f"ratio {cfg.ratio}, agg {cfg.agg}{bounds}{kl}")


def _announce(trainer) -> None:
    """Log `describe` once per trainer, on the main process, visible without any logging set up (a handler of
    its own on the `rlkernels` logger unless the application configured logging)."""
    if not trainer.accelerator.is_main_process:
        return
    if not _LOG.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _LOG.addHandler(handler)
        _LOG.setLevel(logging.INFO)
    _LOG.info(describe(trainer))


def _prepare(trainer) -> None:
    """Give the trainer's models the rlkernels keyword, check a preset's `loss_type` now, not at the first step, and
    say which loss replaces TRL's."""
    for module in _models(trainer):
        _install_forward(module)
    _announce(trainer)


class RLKernelsGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose log-probs and loss come from rlkernels' hidden-state path (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _prepare(self)

    _get_per_token_logps_and_entropies = get_per_token_logps_and_entropies
    _compute_loss = compute_loss


def patch_trl_grpo_trainer(trainer: GRPOTrainer) -> GRPOTrainer:
    """Make an existing `GRPOTrainer` compute log-probs and loss like `RLKernelsGRPOTrainer`; returns it."""
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"trainer: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    _prepare(trainer)
    trainer._get_per_token_logps_and_entropies = types.MethodType(get_per_token_logps_and_entropies, trainer)
    trainer._compute_loss = types.MethodType(compute_loss, trainer)
    return trainer


def apply() -> None:
    """Make `trl.GRPOTrainer` itself compute log-probs and loss as `RLKernelsGRPOTrainer` does, for every trainer
    built afterwards in this process (as Liger's `apply_liger_kernel_to_*` patch a model class). Idempotent."""
    if GRPOTrainer.__dict__.get("_rlkernels_applied"):
        return
    trl_init = GRPOTrainer.__init__

    @functools.wraps(trl_init)
    def __init__(self, *args, **kwargs):
        trl_init(self, *args, **kwargs)
        _prepare(self)

    GRPOTrainer.__init__ = __init__
    GRPOTrainer._get_per_token_logps_and_entropies = get_per_token_logps_and_entropies
    GRPOTrainer._compute_loss = compute_loss
    GRPOTrainer._rlkernels_applied = True


__all__ = ["apply", "RLKernelsGRPOTrainer", "patch_trl_grpo_trainer", "loss_config", "preset_of", "describe"]
