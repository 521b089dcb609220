"""`policy_loss` against `reference.policy_loss`, and properties derived by hand."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.losses.kl import kl_estimate

from loss_inputs import random_loss_inputs

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}
SEQUENCE_PRESETS = ("gspo", "fspo", "gepo", "gmpo", "snis")

# Options exercised beside the presets: each changes one code path of the loss.
OPTIONS = [
    ("ppo", {}),
    ("ppo", dict(delta=1.5)),
    ("grpo", dict(kl_estimator="k1")),
    ("grpo", dict(kl_estimator="k2", kl_clamp=0.05)),
    ("grpo", dict(kl_bias_correction=True, entropy_coef=0.01)),
    ("grpo", dict(agg="seq_mean_token_sum")),
    ("dr_grpo", dict(norm_length=11)),
    ("dapo", dict(entropy_coef=-0.02)),
    ("gspo", dict(dual_clip=2.0, clip_low=0.1, clip_high=0.2)),
    ("gspo", dict(agg="token_mean", kl_estimator="k3", kl_coef=0.1)),
    ("gspo_token", dict(delta=2.0, clip_low=0.1, clip_high=0.2)),
    ("fspo", dict(fspo_c_low=0.5, fspo_c_high=0.2)),
    ("gepo", dict(dual_clip=3.0)),
    ("cispo", dict(clip_low=0.3, clip_high=0.5)),
    ("gmpo", dict(clip_low=0.1, clip_high=0.3)),
    ("snis", dict(entropy_coef=0.1)),
    ("ppo", dict(objective="reinforce", dual_clip=None)),
]


def _call(fn, inputs, config, **extra):
    kwargs = {k: v for k, v in inputs.items() if k not in ("logp", "advantages", "mask")}
    kwargs.update(extra)
    if config.ratio not in ("group_expectation", "snis"):
        kwargs.pop("group_ids")
    return fn(inputs["logp"], inputs["advantages"], inputs["mask"], config, **kwargs)


def _compare(config, inputs, dtype, **extra):
    logp = inputs["logp"].clone().requires_grad_(True)
    ours = _call(rlkernels.policy_loss, {**inputs, "logp": logp}, config, **extra)
    (g_ours,) = torch.autograd.grad(ours.loss, logp)
    logp_ref = inputs["logp"].clone().requires_grad_(True)
    loss_ref, metrics_ref = _call(reference.policy_loss, {**inputs, "logp": logp_ref}, config, **extra)
    (g_ref,) = torch.autograd.grad(loss_ref, logp_ref)
    torch.testing.assert_close(ours.loss, loss_ref, **TOL[dtype])
    torch.testing.assert_close(g_ours, g_ref, **TOL[dtype])
    assert set(ours.metrics) == set(metrics_ref)
    for key, value in metrics_ref.items():
        torch.testing.assert_close(ours.metrics[key], value, **TOL[dtype], msg=f"metric {key}")
    assert torch.isfinite(g_ours).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("noise", [1e-4, 0.3])  # GSPO's 3e-4 band: mostly unclipped, mostly clipped
@pytest.mark.parametrize("name", presets.NAMES)
def test_presets_match_reference(name, noise, dtype):
    for seed in range(3):
        inputs = random_loss_inputs(dtype=dtype, noise=noise, seed=seed)
        _compare(presets.get(name), inputs, dtype)


@pytest.mark.parametrize("name,overrides", OPTIONS, ids=[f"{n}-{'-'.join(o) or 'default'}" for n, o in OPTIONS])
def test_options_match_reference(name, overrides):
    per_token = name not in SEQUENCE_PRESETS
    for seed in range(3):
        inputs = random_loss_inputs(noise=0.3, per_token_adv=per_token, seed=seed)
        _compare(presets.get(name, **overrides), inputs, torch.float64)


@pytest.mark.parametrize("name", presets.NAMES)
def test_global_counts_match_reference(name):
    inputs = random_loss_inputs(noise=0.2, seed=5)
    _compare(presets.get(name), inputs, torch.float64, num_items=17.0, num_seqs=9.0)


# cispo, gspo_token and snis hold sg(f(ℓ)) factors: finite differences see them move, by design,
# so their gradients are pinned by the hand-derived tests below instead.
@pytest.mark.parametrize("name,overrides", [
    ("ppo", {}), ("grpo", {}), ("dr_grpo", {}), ("dapo", {}), ("gspo", dict(clip_low=0.3, clip_high=0.3)),
    ("fspo", dict(fspo_c_low=0.3, fspo_c_high=0.3)), ("gepo", {}), ("gmpo", {}),
])
def test_gradcheck(name, overrides):
    inputs = random_loss_inputs(B=4, T=5, noise=0.2, group_size=2, empty_rows=(), seed=1)
    config = presets.get(name, entropy_coef=0.01, **overrides)
    mask = inputs["mask"]

    def loss(logp, entropy):
        return _call(rlkernels.policy_loss, {**inputs, "logp": logp, "entropy": entropy}, config).loss

    logp = torch.where(mask, inputs["logp"], -1.0).requires_grad_(True)
    entropy = torch.where(mask, inputs["entropy"], 1.0).requires_grad_(True)
    assert torch.autograd.gradcheck(loss, (logp, entropy))


# ---- hand-derived checks ---------------------------------------------------------------------

def test_on_policy_token_clip_is_minus_mean_advantage():
    # w = 1 on-policy, so the clipped surrogate is −A on every token; token_mean averages it.
    inputs = random_loss_inputs(per_token_adv=True, seed=3)
    m = inputs["mask"]
    out = rlkernels.policy_loss(inputs["logp"], inputs["advantages"], m, presets.dapo())
    expected = inputs["advantages"][m].mean()
    torch.testing.assert_close(out.loss, -expected)
    assert float(out.metrics["ratio_mean"]) == 1.0 and float(out.metrics["clip_frac"]) == 0.0


def test_gspo_gradient_is_minus_a_s_over_l():
    inputs = random_loss_inputs(noise=0.05, seed=4)
    m, adv = inputs["mask"], inputs["advantages"]
    # A band wide enough that nothing is clipped, so every token's gradient is −A·s/L·(1/B).
    config = presets.gspo(clip_low=0.99, clip_high=10.0)
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, adv, m, config, old_logp=inputs["old_logp"])
    (grad,) = torch.autograd.grad(out.loss, logp)
    lengths = m.sum(-1)
    rows = (lengths > 0).sum()
    for i in range(m.shape[0]):
        if lengths[i] == 0:
            assert (grad[i] == 0).all()
            continue
        s = torch.exp((inputs["logp"][i][m[i]] - inputs["old_logp"][i][m[i]]).mean())
        expected = -adv[i] * s / lengths[i] / rows
        torch.testing.assert_close(grad[i][m[i]], expected.expand(int(lengths[i])))
        assert (grad[i][~m[i]] == 0).all()


@pytest.mark.parametrize("noise", [1e-4, 0.3])
def test_gspo_and_gspo_token_agree_for_row_advantages(noise):
    inputs = random_loss_inputs(noise=noise, seed=6)
    a = _call_with_grad(presets.gspo(), inputs)
    b = _call_with_grad(presets.gspo_token(), inputs)
    torch.testing.assert_close(a, b)


def _call_with_grad(config, inputs):
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, inputs["advantages"], inputs["mask"], config, old_logp=inputs["old_logp"])
    return (out.loss, *torch.autograd.grad(out.loss, logp))


def test_fspo_band_widens_as_sqrt_length():
    # The same per-token log-ratio d = 0.02: S = L·d against the band 0.03·√L.
    # L = 1: S = 0.02 < 0.03 (inside); L = 4: 0.08 > 0.06 (clipped); L = 9: 0.18 > 0.09 (clipped).
    lengths = [1, 4, 9]
    T = 9
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    logp = torch.full((3, T), -1.0, dtype=torch.float64, requires_grad=True)
    old = torch.full((3, T), -1.02, dtype=torch.float64)
    adv = torch.ones(3, dtype=torch.float64)
    out = rlkernels.policy_loss(logp, adv, mask, presets.fspo(), old_logp=old)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert (grad[0, :1] != 0).all() and (grad[1] == 0).all() and (grad[2] == 0).all()
    torch.testing.assert_close(out.metrics["clip_frac_high"], torch.tensor(13 / 14, dtype=torch.float64))
    # A per-token d of 0.029 stays inside the band only where √L·0.029·√L... i.e. L·0.029 < 0.03·√L ⇔ L < 1.07.
    # So the acceptance threshold on d shrinks as 1/√L: at L = 9 a row with d = 0.0099 is inside.
    old9 = torch.full((1, T), -1.0099, dtype=torch.float64)
    out9 = rlkernels.policy_loss(logp[2:].detach(), adv[:1], mask[2:], presets.fspo(), old_logp=old9)
    assert float(out9.metrics["clip_frac"]) == 0.0


def test_gepo_identical_sequences_give_weight_one():
    T = 5
    row = -torch.rand(T, dtype=torch.float64)
    logp = row.expand(4, T).clone()
    mask = torch.ones(4, T, dtype=torch.bool)
    out = rlkernels.policy_loss(logp, torch.randn(4, dtype=torch.float64), mask, presets.gepo(group_size=4),
                                old_logp=logp.clone())
    torch.testing.assert_close(out.metrics["ratio_mean"], torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(out.metrics["ratio_max"], torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("estimator,grad_of_delta", [
    ("k1", lambda d: torch.ones_like(d)), ("k2", lambda d: -d), ("k3", lambda d: 1 - torch.exp(d)),
])
def test_kl_estimator_gradients(estimator, grad_of_delta):
    logp = -torch.rand(50, dtype=torch.float64) * 4
    ref = -torch.rand(50, dtype=torch.float64) * 4
    logp.requires_grad_(True)
    k = kl_estimate(ref, logp, estimator, 20.0)
    (grad,) = torch.autograd.grad(k.sum(), logp)
    torch.testing.assert_close(grad, grad_of_delta(ref - logp.detach()))
    if estimator == "k3":
        assert (k >= 0).all()
        torch.testing.assert_close(k, torch.exp(ref - logp) - (ref - logp) - 1)


def test_k3_in_the_loss_has_gradient_beta_times_one_minus_exp_delta():
    inputs = random_loss_inputs(seed=7)
    m = inputs["mask"]
    logp = inputs["logp"].clone().requires_grad_(True)
    config = presets.ppo(objective="reinforce", dual_clip=None, kl_estimator="k3", kl_coef=0.5)
    zero_adv = torch.zeros_like(inputs["advantages"])
    out = rlkernels.policy_loss(logp, zero_adv, m, config, ref_logp=inputs["ref_logp"])
    (grad,) = torch.autograd.grad(out.loss, logp)
    delta = inputs["ref_logp"] - inputs["logp"]
    expected = torch.where(m, 0.5 * (1 - torch.exp(delta)) / m.sum(), 0.0)
    torch.testing.assert_close(grad, expected)


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 3), -3.0, dtype=torch.float64)  # w = e³ ≈ 20
    adv = torch.tensor([-2.0], dtype=torch.float64)
    out = rlkernels.policy_loss(logp, adv, torch.ones(1, 3, dtype=torch.bool), presets.ppo(), old_logp=old)
    torch.testing.assert_close(out.loss, torch.tensor(6.0, dtype=torch.float64))  # −c·A = 3·2
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert (grad == 0).all()


def test_cispo_gradient_is_clipped_weight_times_advantage():
    inputs = random_loss_inputs(noise=0.5, per_token_adv=True, seed=8)
    m = inputs["mask"]
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, inputs["advantages"], m, presets.cispo(clip_high=0.2), old_logp=inputs["old_logp"])
    (grad,) = torch.autograd.grad(out.loss, logp)
    w = torch.exp(inputs["logp"] - inputs["old_logp"]).clamp(max=1.2)
    expected = torch.where(m, -w * inputs["advantages"] / m.sum(), 0.0)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("name", presets.NAMES)
def test_empty_mask_gives_zero_loss_and_gradient(name):
    inputs = random_loss_inputs(seed=9)
    inputs["mask"] = torch.zeros_like(inputs["mask"])
    logp = inputs["logp"].clone().requires_grad_(True)
    out = _call(rlkernels.policy_loss, {**inputs, "logp": logp}, presets.get(name))
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert float(out.loss) == 0.0 and (grad == 0).all()
    assert all(torch.isfinite(v) and float(v) == 0.0 for k, v in out.metrics.items())


def test_plus_shift_of_old_and_current_changes_nothing_for_ratios():
    # Ratios depend only on ℓ − ℓ_old: shifting both leaves loss and gradient unchanged.
    inputs = random_loss_inputs(seed=10)
    a = _call_with_grad(presets.dapo(), inputs)
    shifted = {**inputs, "logp": inputs["logp"] - 1.5, "old_logp": inputs["old_logp"] - 1.5}
    torch.testing.assert_close(a, _call_with_grad(presets.dapo(), shifted))


# ---- bad input ------------------------------------------------------------------------------

def _good():
    return random_loss_inputs(B=4, T=5, group_size=2, seed=11)


@pytest.mark.parametrize("change,error,match", [
    (dict(logp=torch.zeros(4, 6, dtype=torch.float64)), ValueError, "mask"),
    (dict(logp=torch.zeros(4, 5, dtype=torch.float16)), TypeError, "logp"),
    (dict(logp=torch.zeros(20, dtype=torch.float64)), ValueError, "logp"),
    (dict(advantages=torch.zeros(3, dtype=torch.float64)), ValueError, "advantages"),
    (dict(advantages=torch.zeros(4, dtype=torch.int64)), TypeError, "advantages"),
    (dict(old_logp=torch.zeros(4, 4, dtype=torch.float64)), ValueError, "old_logp"),
    (dict(mask=torch.full((4, 5), 2)), ValueError, "mask"),
    (dict(group_ids=torch.zeros(3, dtype=torch.int64)), ValueError, "group_ids"),
    (dict(group_ids=torch.zeros(4)), TypeError, "group_ids"),
    (dict(num_items=0), ValueError, "num_items"),
])
def test_bad_inputs_name_the_argument(change, error, match):
    inputs = {**_good(), **change}
    args = {k: inputs.pop(k) for k in ("logp", "advantages", "mask")}
    with pytest.raises(error, match=match):
        rlkernels.policy_loss(args["logp"], args["advantages"], args["mask"], presets.gepo(), **inputs)


def test_missing_inputs_are_named():
    inputs = _good()
    with pytest.raises(ValueError, match="ref_logp"):
        rlkernels.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"], presets.grpo())
    with pytest.raises(ValueError, match="entropy"):
        rlkernels.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"], presets.dapo(entropy_coef=0.1))
    with pytest.raises(ValueError, match="rewards"):
        rlkernels.policy_loss(inputs["logp"], None, inputs["mask"], presets.snis(group_size=2))
    with pytest.raises(ValueError, match="group_ids"):
        rlkernels.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"], presets.gepo())
    with pytest.raises(TypeError, match="config"):
        rlkernels.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"], {"ratio": "token"})


def test_sequence_ratio_rejects_varying_token_advantages():
    inputs = random_loss_inputs(per_token_adv=True, seed=12)
    with pytest.raises(ValueError, match="advantages.*one advantage per row"):
        rlkernels.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"], presets.gspo())
    # the same advantage repeated over the row is accepted and equals the (B,) form
    row_adv = torch.randn(6, dtype=torch.float64)
    a = rlkernels.policy_loss(inputs["logp"], row_adv[:, None].expand(6, 7), inputs["mask"], presets.gspo(),
                              old_logp=inputs["old_logp"])
    b = rlkernels.policy_loss(inputs["logp"], row_adv, inputs["mask"], presets.gspo(), old_logp=inputs["old_logp"])
    torch.testing.assert_close(a.loss, b.loss)


@pytest.mark.parametrize("overrides,match", [
    (dict(ratio="tokens"), "ratio"),
    (dict(objective="cispo", ratio="sequence"), "objective"),
    (dict(agg="mean"), "agg"),
    (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_low=1.5), "clip_low"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(kl_coef=0.1), "kl_estimator"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(norm_length=0), "norm_length"),
    (dict(log_ratio_clamp=float("inf")), "log_ratio_clamp"),
    (dict(group_size=2.5), "group_size"),
])
def test_bad_config_names_the_field(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        presets.dapo(**overrides)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="preset"):
        presets.get("ppo2")
    with pytest.raises(ValueError, match="clip_hi"):
        presets.grpo(clip_hi=0.3)


def test_preset_table():
    # docs/math.md §9, row by row.
    table = {
        "ppo": ("token", "clip", 0.2, 0.2, None, 0.0, "token_mean"),
        "grpo": ("token", "clip", 0.2, 0.2, "k3", 0.04, "seq_mean_token_mean"),
        "dr_grpo": ("token", "clip", 0.2, 0.2, None, 0.0, "constant"),
        "dapo": ("token", "clip", 0.2, 0.28, None, 0.0, "token_mean"),
        "gspo": ("sequence", "clip", 3e-4, 4e-4, None, 0.0, "seq_mean_token_mean"),
        "gspo_token": ("sequence_token", "clip", 3e-4, 4e-4, None, 0.0, "seq_mean_token_mean"),
        "gepo": ("group_expectation", "clip", 0.2, 0.2, None, 0.0, "seq_mean_token_mean"),
        "cispo": ("token", "cispo", None, 4.0, None, 0.0, "token_mean"),
        "gmpo": ("geometric", "clip", 0.4, 0.4, None, 0.0, "seq_mean_token_mean"),
    }
    for name, row in table.items():
        c = presets.get(name)
        assert (c.ratio, c.objective, c.clip_low, c.clip_high, c.kl_estimator, c.kl_coef, c.agg) == row, name
    assert presets.ppo().dual_clip == 3.0
    assert (presets.fspo().ratio, presets.fspo().fspo_c_low, presets.fspo().fspo_c_high) == ("sequence_sum", 0.03, 0.03)
    assert (presets.snis().ratio, presets.snis().objective) == ("snis", "reinforce")
    assert math.isclose(1 + presets.cispo().clip_high, 5.0)


def test_snis_gradient_by_hand():
    # On-policy, s_i = 1 for every row, so ŵ_i = 1 and b_g = mean_g R: each token of row i gets
    # −(R_i − mean_g R) / (L_i · B) under seq_mean_token_mean.
    inputs = random_loss_inputs(seed=13, empty_rows=())
    m, rewards, groups = inputs["mask"], inputs["rewards"], inputs["group_ids"]
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, None, m, presets.snis(), rewards=rewards, group_ids=groups)
    (grad,) = torch.autograd.grad(out.loss, logp)
    lengths = m.sum(-1)
    for i in range(m.shape[0]):
        baseline = rewards[groups == groups[i]].mean()
        expected = -(rewards[i] - baseline) / (lengths[i] * m.shape[0])
        torch.testing.assert_close(grad[i][m[i]], expected.expand(int(lengths[i])))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 6), name=st.sampled_from(presets.NAMES), seed=st.integers(0, 10**6),
       noise=st.sampled_from([0.0, 1e-3, 0.5]))
def test_hypothesis_shapes_match_reference(B, T, name, seed, noise):
    inputs = random_loss_inputs(B, T, noise=noise, group_size=1, empty_rows=(), seed=seed)
    _compare(presets.get(name), inputs, torch.float64)


def test_gmpo_on_policy_gradient_by_hand():
    # On-policy every δ = 0, so s̃_i = 1: the row loss is −A_i and each token's gradient −A_i/(L_i·B).
    inputs = random_loss_inputs(seed=14)
    m, adv = inputs["mask"], inputs["advantages"]
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, adv, m, presets.gmpo())
    (grad,) = torch.autograd.grad(out.loss, logp)
    lengths, rows = m.sum(-1), (m.sum(-1) > 0).sum()
    torch.testing.assert_close(out.loss, -adv[lengths > 0].sum() / rows)
    expected = torch.where(m, -adv[:, None] / (lengths.clamp(min=1)[:, None] * rows), 0.0)
    torch.testing.assert_close(grad, expected)


def test_dr_grpo_divides_by_rows_times_max_length():
    # Dr. GRPO on-policy: Σ_tokens (−A) / (B · T), B = non-empty rows, T = padded length.
    inputs = random_loss_inputs(seed=15, per_token_adv=True)
    m, adv = inputs["mask"], inputs["advantages"]
    out = rlkernels.policy_loss(inputs["logp"], adv, m, presets.dr_grpo())
    rows = (m.sum(-1) > 0).sum()
    torch.testing.assert_close(out.loss, -adv[m].sum() / (rows * m.shape[1]))
