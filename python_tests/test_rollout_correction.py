"""`rollout_is_weights` and `rollout_rejection_mask` against verl's rollout correction and TRL's vLLM importance-sampling modes."""
from __future__ import annotations

import pytest
import torch

import rlkernels

from loss_inputs import random_loss_inputs


def _batch(seed, spread=0.4):
    inputs = random_loss_inputs(B=6, T=9, noise=0.3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    old = torch.where(inputs["mask"], inputs["old_logp"], 0.0)
    rollout = old + spread * torch.randn(old.shape, generator=g, dtype=torch.float64)
    return old, rollout, inputs["mask"]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, 1.3, "0.5_1.5", "0.8_3.0"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_verl(level, threshold, normalize):
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    for seed in range(3):
        old, rollout, mask = _batch(seed)
        theirs, _ = helper.compute_rollout_correction_weights(old - rollout, mask.double(), rollout_is=level,
                                                              rollout_is_threshold=threshold,
                                                              rollout_is_batch_normalize=normalize)
        if isinstance(threshold, str):  # verl's "lower_upper": IcePop, zero outside the band
            lower, upper = map(float, threshold.split("_"))
            kw = dict(mode="mask", lower=lower, upper=upper)
        else:  # a single bound: truncated IS
            kw = dict(mode="truncate", upper=threshold)
        ours = rlkernels.rollout_is_weights(old, rollout, mask, level=level, batch_normalize=normalize, **kw)
        # verl's masked mean adds 1e-8 to the count: ~3e-10 relative at these sizes
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_modes(level, mode):
    """TRL's `{level}_{mode}` with clip_min/clip_max: the same weights on the mask, by their definition
    (exp of the masked log-ratio difference, NaN counted as 0; clamped, or zeroed outside the band)."""
    old, rollout, mask = _batch(5)
    rollout[0, 0] = float("nan")  # a token the engine could not score
    ours = rlkernels.rollout_is_weights(old, rollout, mask, level=level, mode=mode, lower=0.5, upper=1.8)
    diff = torch.nan_to_num((old - rollout) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if level == "sequence" else diff).expand_as(diff)
    if mode == "truncate":
        expected = ratio.clamp(0.5, 1.8)
    else:
        expected = ratio.masked_fill((ratio < 0.5) | (ratio > 1.8), 0.0)
    torch.testing.assert_close(ours[mask], expected[mask])
    assert (ours[~mask] == 0).all()


def test_weights_feed_the_loss_and_bad_arguments_are_named():
    old, rollout, mask = _batch(2)
    w = rlkernels.rollout_is_weights(old, rollout, mask, level="sequence", mode="mask", lower=0.7, upper=1.5)
    logp = old.clone().requires_grad_(True)
    adv = torch.randn(mask.shape[0], dtype=torch.float64)
    out = rlkernels.policy_loss(logp, adv, mask, rlkernels.presets.grpo(kl_coef=0.0), old_logp=old, is_weights=w)
    out.loss.backward()
    dropped = (w == 0) & mask
    assert dropped.any() and (logp.grad[dropped] == 0).all()  # a masked-out row gets no policy gradient
    with pytest.raises(ValueError, match="level"):
        rlkernels.rollout_is_weights(old, rollout, mask, level="row")
    with pytest.raises(ValueError, match="lower"):
        rlkernels.rollout_is_weights(old, rollout, mask, lower=3.0, upper=2.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        rlkernels.rollout_is_weights(old, rollout[:, :3], mask)


def test_rejection_mask_levels_nan_and_bad_arguments():
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    rollout = old - torch.tensor([[0.0] * 6, [0.5] * 6, [0.05] * 3 + [2.0] * 3], dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 4:] = False
    rollout[0, 5] = float("nan")  # padding: never read
    # k2 per token: 0, 0.125, 0.00125 / 2.0 -> the last three tokens of row 2 go alone
    token = rlkernels.rollout_rejection_mask(old, rollout, mask, estimator="k2", level="token", upper=0.5)
    assert token[2].tolist() == [True] * 3 + [False] * 3 and token[:2].equal(mask[:2])
    # the row's max of k2 rejects row 2 whole; its mean (1.00125) too, row 1's (0.125) passes
    for level in ("seq_max", "seq_mean"):
        rows = rlkernels.rollout_rejection_mask(old, rollout, mask, estimator="k2", level=level, upper=0.5)
        assert rows.any(-1).tolist() == [True, True, False], level
    # k1 in log space, both sides: row 1 has r = 0.5 (k1 = −0.5), below a lower bound of −0.1
    both = rlkernels.rollout_rejection_mask(old, rollout, mask, estimator="k1", level="seq_mean", lower=-0.1, upper=0.1)
    assert both.any(-1).tolist() == [True, False, False]
    nan = rollout.clone()
    nan[1, 2] = float("nan")  # a token the sampler could not score is rejected, and so is its row's sum
    assert not rlkernels.rollout_rejection_mask(old, nan, mask, estimator="k3", upper=1.0)[1, 2]
    assert not rlkernels.rollout_rejection_mask(old, nan, mask, estimator="k3", level="seq_sum", upper=10.0)[1].any()
    for kw, name in [(dict(estimator="k4"), "estimator"), (dict(level="row"), "level"),
                     (dict(estimator="k1", level="seq_max"), "estimator"), (dict(lower=1.0, upper=0.5), "lower"),
                     (dict(upper=float("nan")), "upper")]:
        with pytest.raises(ValueError, match=name):
            rlkernels.rollout_rejection_mask(old, rollout, mask, **kw)
    with pytest.raises(ValueError, match="rollout_logp"):
        rlkernels.rollout_rejection_mask(old, rollout[:, :3], mask)
