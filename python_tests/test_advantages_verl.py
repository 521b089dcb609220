"""verl's advantage estimators in `rlkernels.advantages` equal verl 0.9.1's functions of `core_algos` (fp64, fresh
random inputs, ragged masks with an empty row and gaps, uneven groups with a group of one, shuffled rows)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rlkernels import advantages as adv

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

TOL = dict(rtol=1e-7, atol=1e-9)  # verl's masked means divide by n + 1e-8


def _batch(seed, B=11, T=9, singles=True, gaps=False):
    g = torch.Generator().manual_seed(seed)
    sizes = [3, 1, 4, 3] if singles else [3, 2, 4, 2]
    ids = torch.repeat_interleave(torch.arange(len(sizes)) * 7 - 5, torch.tensor(sizes))[torch.randperm(B, generator=g)]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[4] = 0
    mask = torch.arange(T)[None] < lengths[:, None]
    if gaps:  # multi-turn: tool output inside a response is masked
        mask &= torch.rand(B, T, generator=g) > 0.25
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    scores = torch.randint(0, 3, (B,), generator=g).to(torch.float64) + 0.5 * torch.randn(B, generator=g,
                                                                                         dtype=torch.float64)
    return rewards, mask, ids, scores, g


def _outcome(scores, mask):
    """verl's token-level rewards of one outcome score per row: the score at the row's last position."""
    rewards = torch.zeros(mask.shape, dtype=scores.dtype)
    rewards[:, -1] = scores
    return rewards


def _index(ids):
    return np.array([f"uid{int(i)}" for i in ids], dtype=object)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(seed, gamma):
    rewards, mask, _, _, _ = _batch(seed, gaps=True)
    want_adv, want_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask.double(), config=type("C", (), {"gamma": gamma})())
    got_adv, got_ret = adv.reinforce_plus_plus(rewards, mask, gamma)
    torch.testing.assert_close(got_ret, want_ret, **TOL)
    torch.testing.assert_close(got_adv, want_adv, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_baseline(seed):
    _, mask, ids, scores, _ = _batch(seed)
    want, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(_outcome(scores, mask), mask.double(),
                                                                                _index(ids))
    torch.testing.assert_close(adv.reinforce_plus_plus_baseline(scores, mask, ids), want, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_remax(seed):
    rewards, mask, _, scores, _ = _batch(seed, gaps=True)
    want_adv, want_ret = core_algos.compute_remax_outcome_advantage(rewards, scores, mask.double())
    got_adv, got_ret = adv.remax(rewards, scores, mask)
    torch.testing.assert_close(got_ret, want_ret, **TOL)
    torch.testing.assert_close(got_adv, want_adv, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_opo(seed):
    _, mask, ids, scores, _ = _batch(seed)
    want, _ = core_algos.compute_opo_outcome_advantage(_outcome(scores, mask), mask.double(), _index(ids))
    torch.testing.assert_close(adv.opo(scores, mask, ids)[:, None] * mask, want, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_gpg(seed):
    _, mask, ids, scores, _ = _batch(seed)
    scores[::3] = 0.0  # GPG's α counts the rows with a nonzero reward
    want, _ = core_algos.compute_gpg_outcome_advantage(_outcome(scores, mask), mask.double(), _index(ids))
    torch.testing.assert_close(adv.gpg(scores, ids)[:, None] * mask, want, **TOL)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_passk(seed, scale_by_std):
    _, mask, ids, scores, _ = _batch(seed, singles=False)
    scores = scores.round()  # ties, at the top too
    want, _ = core_algos.compute_grpo_passk_outcome_advantage(_outcome(scores, mask), mask.double(), _index(ids),
                                                               config={"norm_adv_by_std_in_grpo": scale_by_std})
    torch.testing.assert_close(adv.grpo_passk(scores, ids, scale_by_std=scale_by_std)[:, None] * mask, want, **TOL)
    with pytest.raises(ValueError, match="group_ids"):  # verl too: Pass@k needs two samples
        adv.grpo_passk(scores, torch.arange(len(scores)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_gdpo(seed, scale_by_std):
    """One component (verl's default: the token-level rewards) in fp64, and two weighted components by verl's
    `gdpo_reward_keys` (which verl reads in fp32)."""
    _, mask, ids, scores, g = _batch(seed)
    want, _ = core_algos.compute_gdpo_outcome_advantage(_outcome(scores, mask), mask.double(), _index(ids),
                                                         norm_adv_by_std_in_grpo=scale_by_std)
    # verl divides a group of one by 1 + eps in fp32 (its σ = torch.tensor(1.0)): 5e-8 relative
    torch.testing.assert_close(adv.gdpo(scores[:, None], mask, ids, scale_by_std=scale_by_std), want, rtol=1e-7,
                               atol=1e-7)
    parts = torch.randn(len(scores), 2, generator=g).float()
    B, T = mask.shape
    batch = {"prompts": torch.zeros(B, 3), "attention_mask": torch.cat([torch.ones(B, 3), mask.float()], 1).long()}
    config = {"gdpo_reward_keys": ["format", "accuracy"], "gdpo_reward_weights": [0.3, 1.5]}
    want, _ = core_algos.compute_gdpo_outcome_advantage(
        torch.zeros(B, T), mask.float(), _index(ids), norm_adv_by_std_in_grpo=scale_by_std, config=config,
        non_tensor_batch={"format": parts[:, 0].numpy(), "accuracy": parts[:, 1].numpy()}, batch=batch)
    got = adv.gdpo(parts, mask, ids, weights=[0.3, 1.5], scale_by_std=scale_by_std)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_optimal_token_baseline(seed, compact, zero_tail, weighted):
    rewards, mask, ids, _, g = _batch(seed, gaps=compact)
    B, T = mask.shape
    if seed % 2:  # a unique longest row in a group: the zero tail applies
        mask[ids == ids[0]] &= torch.arange(T) < T - 3
        mask[0] = torch.arange(T) < T
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sum_pi2 = torch.rand(B, T, generator=g, dtype=torch.float64)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5 if weighted else None
    fn = (core_algos.compute_multi_turn_optimal_token_baseline_advantage if compact
          else core_algos.compute_optimal_token_baseline_advantage)
    want_adv, want_ret = fn(rewards, mask.double(), _index(ids), old, sum_pi2, rollout_is_weights=weights,
                            handle_zero_tail=zero_tail)
    got_adv, got_ret = adv.optimal_token_baseline(rewards, mask, old, sum_pi2, ids, is_weights=weights,
                                                  zero_tail=zero_tail, compact=compact)
    torch.testing.assert_close(got_ret, want_ret, **TOL)
    torch.testing.assert_close(got_adv, want_adv, **TOL)


def test_group_size_equals_group_ids_and_bad_inputs_are_named():
    _, mask, _, scores, _ = _batch(0)
    scores, mask, ids = scores[:9], mask[:9], torch.arange(9) // 3
    torch.testing.assert_close(adv.opo(scores, mask, group_size=3), adv.opo(scores, mask, ids))
    torch.testing.assert_close(adv.gdpo(scores[:, None], mask, group_size=3), adv.gdpo(scores[:, None], mask, ids))
    with pytest.raises(ValueError, match="mask"):
        adv.opo(scores, mask[:5], ids)
    with pytest.raises(ValueError, match="weights"):
        adv.gdpo(scores[:, None], mask, ids, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="baselines"):
        adv.remax(torch.zeros(mask.shape), scores[:5], mask)
    with pytest.raises(ValueError, match="f_norm"):
        adv.gpg(scores, ids, f_norm=0.0)


@pytest.mark.parametrize("seed", range(3))
def test_group_baselines_keep_precision_of_large_rewards(seed):
    """fp32 rewards near 1e3 with a spread of 1: every group baseline centres on the group max first, so the
    advantages keep the spread's precision (a plain mean carried 3.4e-5 here); verl's function in fp64 is the oracle."""
    _, mask, ids, scores, _ = _batch(seed)
    lone = (1000.0 + scores).float()
    scores = lone.double()  # the oracle sees the same fp32 rewards
    cases = [
        (adv.gpg(lone, ids), core_algos.compute_gpg_outcome_advantage(_outcome(scores, mask), mask.double(),
                                                                      _index(ids))[0][:, -1]),
        (adv.opo(lone, mask, ids), core_algos.compute_opo_outcome_advantage(_outcome(scores, mask), mask.double(),
                                                                            _index(ids))[0][:, -1]),
    ]
    for got, want in cases:
        got = got.double() * mask[:, -1]
        assert (got - want).abs().max() < 2e-6, (got - want).abs().max()
    got = adv.reinforce_plus_plus_baseline(lone, mask, ids).double()
    want, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(_outcome(scores, mask), mask.double(),
                                                                                _index(ids))
    assert (got - want).abs().max() < 2e-6, (got - want).abs().max()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("norm", [True, False])
def test_group_of_one_as_verl_grpo_with_lone_keep(seed, norm):
    """`group_normalized(..., lone="keep")` is verl's `grpo` (a row alone in its group keeps R/(1 + ε), or R
    without the std), and the default gives that row 0, as TRL."""
    _, mask, ids, scores, _ = _batch(seed)
    want, _ = core_algos.compute_grpo_outcome_advantage(_outcome(scores, mask), mask.double(), _index(ids),
                                                        norm_adv_by_std_in_grpo=norm)
    scale = "group" if norm else None
    got = adv.group_normalized(scores, ids, scale=scale, lone="keep")
    torch.testing.assert_close(got[:, None] * mask, want, **TOL)
    alone = torch.tensor([(ids == i).sum() == 1 for i in ids])
    assert alone.any() and (adv.group_normalized(scores, ids, scale=scale)[alone] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_group_of_one_as_verl_rloo_with_lone_keep(seed):
    _, mask, ids, scores, _ = _batch(seed)
    want, _ = core_algos.compute_rloo_outcome_advantage(_outcome(scores, mask), mask.double(), _index(ids))
    torch.testing.assert_close(adv.rloo(scores, ids, lone="keep")[:, None] * mask, want, **TOL)
    with pytest.raises(ValueError, match="lone"):
        adv.rloo(scores, ids, lone="verl")
