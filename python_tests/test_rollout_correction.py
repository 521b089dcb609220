"""`rollout_is_weights` and `rollout_rejection_mask` against verl's rollout correction and TRL's vLLM importance-sampling modes."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import reference

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


@pytest.mark.parametrize("fields", [
    dict(rollout_is="token", rollout_is_upper=1.5),
    dict(rollout_is="sequence", rollout_is_mode="mask", rollout_is_lower=0.5, rollout_is_upper=2.0,
         rollout_is_batch_normalize=True),
    dict(rollout_rs=(("token_k1", -0.5, 0.5), ("seq_mean_k3", None, 0.1))),
    dict(rollout_is="token", rollout_is_mode="mask", rollout_is_lower=0.7, rollout_is_upper=1.4,
         rollout_rs=(("seq_max_k2", None, 0.2),)),
    dict(rollout_is="token", rollout_is_upper=None, rollout_is_batch_normalize=True),  # None: no bound (docs)
    dict(rollout_is="sequence", rollout_is_lower=0.8, rollout_is_upper=None, rollout_rs=(("seq_sum_k1", -1.0, None),)),
], ids=["token-tis", "sequence-icepop-normalized", "rejection", "token-icepop-and-rejection", "token-unbounded",
        "sequence-lower-bound-and-rejection"])
@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_config_fields_equal_the_functions(fields, name):
    """`PolicyLossConfig.rollout_*` = the weights of `rollout_is_weights` and the mask of
    `rollout_rejection_mask` passed by hand, in `policy_loss`, the reference and the fused op (whose kernel
    takes the weights folded into the advantage)."""
    g = torch.Generator().manual_seed(6)
    B, T, V = 6, 9, 40
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = rlkernels.token_logprobs(logits, targets, backend="torch")
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, mask = torch.randn(B, generator=g, dtype=torch.float64), torch.rand(B, T, generator=g) > 0.2
    config = rlkernels.presets.get(name, **fields)
    plain = rlkernels.presets.get(name)
    w, kept = None, mask
    if config.rollout_is:
        w = rlkernels.rollout_is_weights(old, rollout, mask, level=config.rollout_is, mode=config.rollout_is_mode,
                                         lower=config.rollout_is_lower, upper=config.rollout_is_upper,
                                         batch_normalize=config.rollout_is_batch_normalize)
    for test in config.rejection_tests():
        kept = kept & rlkernels.rollout_rejection_mask(old, rollout, mask, **test)
    assert 0 < kept.sum() and (kept.sum() < mask.sum()) == bool(config.rollout_rs)  # some tokens rejected, not all
    by_hand = rlkernels.policy_loss(logp, adv, kept, plain, old_logp=old, is_weights=w)
    by_config = rlkernels.policy_loss(logp, adv, mask, config, old_logp=old, rollout_logp=rollout)
    torch.testing.assert_close(by_config.loss, by_hand.loss)
    for key, value in by_hand.metrics.items():
        torch.testing.assert_close(by_config.metrics[key], value, msg=key)
    ref_logp = logp.clone().requires_grad_(True)
    ref_loss, ref_metrics = reference.policy_loss(ref_logp, adv, mask, config, old_logp=old, rollout_logp=rollout)
    spec_logp = logp.clone().requires_grad_(True)
    spec = rlkernels.policy_loss(spec_logp, adv, mask, config, old_logp=old, rollout_logp=rollout)
    torch.testing.assert_close(ref_loss, spec.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ref_loss, ref_logp)[0], torch.autograd.grad(spec.loss, spec_logp)[0],
                               rtol=1e-10, atol=1e-12)
    for key, value in spec.metrics.items():
        torch.testing.assert_close(ref_metrics[key], value, msg=key)
    x = logits.float().requires_grad_(True)
    fused = rlkernels.fused_policy_loss(x, targets, adv.float(), mask, config, old_logp=old.float(),
                                        rollout_logp=rollout.float())
    fused.loss.backward()
    y = logits.float().requires_grad_(True)
    composed = rlkernels.policy_loss(rlkernels.token_logprobs(y, targets), adv.float(), kept, plain,
                                     old_logp=old.float(), is_weights=None if w is None else w.float())
    composed.loss.backward()
    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)


def test_config_fields_are_checked():
    for fields, name in [(dict(rollout_is="row"), "rollout_is"), (dict(rollout_is_mode="clip"), "rollout_is_mode"),
                         (dict(rollout_is_upper=0.0), "rollout_is_upper"),
                         (dict(rollout_is_lower=3.0, rollout_is_upper=2.0), "rollout_is_lower"),
                         (dict(rollout_rs=(("token_k4", None, 1.0),)), "rollout_rs"),
                         (dict(rollout_rs=(("seq_max_k1", None, 1.0),)), "rollout_rs"),
                         (dict(rollout_rs=(("token_k2", 1.0, 0.5),)), "rollout_rs"),
                         (dict(rollout_rs="token_k1"), "rollout_rs")]:
        with pytest.raises((ValueError, TypeError), match=name):
            rlkernels.presets.dapo(**fields)
    config = rlkernels.presets.dapo(rollout_is="token")
    logp = -torch.rand(2, 3)
    with pytest.raises(ValueError, match="rollout_logp"):  # the sampler's log-probs are needed
        rlkernels.policy_loss(logp, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), config, old_logp=logp)
