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


def _gae(part: Advantages, batch: dict, weights, values, beta):
    """Per-token reward = −β·k1(π_old ‖ π_ref) at every token, + R at the last token; GAE(γ, λ) on the critic's
    values; the returns are the value targets."""
    ref_logp, mask = batch["ref_logp"], batch["mask"]
    kl_tok = batch["old_logp"] - ref_logp if ref_logp is not None else torch.zeros_like(batch["old_logp"])
    tok_reward = -beta * kl_tok * mask + outcome_tokens(batch["rewards"], batch["lengths"], mask)
    return adv_lib.gae(tok_reward, values, mask, part.gamma, part.lam)


def _gdpo(part: Advantages, batch: dict, weights, values, beta):
    fn_rewards, w = _reward_components(part, batch, weights)
    if fn_rewards.isnan().any():
        raise ValueError("--adv-estimator gdpo: a reward function returned None for some completion, and "
                         "verl's GDPO normalises every function's reward on every row")
    return adv_lib.gdpo(fn_rewards.to(batch["rewards"].dtype), batch["mask"], batch["group_ids"], weights=w,
                        scale_by_std=part.scale != "none"), None


def _per_row(form):
    """An estimator of `form(part, batch)` -> advantages alone (no critic targets)."""
    return lambda part, batch, weights, values, beta: (form(part, batch), None)


# name -> estimator(part, batch, weights, values, beta) -> (advantages, returns). `weights`: the reward functions'
# (GDPO's); `values`: the critic's (GAE); `beta`: PPO's KL coefficient in the reward.
ESTIMATORS = {
    "snis": lambda part, batch, weights, values, beta: (None, None),  # SNIS builds its own baseline in the loss
    "gae": _gae,
    "tree_grpo": _per_row(lambda part, b: adv_lib.tree_grpo(b["rewards"], b["group_ids"], b["tree_ids"])),
    # TRL's normalize_then_sum: each reward normalised in its group, their sum over the batch
    "trl_gdpo": lambda part, batch, weights, values, beta: (rewards_lib.normalize_then_sum(
        *_reward_components(part, batch, weights), batch["group_ids"], nan_mean_std).float(), None),
    "grpo": _per_row(lambda part, b: _grpo(part, b["rewards"], b["group_ids"])),
    "rloo": _per_row(lambda part, b: adv_lib.rloo(b["rewards"], b["group_ids"])),
    "reinforce_plus_plus": _per_row(lambda part, b: adv_lib.reinforce_plus_plus(
        outcome_tokens(b["rewards"], b["lengths"], b["mask"]), b["mask"], part.gamma)[0]),
    "reinforce_plus_plus_baseline": _per_row(lambda part, b: adv_lib.reinforce_plus_plus_baseline(
        b["rewards"], b["mask"], b["group_ids"])),
    # the baseline: the reward of the prompt's greedy completion (generation.sample_groups)
    "remax": _per_row(lambda part, b: adv_lib.remax(outcome_tokens(b["rewards"], b["lengths"], b["mask"]),
                                                     b["baselines"], b["mask"])[0]),
    "opo": _per_row(lambda part, b: adv_lib.opo(b["rewards"], b["mask"], b["group_ids"])),
    "gpg": _per_row(lambda part, b: adv_lib.gpg(b["rewards"], b["group_ids"])),
    "grpo_passk": _per_row(lambda part, b: adv_lib.grpo_passk(b["rewards"], b["group_ids"],
                                                               scale_by_std=part.scale != "none")),
    "gdpo": _gdpo,
}
ESTIMATORS["grpo_vectorized"], ESTIMATORS["rloo_vectorized"] = ESTIMATORS["grpo"], ESTIMATORS["rloo"]
# the estimators that take part in collectives, so run on a rank whose dynamic sampling kept no group
_ON_EMPTY = {"snis", "gae", "tree_grpo", "trl_gdpo", "grpo", "grpo_vectorized"}


def register(name: str, estimator, on_empty: bool = False) -> None:
    """Make `estimator(part, batch, weights, values, beta) -> (advantages, returns)` the --adv-estimator `name`
    (from a --plugin). `on_empty`: it is also called on a rank that has no rows (it takes part in collectives);
    else such a rank's advantages are the empty rewards."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register: name must be an identifier, got {name!r}")
    if name in ESTIMATORS:
        raise ValueError(f"register: an estimator {name!r} exists already")
    if not callable(estimator):
        raise TypeError(f"register: estimator must be callable, got {type(estimator).__name__}")
    ESTIMATORS[name] = estimator
    if on_empty:
        _ON_EMPTY.add(name)


def advantages(part: Advantages, batch: dict, weights: list, values=None, beta: float = 0.0) -> tuple:
    """(advantages, returns) of the step's training rows, by the estimator `part.estimator` names."""
    if part.estimator not in ESTIMATORS:  # run_config validates the names
        raise ValueError(f"--adv-estimator: no advantage step for {part.estimator!r}")
    if not len(batch["rewards"]) and part.estimator not in _ON_EMPTY:
        return batch["rewards"], None
    return ESTIMATORS[part.estimator](part, batch, weights, values, beta)
