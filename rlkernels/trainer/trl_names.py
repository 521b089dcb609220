"""TRL's names for the trainer's settings: `GRPOConfig`'s, and the `ModelConfig` / `ScriptArguments` keys of a
TRL recipe, accepted as flags and `--config` keys beside the trainer's own (docs/trainer.md#trls-names).

* RENAMED: one of our settings under TRL's name (or an older name of ours): `--learning_rate` is `--lr`.
* OPTIONS: TRL settings that set ours by a rule (`resolve`), with their types.
* SAME_AS_HERE: TRL settings accepted when their value is what this trainer does anyway (`use_vllm: false`).
Anything else in a recipe has no counterpart here: `resolve` names all of it in one error.

A step here is one rollout batch (TRL: one generation batch); with TRL's defaults (`steps_per_generation` =
`gradient_accumulation_steps`, `num_iterations` 1) TRL's `max_steps` counts the same steps.
"""
from __future__ import annotations

from typing import List

RENAMED = {
    "output_dir": "out", "learning_rate": "lr", "beta": "kl_coef", "max_completion_length": "max_new_tokens",
    "max_steps": "steps", "num_iterations": "epochs", "save_steps": "ckpt_every", "eval_steps": "eval_every",
    "model_name_or_path": "model", "dataset_name": "dataset", "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_split", "reward_funcs": "reward", "reward_model_name_or_path": "reward_model",
    "torch_dtype": "dtype", "activation_checkpointing": "gradient_checkpointing",
    "prompts": "dataset",  # this trainer's name before --dataset read more than JSONL
}
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
    "eval_strategy": (str, "steps | no (no: evaluate only before and after RL)"),
    "do_eval": (bool, "false: evaluate only before and after RL"),
    "disable_tqdm": (bool, "true: --progress false"),
}
_NEUTRAL_SAMPLING = "sampling here is pure temperature sampling, so that the recorded log-probs are the sampler's"
SAME_AS_HERE = {  # name: (type, accepted values, why only those)
    "use_vllm": (bool, (False,), "rollouts use transformers' generate"),
    "push_to_hub": (bool, (False,), "runs are saved to --out only"),
    "fp16": (bool, (False,), "float16 needs loss scaling, which this trainer does not do (use bf16)"),
    "top_p": (float, (1.0,), _NEUTRAL_SAMPLING),
    "top_k": (int, (0, None), _NEUTRAL_SAMPLING),
    "min_p": (float, (None,), _NEUTRAL_SAMPLING),
    "repetition_penalty": (float, (1.0,), _NEUTRAL_SAMPLING),
    "save_strategy": (str, ("steps",), "checkpoints every --ckpt-every steps"),
    "logging_strategy": (str, ("steps",), "metrics every --logging-steps steps"),
    "save_total_limit": (int, (1,), "a run folder keeps its last checkpoint"),
    "model_revision": (str, ("main",), "--model is a local folder, of one revision"),
}
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
TRL_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
             "generation_batch_size")


def kind(name: str):
    """(type, optional) of a TRL option or a SAME_AS_HERE setting; None for other names."""
    if name in OPTIONS:
        return OPTIONS[name][0], True
    if name in SAME_AS_HERE:
        typ, accepted, _ = SAME_AS_HERE[name]
        return typ, None in accepted
    return None


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


def resolve(values: dict, defaults, flags=(), world: int = 1) -> dict:
    """`values` (our fields, TRL options and SAME_AS_HERE settings, converted) as our fields only;
    `defaults(name)` is a field's default where a rule needs it, `flags` the names given as flags (which win
    over a --config file's TRL setting of the same field), `world` the number of processes."""
    trl = {k: values.pop(k) for k in list(values) if k in OPTIONS or k in SAME_AS_HERE}
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

    _batch(trl, values, set_field, world, defaults)
    steps = values.get("steps", defaults("steps"))
    if trl.get("warmup_ratio") is not None:
        set_field("lr_warmup_steps", round(trl["warmup_ratio"] * steps), "warmup_ratio")
    if trl.get("num_train_epochs") is not None and "steps" not in values:
        raise ValueError("num_train_epochs: this trainer counts steps (rollout batches), not epochs; give max_steps "
                         "(--steps)")
    if trl.get("eval_strategy") not in (None, "steps", "no"):
        raise ValueError(f"eval_strategy: expected steps or no, got {trl['eval_strategy']!r}")
    if trl.get("eval_strategy") == "no" or trl.get("do_eval") is False:
        set_field("eval_every", steps, "eval_strategy")
    return values


def _batch(trl, values, set_field, world, defaults) -> None:
    """TRL's batch settings as --prompts-per-step (prompts per rollout batch per process) and --minibatches
    (optimizer steps per pass over it)."""
    given = [k for k in TRL_BATCH if trl.get(k) is not None]
    if not given:
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
    if rows != int(rows) or int(rows) % generations:
        raise ValueError(f"{given[0]}: {what} = {rows:g} completions per process is not a multiple of "
                         f"num_generations ({generations})")
    if per_generation != int(per_generation) or int(per_generation) % accumulation:
        raise ValueError(f"gradient_accumulation_steps: {accumulation} does not divide the {per_generation:g} "
                         f"micro-batches of a rollout batch")
    set_field("prompts_per_step", int(rows) // generations, given[0])
    set_field("minibatches", int(per_generation) // accumulation, given[0])
