"""Advantage estimators (docs/math.md §13): GAE and the GRPO family here; verl's other estimators from
`_group_advantages` (a group baseline) and `_token_advantages` (token-level returns).

Plain PyTorch, vectorised over rows and over groups: GAE is one reverse scan over the T
positions of a ``(B, T)`` batch; group statistics are ``index_add_`` reductions over a group
index (``_groups.group_index``), so there is no Python loop over groups. Results are fp64 for
fp64 inputs and fp32 otherwise (fp16/bf16 inputs are computed and returned in fp32).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_choice,
    check_mask,
    check_real,
    check_same_shape,
    check_tensor,
)
from ._dtypes import acc_dtype
from ._group_advantages import gdpo, gpg, grpo_passk, opo, reinforce_plus_plus_baseline
from ._groups import check_ids, group_centered, group_index, group_std, pair_index
from ._token_advantages import masked_whiten, optimal_token_baseline, reinforce_plus_plus, remax

__all__ = ["gae", "group_normalized", "rloo", "tree_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
           "remax", "opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"]


def _work(rewards: torch.Tensor) -> torch.Tensor:
    return rewards.to(acc_dtype(rewards))


def _check_rewards(rewards) -> torch.Tensor:
    return check_tensor("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token-level ``rewards``/``values`` ``(B, T)``.

    As verl's ``compute_gae_advantage_return``: scanning t = T−1 .. 0,
    ``δ_t = r_t + γ·V_next − V_t`` and ``A_t = δ_t + γλ·A_next``; at masked-out positions
    (``mask`` 0) ``V_next`` and the running advantage are carried through unchanged, so the
    masked-out position's output is the advantage of the next valid token. ``returns = A + V``
    (before whitening). With ``whiten``, ``A ← (A − mean)/sqrt(var + 1e-8)`` with the mean and
    Bessel-corrected variance over all valid tokens of the batch (variance 0 below two
    tokens), applied to every position. Results are detached (computed under ``no_grad``),
    in fp64 when ``rewards`` or ``values`` is fp64, else fp32.
    """
    check_tensor("rewards", rewards, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("values", values, dtypes=FLOAT_DTYPES)
    check_same_shape("values", values, "rewards", rewards)
    check_tensor("mask", mask)
    check_same_shape("mask", mask, "rewards", rewards)
    mask = check_mask("mask", mask)
    gamma = check_real("gamma", gamma, 0.0, 1.0)
    lam = check_real("lam", lam, 0.0, 1.0)
    if not isinstance(whiten, bool):
        raise TypeError(f"whiten: expected a bool, got {type(whiten).__name__}")

    dtype = torch.promote_types(acc_dtype(rewards), acc_dtype(values))
    r, v = rewards.to(dtype), values.to(dtype)
    B, T = r.shape
    adv = torch.empty_like(r)
    next_value = r.new_zeros(B)
    running = r.new_zeros(B)
    for t in range(T - 1, -1, -1):
        m_t = mask[:, t]
        step = r[:, t] + gamma * next_value - v[:, t] + (gamma * lam) * running
        next_value = torch.where(m_t, v[:, t], next_value)
        running = torch.where(m_t, step, running)
        adv[:, t] = running
    returns = adv + v
    return (masked_whiten(adv, mask) if whiten else adv), returns


LONE_CHOICES = ("zero", "keep")


def _keep_lone(out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor, lone: str,
               divisor=1.0) -> torch.Tensor:
    """`out`, except that under lone="keep" a row alone in its group has its reward / `divisor` (verl's baseline 0)."""
    if check_choice("lone", lone, LONE_CHOICES) == "zero":
        return out
    return torch.where((counts == 1)[inverse], x / divisor, out)


def group_normalized(
    rewards: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    scale: Optional[str] = "group",
    eps: float = 1e-6,
    lone: str = "zero",
) -> torch.Tensor:
    """GRPO advantages ``(B,)``: each reward minus its group mean, divided by
    ``σ_group + eps`` (``scale="group"``), by ``σ_batch + eps`` (``"batch"``, TRL's
    ``scale_rewards="batch"``: the std of all rewards) or not at all (``None``, Dr. GRPO).
    Standard deviations are Bessel-corrected; a group of one (or a batch of one) has std 0,
    and its advantage is 0 (``lone="zero"``, TRL's), or under ``lone="keep"`` (verl's ``grpo``:
    μ = 0, σ = 1) its reward divided by ``1 + eps`` (``"group"``), ``σ_batch + eps`` or 1."""
    _check_rewards(rewards)
    check_choice("scale", scale, ("group", "batch", None))
    eps = check_real("eps", eps, 0.0)
    x = _work(rewards)
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    centered, counts = group_centered(x, inverse, G)
    if scale == "group":
        divisor = group_std(centered, counts, inverse, G)[inverse] + eps
        return _keep_lone(centered / divisor, x, counts, inverse, lone, 1 + eps)
    if scale == "batch":
        n = x.shape[0]
        divisor = ((x - x.mean()).square().sum() / max(n - 1, 1)).sqrt() + eps if n else x.new_ones(())
        return _keep_lone(centered / divisor, x, counts, inverse, lone, divisor)
    return _keep_lone(centered, x, counts, inverse, lone)


def rloo(
    rewards: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    lone: str = "zero",
) -> torch.Tensor:
    """REINFORCE leave-one-out advantages ``(B,)``: ``R_i − mean_{j≠i, j∈g(i)} R_j``,
    computed as ``n/(n−1)·(R_i − μ_g)`` (the same quantity); 0 for a group of one, or its reward
    under ``lone="keep"`` (verl's ``rloo``: an empty leave-one-out mean is 0)."""
    _check_rewards(rewards)
    x = _work(rewards)
    inverse, G = group_index(x.shape[0], group_ids, group_size, x.device)
    centered, counts = group_centered(x, inverse, G)
    factor = counts / (counts - 1).clamp(min=1)  # a group of one has centred value 0
    return _keep_lone(centered * factor[inverse], x, counts, inverse, lone)


def tree_grpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    tree_ids: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Tree-GRPO advantages ``(B,)``:
    ``(R − μ_prompt)/(σ_prompt + ε) + (R − μ_tree)/(σ_tree + ε)``.

    Prompts are given by ``group_ids``; a tree is the set of rows sharing both the prompt and
    ``tree_ids`` (so tree ids may be numbered per prompt or across the batch). Bessel stds;
    groups of one contribute 0."""
    _check_rewards(rewards)
    eps = check_real("eps", eps, 0.0)
    x = _work(rewards)
    inverse, G = group_index(x.shape[0], group_ids, None, x.device)
    check_ids("tree_ids", tree_ids, x.shape[0], x.device)
    tinv, TG = pair_index(group_ids, tree_ids)
    prompt_c, prompt_n = group_centered(x, inverse, G)
    tree_c, tree_n = group_centered(x, tinv, TG)
    out = prompt_c / (group_std(prompt_c, prompt_n, inverse, G)[inverse] + eps) + tree_c / (
        group_std(tree_c, tree_n, tinv, TG)[tinv] + eps
    )
    return out
