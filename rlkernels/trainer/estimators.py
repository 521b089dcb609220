"""The advantage step (loop.py's step 3): the estimator that --adv-estimator names (verl's names) or that --algo
implies, each one function of `rlkernels.advantages` on the step's rewards. Returns (advantages, returns): per
row `(B,)` or per token `(B, T)`, and the critic's targets for GAE (else None)."""
from __future__ import annotations

import torch

from rlkernels import advantages as adv_lib
from rlkernels import sampling

from . import rewards as rewards_lib
from .distributed import nan_mean_std
from .config_parts import Advantages


def outcome_tokens(rewards: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): each completion's reward at its last token, 0 elsewhere (verl's token-level outcome reward)."""
    tok = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    last = (lengths - 1).clamp(min=0)
    tok[torch.arange(len(rewards), device=rewards.device), last] += rewards * (lengths > 0)
    return tok


def _reward_components(part: Advantages, batch: dict, weights: list) -> tuple:
    """(each reward function's rewards (B, K), their weights), DAPO's overlong penalty one more of weight 1 (in TRL
    it is a reward function)."""
    fn_rewards = batch["parts"]
    if part.overlong_buffer:
        penalty = sampling.overlong_penalty(batch["lengths"], part.max_new_tokens, part.overlong_buffer)
        fn_rewards = torch.cat([fn_rewards, penalty[:, None].to(fn_rewards.dtype)], 1)
        weights = weights + [1.0]
    return fn_rewards, weights


def _grpo(part: Advantages, rewards, group_ids):
    """The GRPO family's: each reward against its prompt group, divided by the group's std, the batch's or nothing
    (Dr. GRPO's default); the batch's is over every rank's rewards, as TRL's over its processes."""
    std = nan_mean_std(rewards.double())[1] if part.scale == "batch" else None
    adv = adv_lib.group_normalized(rewards, group_ids, scale="group" if part.scale == "group" else None
                                   ) if len(rewards) else rewards
    return adv / (std + 1e-6) if std is not None else adv  # group_normalized's ε


def advantages(part: Advantages, batch: dict, weights: list, values=None, beta: float = 0.0) -> tuple:
    """(advantages, returns) of the step's training rows. `weights`: the reward functions' (GDPO's); `values`: the
    critic's (GAE); `beta`: PPO's KL coefficient in the reward."""
    name, rewards, group_ids = part.estimator, batch["rewards"], batch["group_ids"]
    mask, lengths = batch["mask"], batch["lengths"]
    if name == "snis":  # SNIS takes the rewards and builds its own baseline
        return None, None
    if name == "gae":
        # per-token reward = −β·k1(π_old ‖ π_ref) at every token, + R at the last token; GAE(γ, λ) on the
        # critic's values; returns are the value targets
        ref_logp = batch["ref_logp"]
        kl_tok = batch["old_logp"] - ref_logp if ref_logp is not None else torch.zeros_like(batch["old_logp"])
        tok_reward = -beta * kl_tok * mask + outcome_tokens(rewards, lengths, mask)
        return adv_lib.gae(tok_reward, values, mask, part.gamma, part.lam)
    if name == "tree_grpo":  # the prompt-level plus the tree-level normalised reward
        return adv_lib.tree_grpo(rewards, group_ids, batch["tree_ids"]), None
    if name == "trl_gdpo":  # TRL's normalize_then_sum: each reward normalised in its group, their sum over the batch
        fn_rewards, w = _reward_components(part, batch, weights)
        return rewards_lib.normalize_then_sum(fn_rewards, w, group_ids, nan_mean_std).float(), None
    if name in ("grpo", "grpo_vectorized"):
        return _grpo(part, rewards, group_ids), None
    if not len(rewards):  # dynamic sampling kept no group on this rank (the steps above take part in collectives)
        return rewards, None
    if name in ("rloo", "rloo_vectorized"):
        return adv_lib.rloo(rewards, group_ids), None
    if name == "reinforce_plus_plus":
        return adv_lib.reinforce_plus_plus(outcome_tokens(rewards, lengths, mask), mask, part.gamma)[0], None
    if name == "reinforce_plus_plus_baseline":
        return adv_lib.reinforce_plus_plus_baseline(rewards, mask, group_ids), None
    if name == "remax":  # the baseline: the reward of the prompt's greedy completion (generation.sample_groups)
        return adv_lib.remax(outcome_tokens(rewards, lengths, mask), batch["baselines"], mask)[0], None
    if name == "opo":
        return adv_lib.opo(rewards, mask, group_ids), None
    if name == "gpg":
        return adv_lib.gpg(rewards, group_ids), None
    if name == "grpo_passk":
        return adv_lib.grpo_passk(rewards, group_ids, scale_by_std=part.scale != "none"), None
    if name == "gdpo":
        fn_rewards, w = _reward_components(part, batch, weights)
        if fn_rewards.isnan().any():
            raise ValueError("--adv-estimator gdpo: a reward function returned None for some completion, and "
                             "verl's GDPO normalises every function's reward on every row")
        return adv_lib.gdpo(fn_rewards.to(rewards.dtype), mask, group_ids, weights=w,
                            scale_by_std=part.scale != "none"), None
    raise ValueError(f"--adv-estimator: no advantage step for {name!r}")  # run_config validates the names
