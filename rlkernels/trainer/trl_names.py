"""TRL's names for the trainer's settings: `GRPOConfig`'s, and the `ModelConfig` / `ScriptArguments` keys of a
TRL recipe, accepted as flags and `--config` keys beside the trainer's own (docs/trainer.md#trls-names).

* RENAMED: one of our settings under TRL's name (or an older name of ours): `--learning_rate` is `--lr`; SAME_NAME:
  GRPOConfig's settings of our name; TRL_DEFAULTS: GRPOConfig's defaults where ours differ. All three come from
  the `trl`, `former` and `trl_default` that settings.py declares with each setting.
* OPTIONS: TRL settings that set ours by a rule (`resolve`), with their types.
* SAME_AS_HERE: TRL settings accepted when their value is what this trainer does anyway (`use_vllm: false`);
  another value is refused, naming the setting and why.
* IGNORED: settings with no effect on what this trainer trains (logging, the Hub, data loaders, speed-only
  switches, vLLM's): accepted at any value and named once in the log.
Together with the trainer's own fields of the same name (`seed`, `temperature`, `num_generations`, ...) these
cover every GRPOConfig setting of TRL 1.16 (python_tests/test_trainer_trl_recipe.py checks it). A null value is
TRL's default. Anything else in a recipe (ModelConfig's `attn_implementation`, say) is named in one error.

A TRL recipe (a --config file with any of TRL's names) starts from TRL's defaults (TRL_DEFAULTS: GRPOConfig's
batch, loss_type dapo, beta 0, no held-out split unless it asks for evaluation), not from this trainer's.

A step here is one rollout batch (TRL: one generation batch); with TRL's defaults (`steps_per_generation` =
`gradient_accumulation_steps`, `num_iterations` 1) TRL's `max_steps` counts the same steps.
"""
from __future__ import annotations

from typing import List

from .settings import FIELDS

FORMER = {old: name for name, f in FIELDS.items() for old in f.metadata["former"]}  # our own older names
RENAMED = {**{alias: name for name, f in FIELDS.items() for alias in f.metadata["trl"] if alias != name}, **FORMER}
# (type, help); list types take several values
OPTIONS = {
    "loss_type": (str, "TRL's loss: grpo, dr_grpo, dapo, cispo, sapo, luspo, vespo (sets --algo)"),
    "importance_sampling_level": (str, "token | sequence (with loss_type grpo: --algo gspo)"),
    "epsilon": (float, "TRL's ε: --clip-low, and --clip-high unless epsilon_high is given"),
    "epsilon_high": (float, "TRL's upper ε: --clip-high (cispo: the ratio cap, --clip-high + 1)"),
    "bf16": (bool, "true: --dtype bfloat16; false: --dtype float32"),
    "use_cpu": (bool, "true: --device cpu"),
    "per_device_train_batch_size": (int, "completions per micro-batch (with num_generations: --prompts-per-step)"),
    "gradient_accumulation_steps": (int, "micro-batches per optimizer step (with steps_per_generation: --minibatches)"),
    "steps_per_generation": (int, "micro-batches per rollout batch (default: gradient_accumulation_steps)"),
    "generation_batch_size": (int, "completions per rollout batch, all processes (instead of steps_per_generation)"),
    "warmup_ratio": (float, "learning-rate warm-up as a fraction of the steps (--lr-warmup-steps; TRL on "
                            "transformers < 5)"),
    "use_peft": (bool, "LoRA through peft (--lora-rank lora_r, 16 by default)"),
    "lora_r": (int, "LoRA rank when use_peft is true"),
    "lora_target_modules": (List[str], "LoRA modules (--lora-target)"),
    "num_train_epochs": (float, "accepted with max_steps (--steps), which counts the steps here"),
    "eval_strategy": (str, "steps (every eval_steps, and before and after RL) | no (no evaluation: --eval-size 0)"),
    "do_eval": (bool, "false: no evaluation (--eval-size 0)"),
    "disable_tqdm": (bool, "true: --progress false"),
}
_NO_QUANTISATION = ("the policy trains from float weights (bitsandbytes' quantised layers are not supported); LoRA on a "
                    "bfloat16 model (--dtype bfloat16) saves memory instead")
_NEUTRAL_SAMPLING = "sampling here is pure temperature sampling, so that the recorded log-probs are the sampler's"
SAME_AS_HERE = {  # name: (type, accepted values, why only those)
    "use_vllm": (bool, (False,), "rollouts use transformers' generate"),
    "push_to_hub": (bool, (False,), "runs are saved to --out only"),
    "fp16": (bool, (False,), "float16 needs loss scaling, which this trainer does not do (use bf16)"),
    "top_p": (float, (1.0,), _NEUTRAL_SAMPLING),
    "top_k": (int, (0, None), _NEUTRAL_SAMPLING),
    "min_p": (float, (None,), _NEUTRAL_SAMPLING),
    "repetition_penalty": (float, (1.0,), _NEUTRAL_SAMPLING),
    "logging_strategy": (str, ("steps",), "metrics every --logging-steps steps"),
    "save_total_limit": (int, (1,), "a run folder keeps its last checkpoint"),
    "model_revision": (str, ("main",), "--model is a local folder, of one revision"),
    "lora_task_type": (str, ("CAUSAL_LM",), "the policy is a causal LM"),
    "load_in_8bit": (bool, (False,), _NO_QUANTISATION),
    "load_in_4bit": (bool, (False,), _NO_QUANTISATION),
    "dataset_streaming": (bool, (False,), "prompts are drawn at random from the whole split, which is read into memory"),
    # set to TRL's default, or to what this trainer always does
    "optim": (str, ("adamw_torch_fused", "adamw_torch"), "the optimizer is torch's AdamW (--adam-beta1/2, --adam-epsilon)"),
    "optim_args": (str, (None,), "the optimizer is torch's AdamW (--adam-beta1/2, --adam-epsilon)"),
    "optim_target_modules": (str, (None,), "AdamW updates every trained parameter"),
    "lr_scheduler_kwargs": (str, (None,), "--lr-scheduler-type takes no arguments"),
    "label_smoothing_factor": (float, (0.0,), "the policy loss has no label smoothing"),
    "neftune_noise_alpha": (float, (None,), "no noise is added to the embeddings"),
    "train_sampling_strategy": (str, ("random",), "prompts are drawn in a seeded random order"),
    "data_seed": (int, (None,), "the prompt order follows --seed"),
    "shuffle_dataset": (bool, (True,), "prompts are drawn in a seeded random order"),
    "model_init_kwargs": (str, (None,), "--model loads with from_pretrained's defaults (--dtype sets the compute dtype)"),
    "trust_remote_code": (bool, (False,), "--model loads with the model classes of transformers"),
    "router_aux_loss_coef": (float, (None,), "a mixture of experts' auxiliary loss is not added"),
    "disable_dropout": (bool, (False,), "the policy trains with its own dropout"),
    "cast_lm_head_to_fp32": (bool, (False, True), "the loss head computes its log-softmax in float32 either way"),
    "num_generations_eval": (int, (None,), "evaluation is one greedy completion per prompt"),
    "generation_kwargs": (str, (None,), _NEUTRAL_SAMPLING),
    "chat_template_kwargs": (str, (None,), "conversations go through the tokenizer's chat template as is"),
    "max_tool_calling_iterations": (int, (None,), "completions are sampled without tools"),
    "sync_ref_model": (bool, (False,), "the reference model stays the initial policy"),
    "use_adaptive_entropy": (bool, (False,), "--entropy-coef is fixed"),
    "off_policy_mask_threshold": (float, (None,), "no off-policy sequence masking"),
    "average_tokens_across_devices": (bool, (True,), "token means are over every process's tokens"),
    "load_best_model_at_end": (bool, (False,), "the run folder keeps the last model"),
    "resume_from_checkpoint": (str, (None,), "a run continues with --resume RUN_FOLDER (a folder of this trainer)"),
    "deepspeed": (str, (None,), "under torchrun the trainer runs DDP, or FSDP2 with --fsdp"),
    "fsdp_config": (str, (None,), "--fsdp shards each decoder layer with FSDP2's defaults"),
    "use_transformers_continuous_batching": (bool, (False,), "rollouts use transformers' generate"),
    "use_transformers_paged": (bool, (False,), "rollouts use transformers' generate"),
}
IGNORED = {  # why each group has no effect here
    "logging, tracking and the Hub (metrics go to metrics.jsonl and --report-to)": (
        "logging_first_step", "log_on_each_node", "logging_nan_inf_filter", "include_num_input_tokens_seen",
        "log_level", "log_level_replica", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
        "trackio_static_space_id", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
        "hub_revision", "log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts",
        "log_completions_hub_repo", "skip_memory_metrics", "debug"),
    "evaluation and checkpoint bookkeeping of transformers' Trainer": (
        "do_train", "do_predict", "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object",
        "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics", "per_device_eval_batch_size",
        "eval_delay", "eval_on_start", "metric_for_best_model", "greater_is_better", "save_only_model",
        "save_on_each_node", "enable_jit_checkpoint", "ignore_data_skip", "restore_callback_states_from_checkpoint",
        "bf16_full_eval", "fp16_full_eval"),
    "data loading and process set-up": (
        "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
        "remove_unused_columns", "label_names", "length_column_name", "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "ddp_timeout",
        "accelerator_config", "parallelism_config", "local_rank", "auto_find_batch_size", "full_determinism"),
    "speed and memory only (the loss is rlkernels' either way)": (
        "use_liger_kernel", "liger_kernel_config", "torch_compile", "torch_compile_backend", "torch_compile_mode",
        "tf32", "use_cache", "cache_implementation", "pad_to_multiple_of", "ds3_gather_for_generation",
        "torch_empty_cache_steps", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
        "transformers_continuous_batching_config"),
    "vLLM's (use_vllm is false here)": (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap"),
    "quantisation options (load_in_4bit and load_in_8bit are false here)": (
        "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"),
    "the script's DDP buffer option (the trainer's DDP broadcasts no buffers to ignore)": ("ignore_bias_buffers",),
    "options of settings this trainer leaves off (sync_ref_model, use_adaptive_entropy)": (
        "ref_model_mixup_alpha", "ref_model_sync_steps", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
        "entropy_target"),
}
# GRPOConfig's settings that are this trainer's fields under the same name (a null in a recipe: TRL's default)
SAME_NAME = tuple(name for name, f in FIELDS.items() if name in f.metadata["trl"])
IGNORED_WHY = {name: why for why, names in IGNORED.items() for name in names}
# GRPOConfig's (and ModelConfig's) defaults where they differ from this trainer's, for a TRL recipe (`resolve`)
TRL_DEFAULTS = {name: f.metadata["trl_default"] for name, f in FIELDS.items() if "trl_default" in f.metadata}
# where a TRL recipe still trains or reports otherwise than `trl grpo`, for its log line
DIFFERENCES = ("a step is one rollout batch (TRL's max_steps counts optimizer steps: the same with steps_per_generation "
               "= gradient_accumulation_steps and num_iterations 1)", "evaluation is the greedy reward of --eval-size "
               "prompts before and after RL, and every --eval-every steps")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
TRL_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
             "generation_batch_size")


# `trl grpo`'s reward_funcs by name (its script's registry); the last one is a factory the script calls with these
TRL_REWARD_FUNCS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
TRL_SOFT_OVERLONG = {"max_completion_len": 1280, "soft_punish_cache": 256}


def kind(name: str):
    """(type, optional) of a TRL option, a SAME_AS_HERE or an IGNORED setting; None for other names."""
    if name in OPTIONS:
        return OPTIONS[name][0], True
    if name in SAME_AS_HERE:
        typ, accepted, _ = SAME_AS_HERE[name]
        return typ, None in accepted
    if name in IGNORED_WHY:
        return object, True  # any value, not converted
    return None


def is_trl_name(key: str) -> bool:
    """Whether a --config key is TRL's spelling of a setting, not this trainer's (which makes a TRL recipe)."""
    return (key in RENAMED and key not in FORMER) or key in OPTIONS or key in SAME_AS_HERE or key in IGNORED_WHY


def ignored_line(names) -> str:
    """The log line naming the IGNORED settings given, by group."""
    groups = {}
    for name in names:
        groups.setdefault(IGNORED_WHY[name], []).append(name)
    return "TRL settings with no effect here: " + "; ".join(f"{', '.join(n)} ({why})" for why, n in groups.items())


def refused(values: dict) -> List[str]:
    """The SAME_AS_HERE settings in `values` whose value this trainer does not follow, each with why."""
    return [f"{k}={v!r} ({SAME_AS_HERE[k][2]})" for k, v in values.items()
            if k in SAME_AS_HERE and v not in SAME_AS_HERE[k][1]]


def _preset_fields(algo: str) -> dict:
    """The preset's fields, {} for a name that is none (validate names it); imports torch, so only when needed."""
    from ..losses import presets

    return presets.fields(algo) if algo in presets.NAMES else {}


def _given_both(trl: str, ours: str) -> ValueError:
    return ValueError(f"{trl}: sets --{ours.replace('_', '-')}, which is given too; give one of them")


def resolve(values: dict, defaults, flags=(), world: int = 1, trl_recipe: bool = False, notes=None) -> dict:
    """`values` (our fields, TRL options and SAME_AS_HERE settings, converted) as our fields only;
    `defaults(name)` is a field's default where a rule needs it, `flags` the names given as flags (which win
    over a --config file's TRL setting of the same field), `world` the number of processes. A TRL recipe
    (`trl_recipe`) gets GRPOConfig's defaults where ours differ; `notes` gets where it still differs."""
    trl = {k: values.pop(k) for k in list(values) if k in OPTIONS or k in SAME_AS_HERE}
    if values.get("steps") == -1:  # TRL's max_steps -1: not set (num_train_epochs counts instead)
        values.pop("steps")
    if trl_recipe and "clip_low" not in values and "clip_high" not in values:
        trl.setdefault("epsilon", 0.2)  # TRL's ε, also its upper one unless epsilon_high is given
    if refused(trl):
        raise ValueError("TRL settings this trainer cannot follow: " + "; ".join(refused(trl)))

    def set_field(name, value, source):
        if name in values and values[name] != value:
            if name in flags and source not in flags:
                return
            raise _given_both(source, name)
        values[name] = value

    loss_type, level = trl.get("loss_type"), trl.get("importance_sampling_level")
    if loss_type is not None and loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {', '.join(LOSS_TYPES)} (TRL's bnpo, a per-micro-batch token "
                         f"mean, has no preset here: dapo is the token mean over the whole batch), got {loss_type!r}")
    if level not in (None, "token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected token or sequence, got {level!r}")
    if level == "sequence":
        if loss_type not in (None, "grpo"):
            raise ValueError(f"importance_sampling_level=sequence: GSPO is loss_type grpo at sequence level (--algo "
                             f"gspo); loss_type {loss_type} at sequence level has no preset here")
        set_field("algo", "gspo", "importance_sampling_level")
    elif loss_type is not None:
        set_field("algo", loss_type, "loss_type")

    algo = values.get("algo") or defaults("algo")
    eps, eps_high = trl.get("epsilon"), trl.get("epsilon_high")
    fields = _preset_fields(algo) if eps is not None or eps_high is not None else {}
    if fields.get("objective") == "cispo":  # TRL's cispo caps the ratio at epsilon_high and reads no epsilon
        if eps_high is not None:
            set_field("clip_high", eps_high - 1.0, "epsilon_high")
    elif fields.get("clip_low") is not None:  # the clip objectives; TRL's sapo and vespo read no epsilon either
        if eps is not None:
            set_field("clip_low", eps, "epsilon")
        if eps_high is not None or eps is not None:
            high = eps_high if eps_high is not None else eps
            set_field("clip_high", high, "epsilon_high" if eps_high is not None else "epsilon")

    if trl.get("bf16") is not None:
        set_field("dtype", "bfloat16" if trl["bf16"] else "float32", "bf16")
    if trl.get("use_cpu"):
        set_field("device", "cpu", "use_cpu")
    if trl.get("disable_tqdm") is not None:
        set_field("progress", not trl["disable_tqdm"], "disable_tqdm")
    if trl.get("use_peft"):
        set_field("lora_rank", trl.get("lora_r") or 16, "use_peft")
    if trl.get("lora_target_modules"):
        set_field("lora_target", ",".join(trl["lora_target_modules"]), "lora_target_modules")

    _batch(trl, values, set_field, world, defaults, trl_recipe)
    epochs = trl.get("num_train_epochs", 3.0 if trl_recipe else None)  # TRL's default: 3 epochs
    if "steps" not in values and epochs is not None:
        if trl.get("warmup_ratio") is not None:
            raise ValueError("warmup_ratio: a fraction of max_steps, which is not given (give max_steps, or "
                             "warmup_steps)")
        set_field("train_epochs", epochs, "num_train_epochs")
    steps = values.get("steps", defaults("steps"))
    if trl.get("warmup_ratio") is not None and not 0 <= trl["warmup_ratio"] <= 1:
        raise ValueError(f"warmup_ratio: expected a number in [0, 1] (a fraction of max_steps), got {trl['warmup_ratio']}")
    if trl.get("warmup_ratio") is not None:
        set_field("lr_warmup_steps", round(trl["warmup_ratio"] * steps), "warmup_ratio")
    if trl.get("eval_strategy") not in (None, "steps", "no"):
        raise ValueError(f"eval_strategy: expected steps or no, got {trl['eval_strategy']!r}")
    # as `trl grpo`: dataset_test_split alone (every recipe of defaults has "test") asks for no evaluation
    eval_asked = trl.get("eval_strategy") == "steps" or trl.get("do_eval") is True or "eval_dataset" in values
    if trl.get("eval_strategy") == "no" or trl.get("do_eval") is False or (trl_recipe and not eval_asked):
        set_field("eval_size", 0, "eval_strategy")  # as TRL: no evaluation, every prompt trains
    if trl_recipe:
        for name, value in TRL_DEFAULTS.items():
            values.setdefault(name, value)
        if notes is not None:
            notes.append("TRL recipe: trains as trl grpo does but " + "; ".join(DIFFERENCES))
    return values


def _batch(trl, values, set_field, world, defaults, trl_recipe=False) -> None:
    """TRL's batch settings (a TRL recipe: also its defaults) as --prompts-per-step (prompts per rollout batch per
    process) and --minibatches (optimizer steps per pass over it)."""
    given = [k for k in TRL_BATCH if trl.get(k) is not None]
    if not given and (not trl_recipe or "prompts_per_step" in values or "minibatches" in values):
        return
    for k in given:
        if trl[k] < 1:
            raise ValueError(f"{k}: expected an int >= 1, got {trl[k]}")
    per_device = trl.get("per_device_train_batch_size") or 8  # TRL's defaults
    accumulation = trl.get("gradient_accumulation_steps") or 1
    if trl.get("generation_batch_size") is not None:
        if trl.get("steps_per_generation") is not None:
            raise ValueError("generation_batch_size: give it or steps_per_generation, not both (as in TRL)")
        rows, what = trl["generation_batch_size"] / world, f"generation_batch_size / {world} processes"
        per_generation = rows / per_device
    else:
        per_generation = trl.get("steps_per_generation") or accumulation
        rows, what = per_device * per_generation, "per_device_train_batch_size × steps_per_generation"
    generations = values.get("num_generations", defaults("num_generations"))
    given = given or ["per_device_train_batch_size (TRL's default, 8)"]
    if rows != int(rows) or int(rows) % generations:
        raise ValueError(f"{given[0]}: {what} = {rows:g} completions per process is not a multiple of "
                         f"num_generations ({generations})")
    if per_generation != int(per_generation) or int(per_generation) % accumulation:
        raise ValueError(f"gradient_accumulation_steps: {accumulation} does not divide the {per_generation:g} "
                         f"micro-batches of a rollout batch")
    set_field("prompts_per_step", int(rows) // generations, given[0])
    set_field("minibatches", int(per_generation) // accumulation, given[0])
