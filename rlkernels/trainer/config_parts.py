"""The parts of a run's Config that the trainer's steps take, one frozen dataclass per concern: a step reads only
the settings it uses, and the whole Config stays with the set-up (startup.py), the checkpoint and the summary.

Each part is filled once from the Config's fields of the same names (`take`), plus the values derived from
several of them (the estimator that --algo implies, Dr. GRPO's scale, ReMax's greedy baseline)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .settings import LOSS_FIELDS


def take(part, cfg, **derived):
    """`part` with the Config fields of its field names, and `derived` for the others."""
    names = [f.name for f in dataclasses.fields(part) if f.name not in derived]
    return part(**{name: getattr(cfg, name) for name in names}, **derived)


@dataclasses.dataclass(frozen=True)
class Data:
    """data.py: the prompts of --dataset and those held out."""
    dataset: str
    dataset_config: Optional[str]
    dataset_split: str
    prompt_column: str
    system_prompt: Optional[str]
    eval_dataset: str
    eval_split: str
    eval_size: int
    eval_holdout: bool
    seed: int


@dataclasses.dataclass(frozen=True)
class Warmup:
    """startup.warm_up: the demo's supervised warm-up."""
    warmup_steps: int
    warmup_target: Optional[float]
    warmup_eval_every: int
    warmup_batch: int
    warmup_lr: float
    progress: bool


@dataclasses.dataclass(frozen=True)
class Sampling:
    """loop.collect and generation.py: rollouts, their rewards' shaping and filtering, the greedy evaluation."""
    prompts_per_step: int
    max_gen_batches: int
    num_generations: int
    max_new_tokens: int
    temperature: float
    tree: bool
    tree_roots: int
    overlong_buffer: int
    pods_keep: int
    dynamic_sampling: bool
    mask_truncated_completions: bool
    eval_completions: int
    greedy_baseline: bool  # ReMax: each prompt's greedy completion is scored too


@dataclasses.dataclass(frozen=True)
class Optimization:
    """loop.update and update.py: the epochs over a step's rows, the optimizer step, the learning-rate schedule."""
    lr: float
    lr_warmup_steps: int
    lr_scheduler_type: str
    steps: int
    epochs: int
    minibatches: int
    max_grad_norm: float
    vf_clip: Optional[float]
    vf_coef: float
    kl_target: Optional[float]  # PPO's adaptive β (None for the GRPO family, whose β is fixed)


@dataclasses.dataclass(frozen=True)
class Logging:
    """loop.py and startup.open_logs: the run folder, what is logged and when, evals and checkpoints."""
    out: str
    algo: str
    steps: int
    logging_steps: int
    eval_every: int
    ckpt_every: int
    report_to: tuple
    progress: bool


@dataclasses.dataclass(frozen=True)
class Advantages:
    """estimators.py: which estimator, and its settings."""
    estimator: str  # a name of run_config.ADV_ESTIMATORS, or --algo's own: gae, tree_grpo, snis, trl_gdpo
    scale: str  # grpo's divisor: group | batch | none (verl's norm_adv_by_std_in_grpo: group or none)
    gamma: float
    lam: float
    overlong_buffer: int
    max_new_tokens: int


def estimator(cfg, ratio: str) -> str:
    """The advantage estimator of a run (run_config.validate has refused the combinations that contradict)."""
    if cfg.algo == "ppo":
        return "gae"
    if cfg.tree:
        return "tree_grpo"
    if ratio == "snis":
        return "snis"
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        return "trl_gdpo"
    return cfg.adv_estimator or "grpo"


def loss_config(cfg, group_size: int):
    """The preset of `--algo` with the trainer's overrides. PPO's KL goes into the reward (docs/math.md §6), so
    its loss config carries none; the GRPO family's KL is in the loss (k3 unless the preset says). Dr. GRPO's
    constant (`agg="constant"`) is the maximum completion length, `--max-new-tokens`."""
    from ..losses import presets
    from ..losses.objectives import GROUPED_RATIOS

    constant = presets.fields(cfg.algo).get("agg") == "constant"
    base = presets.get(cfg.algo, **({"norm_length": cfg.max_new_tokens} if constant else {}))
    over = {"entropy_coef": cfg.entropy_coef}
    if cfg.clip_low is not None:
        over["clip_low"] = cfg.clip_low
    if cfg.clip_high is not None:
        over["clip_high"] = cfg.clip_high
    if cfg.algo != "ppo" and cfg.kl_coef is not None:
        over["kl_coef"] = cfg.kl_coef
        if cfg.kl_coef > 0 and base.kl_estimator is None:
            over["kl_estimator"] = "k3"
    if base.ratio in GROUPED_RATIOS:
        over["group_size"] = group_size
    over.update({name: getattr(cfg, name) for name in LOSS_FIELDS if getattr(cfg, name) is not None})
    if cfg.top_entropy_quantile < 1.0:
        over["top_entropy_quantile"] = cfg.top_entropy_quantile
    if cfg.kl_bias_correction:
        over["kl_bias_correction"] = True
    return base.replace(**over)


def schedule(cfg, prompts: int, per_step: int) -> tuple:
    """The settings that TRL states in the count of training prompts (`per_step` of them a step): --train-epochs
    (num_train_epochs) as --steps, --save-strategy epoch / no as --ckpt-every; (those settings, the log's line)."""
    out, said = {}, []
    if cfg.train_epochs is not None:  # the steps that pass over the prompts that often
        out.update(steps=max(1, math.ceil(cfg.train_epochs * prompts / per_step)), train_epochs=None)
        said.append(f"--steps {out['steps']}: num_train_epochs over {prompts} prompts, {per_step} a step")
    if cfg.save_strategy != "steps":
        out["ckpt_every"] = math.ceil(prompts / per_step) if cfg.save_strategy == "epoch" else out.get("steps", cfg.steps)
        said.append(f"--save-strategy {cfg.save_strategy}: a checkpoint every {out['ckpt_every']} steps"
                    + (f" ({prompts} prompts, {per_step} a step)" if cfg.save_strategy == "epoch" else " (the last)"))
    return out, "\n".join(said)


def attach(run, cfg) -> None:
    """The parts of `cfg` on `run` (again after the set-up changes the config: --train-epochs sets --steps), the
    loss's config of --algo among them."""
    run.cfg = cfg
    run.loss_cfg = loss_config(cfg, cfg.pods_keep or cfg.num_generations)
    run.adv = advantages(cfg, run.loss_cfg.ratio)
    run.data, run.warmup, run.sampling = take(Data, cfg), take(Warmup, cfg), sampling(cfg)
    run.optim = take(Optimization, cfg, kl_target=cfg.kl_target if cfg.algo == "ppo" else None)
    run.logs = take(Logging, cfg, report_to=tuple(cfg.report_to))


def sampling(cfg) -> Sampling:
    return take(Sampling, cfg, greedy_baseline=cfg.adv_estimator == "remax")


def advantages(cfg, ratio: str) -> Advantages:
    return take(Advantages, cfg, estimator=estimator(cfg, ratio),
                scale=cfg.scale_rewards or ("none" if cfg.algo == "dr_grpo" else "group"))
