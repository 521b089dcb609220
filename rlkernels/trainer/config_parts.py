"""The parts of a run's Config that the trainer's steps take, one frozen dataclass per concern: a step reads only
the settings it uses, and the whole Config stays with the set-up (startup.py), the checkpoint and the summary.

Each part is filled once from the Config's fields of the same names (`take`), plus the values derived from
several of them (the estimator that --algo implies, Dr. GRPO's scale, ReMax's greedy baseline)."""
from __future__ import annotations

import dataclasses


def take(part, cfg, **derived):
    """`part` with the Config fields of its field names, and `derived` for the others."""
    names = [f.name for f in dataclasses.fields(part) if f.name not in derived]
    return part(**{name: getattr(cfg, name) for name in names}, **derived)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """generation.py: rollouts, their rewards' shaping and filtering, and the greedy evaluation."""
    num_generations: int
    max_new_tokens: int
    temperature: float
    tree: bool
    tree_roots: int
    overlong_buffer: int
    pods_keep: int
    dynamic_sampling: bool
    eval_completions: int
    greedy_baseline: bool  # ReMax: each prompt's greedy completion is scored too


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


def sampling(cfg) -> Sampling:
    return take(Sampling, cfg, greedy_baseline=cfg.adv_estimator == "remax")


def advantages(cfg, ratio: str) -> Advantages:
    return take(Advantages, cfg, estimator=estimator(cfg, ratio),
                scale=cfg.scale_rewards or ("none" if cfg.algo == "dr_grpo" else "group"))
