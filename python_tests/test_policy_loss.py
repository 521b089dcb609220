"""`policy_loss` against `reference.policy_loss`, and properties derived by hand."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.losses import objectives
from rlkernels.losses.kl import kl_estimate

from loss_inputs import preset, random_loss_inputs

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}
SEQUENCE_PRESETS = ("gspo", "fspo", "gepo", "gmpo", "snis", "luspo", "vespo")

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
    ("gpg", dict(agg="seq_mean_token_sum", kl_estimator="k3", kl_coef=0.1)),
    ("sapo", dict(sapo_tau_pos=2.0, sapo_tau_neg=0.5)),
    ("sapo", dict(ratio="sequence")),
    ("sapo", dict(ratio="sequence_token", agg="token_mean")),
    ("dppo_tv", dict(ratio_cap=1.2)),
    ("dppo_tv", dict(clip_low=0.01, clip_high=0.3, agg="seq_mean_token_mean")),
    ("dppo_kl", dict(clip_low=0.003, clip_high=0.01, ratio_cap=1.5)),
    ("clip_cov", dict(clip_cov_lb=-0.5, clip_cov_ub=0.5, clip_cov_ratio=0.5, clip_high=0.28)),
    ("clip_cov", dict(clip_cov_ratio=1.0, clip_cov_lb=0.0, agg="seq_mean_token_mean")),
    ("kl_cov", dict(kl_cov_ratio=0.5, kl_cov_coef=2.0)),
    ("kl_cov", dict(kl_cov_ratio=1.0, entropy_coef=0.01)),
    ("dro", dict(dro_beta=1.5, agg="seq_mean_token_mean")),
    ("gppo", dict(gppo_beta_low=0.75, gppo_beta_high=1.5, dual_clip=2.0)),
    ("gppo", dict(clip_low=0.1, dual_clip=None, kl_estimator="k3", kl_coef=0.1, agg="seq_mean_token_mean")),
    ("luspo", dict(clip_low=0.1, clip_high=0.1)),
    ("topr", dict(ratio="sequence_sum")),  # the paper's trajectory ratio
    ("topr", dict(ratio="sequence_sum", kl_estimator="k3", kl_coef=0.1, agg="seq_mean_token_sum")),
    ("vespo", dict(vespo_k_pos=0.5, vespo_lambda_pos=0.0, vespo_k_neg=1.0, vespo_lambda_neg=5.0)),
    ("vespo", dict(agg="seq_mean_token_mean")),
    ("grpo", dict(entropy_coef=0.05, entropy_agg="token_mean")),  # the bonus as its own token mean
    ("gspo", dict(entropy_coef=0.03, entropy_agg="token_mean", agg="seq_mean_token_sum")),
]


def _call(fn, inputs, config, **extra):
    kwargs = {k: v for k, v in inputs.items() if k not in ("logp", "advantages", "mask")}
    kwargs.update(extra)
    if config.ratio not in ("group_expectation", "snis"):
        kwargs.pop("group_ids")
    return fn(inputs["logp"], inputs["advantages"], inputs["mask"], config, **kwargs)


def _compare(config, inputs, dtype, **extra):
    logp = inputs["logp"].clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov's random choice of tokens: the same draw for both
    ours = _call(rlkernels.policy_loss, {**inputs, "logp": logp}, config, **extra)
    (g_ours,) = torch.autograd.grad(ours.loss, logp)
    logp_ref = inputs["logp"].clone().requires_grad_(True)
    torch.manual_seed(0)
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
        _compare(preset(name), inputs, dtype)


def _is_weights(inputs, per_row, seed):
    """Importance weights as the rollout corrections leave them: truncated ratios, zeros where masked
    out, NaN in the padding (never read)."""
    B, T = inputs["mask"].shape
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(B if per_row else B * T, generator=g, dtype=torch.float64) * 1.6
    w = w.masked_fill(w < 0.3, 0.0)
    if per_row:
        return w
    w = w.view(B, T)
    w[~inputs["mask"]] = float("nan")
    return w


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("name", presets.NAMES)
def test_importance_weights_match_reference(name, per_row):
    for seed in range(2):
        inputs = random_loss_inputs(noise=0.3, seed=seed)
        _compare(preset(name, entropy_coef=0.01), inputs, torch.float64, is_weights=_is_weights(inputs, per_row, seed))


@pytest.mark.parametrize("name", ["grpo", "cispo", "gspo", "snis"])
def test_constant_importance_weight_scales_the_policy_term(name):
    """ω ≡ c multiplies the surrogate part of the loss and its gradient by c; the KL and entropy
    terms stay (checked without the reference: loss(ω = c) = c·loss_policy + loss_rest)."""
    inputs = random_loss_inputs(noise=0.3, seed=4)
    config = preset(name, entropy_coef=0.01, kl_coef=0.05, kl_estimator="k3")
    logp = inputs["logp"].clone().requires_grad_(True)
    B = inputs["mask"].shape[0]
    parts = {}
    for c in (0.0, 1.0, 2.5):
        out = _call(rlkernels.policy_loss, {**inputs, "logp": logp}, config, is_weights=torch.full((B,), c))
        parts[c] = (out.loss.detach(), torch.autograd.grad(out.loss, logp)[0])
    for i in (0, 1):  # loss(2.5) − loss(0) = 2.5·(loss(1) − loss(0)), and so for the gradient
        torch.testing.assert_close(parts[2.5][i] - parts[0.0][i], 2.5 * (parts[1.0][i] - parts[0.0][i]))
    unweighted = _call(rlkernels.policy_loss, inputs, config)
    torch.testing.assert_close(unweighted.loss, parts[1.0][0])


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo", "gspo", "gspo_token", "gmpo", "sapo"])
@pytest.mark.parametrize("rollout", [False, True])
def test_off_policy_mask_matches_reference(name, rollout):
    for seed in range(2):
        inputs = random_loss_inputs(noise=0.3, seed=seed, per_token_adv=name in ("dapo", "gspo_token"))
        extra = {"is_weights": _is_weights(inputs, False, seed)} if seed else {}
        if rollout:  # the sampler's log-probs, NaN where it could not score a token
            g = torch.Generator().manual_seed(seed)
            r = inputs["old_logp"] + 0.2 * torch.randn(inputs["old_logp"].shape, generator=g, dtype=torch.float64)
            extra["rollout_logp"] = r.masked_fill(torch.rand(r.shape, generator=g) < 0.1, float("nan"))
        _compare(preset(name, off_policy_mask=0.02), inputs, torch.float64, **extra)


@pytest.mark.parametrize("name", ["grpo", "cispo", "gspo", "sapo"])
@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0])
def test_top_entropy_quantile_matches_reference(name, rho):
    """Also with TRL's entropy bonus, a token mean over the same high-entropy tokens."""
    for seed in range(2):
        inputs = random_loss_inputs(noise=0.3, seed=seed)
        extra = {"is_weights": _is_weights(inputs, True, seed)} if seed else {}
        _compare(preset(name, top_entropy_quantile=rho), inputs, torch.float64, **extra)
        _compare(preset(name, top_entropy_quantile=rho, entropy_coef=0.3, entropy_agg="token_mean"), inputs,
                 torch.float64, **extra)


def test_top_entropy_quantile_keeps_that_fraction():
    """ρ of the masked tokens (the highest entropies) keep their policy gradient, the others get none from it."""
    inputs = random_loss_inputs(B=8, T=25, noise=0.3, seed=3)
    mask = inputs["mask"]
    logp = inputs["logp"].clone().requires_grad_(True)
    # no clip bites: every kept token has a gradient
    config = preset("grpo", top_entropy_quantile=0.25, kl_coef=0.0, clip_low=0.99, clip_high=1e6)
    out = _call(rlkernels.policy_loss, {**inputs, "logp": logp}, config)
    (grad,) = torch.autograd.grad(out.loss, logp)
    kept = (grad != 0) & mask
    n = int(mask.sum())
    assert abs(int(kept.sum()) - 0.25 * n) <= 1
    h = inputs["entropy"]
    assert h[kept].min() >= h[mask & ~kept].max()
    with pytest.raises(ValueError, match="entropy: required"):
        _call(rlkernels.policy_loss, {k: v for k, v in inputs.items() if k != "entropy"}, preset("grpo",
              top_entropy_quantile=0.5))


def test_off_policy_mask_extremes():
    """A threshold nothing exceeds changes nothing; one everything exceeds drops the surrogate of
    every negative-advantage token, as importance weights 1[A ≥ 0] do."""
    inputs = random_loss_inputs(noise=0.3, seed=7)
    config = preset("grpo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    plain = _call(rlkernels.policy_loss, inputs, config)
    loose = _call(rlkernels.policy_loss, inputs, config.replace(off_policy_mask=1e9))
    strict = _call(rlkernels.policy_loss, inputs, config.replace(off_policy_mask=-1e9))
    positive = _call(rlkernels.policy_loss, inputs, config, is_weights=(inputs["advantages"] >= 0).double())
    torch.testing.assert_close(loose.loss, plain.loss)
    torch.testing.assert_close(strict.loss, positive.loss)
    assert not torch.allclose(strict.loss, plain.loss)
    with pytest.raises(ValueError, match="off_policy_mask"):
        preset("snis", off_policy_mask=0.1)


def test_bad_importance_weights_are_named():
    inputs = random_loss_inputs(seed=1)
    B, T = inputs["mask"].shape
    with pytest.raises(ValueError, match="is_weights: expected shape"):
        _call(rlkernels.policy_loss, inputs, presets.grpo(), is_weights=torch.ones(B, T + 1))
    with pytest.raises(ValueError, match="is_weights: expected finite values >= 0"):
        _call(rlkernels.policy_loss, inputs, presets.grpo(), is_weights=-torch.ones(B))


@pytest.mark.parametrize("name,overrides", OPTIONS, ids=[f"{n}-{'-'.join(o) or 'default'}" for n, o in OPTIONS])
def test_options_match_reference(name, overrides):
    config = preset(name, **overrides)
    per_token = config.ratio in ("token", "sequence_token")
    for seed in range(3):
        inputs = random_loss_inputs(noise=0.3, per_token_adv=per_token, seed=seed)
        _compare(config, inputs, torch.float64)


@pytest.mark.parametrize("name", presets.NAMES)
def test_global_counts_match_reference(name):
    inputs = random_loss_inputs(noise=0.2, seed=5)
    _compare(preset(name), inputs, torch.float64, num_items=17.0, num_seqs=9.0)


# cispo, gspo_token, snis, dppo_*, vespo hold sg(f(ℓ)) factors and clip_cov / kl_cov choose tokens by ℓ:
# finite differences see those move, by design, so their gradients are pinned by the hand-derived tests
# below and by the peers' functions (test_integration_verl.py, test_trl_loss_math.py) instead.
@pytest.mark.parametrize("name,overrides", [
    ("ppo", {}), ("grpo", {}), ("dr_grpo", {}), ("dapo", {}), ("gspo", dict(clip_low=0.3, clip_high=0.3)),
    ("fspo", dict(fspo_c_low=0.3, fspo_c_high=0.3)), ("gepo", {}), ("gmpo", {}), ("gpg", {}), ("sapo", {}),
    ("sapo", dict(ratio="sequence")), ("dro", {}), ("luspo", dict(clip_low=0.3, clip_high=0.3)),
])
def test_gradcheck(name, overrides):
    inputs = random_loss_inputs(B=4, T=5, noise=0.2, group_size=2, empty_rows=(), seed=1)
    config = preset(name, entropy_coef=0.01, **overrides)
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


@pytest.mark.parametrize("betas", [(1.0, 1.0), (0.75, 1.5)])
def test_gppo_is_the_papers_value_and_gradient(betas):
    """Klear-Reasoner's GPPO (docs/math.md §5): PPO's clipped value; a token the clip holds keeps the gradient
    −β·(1 ± ε)·A·∇ℓ (β₁ below the band with A < 0, β₂ above it with A > 0) where PPO's is 0; the dual clip's cap
    has none. Tokens: w = e^{0.5} > 1.28 with A = 1 (held above), w = e^{−0.5} < 0.8 with A = −1 (held below),
    w = e^{0.1} with A = 2 (inside), w = e^{2} with A = −1 (PPO's −A·w = 7.4 above the cap 3: capped)."""
    beta_low, beta_high = betas
    logp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.5, 0.5, -0.1, -2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]], dtype=torch.float64)
    config = presets.gppo(clip_low=0.2, clip_high=0.28, dual_clip=3.0, gppo_beta_low=beta_low,
                          gppo_beta_high=beta_high)
    out = rlkernels.policy_loss(logp, adv, torch.ones(1, 4, dtype=torch.bool), config, old_logp=old)
    w = math.exp(0.1)
    values = [-beta_high * 1.28, beta_low * 0.8, -2.0 * w, 3.0]
    torch.testing.assert_close(out.loss, torch.tensor(sum(values) / 4, dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = torch.tensor([[-beta_high * 1.28, beta_low * 0.8, -2.0 * w, 0.0]], dtype=torch.float64) / 4
    torch.testing.assert_close(grad, want)
    assert float(out.metrics["clip_frac"]) == 0.5  # PPO's: the tokens held above and below


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
    out = _call(rlkernels.policy_loss, {**inputs, "logp": logp}, preset(name))
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
    (dict(objective="cispo", ratio="geometric"), "objective"),
    (dict(objective="cispo", clip_high=-1.0), "clip_high"),
    (dict(agg="mean"), "agg"),
    (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_low=1.5), "clip_low"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(kl_coef=0.1), "kl_estimator"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(norm_length=0), "norm_length"),
    (dict(agg="constant"), "norm_length"),
    (dict(objective="sapo", sapo_tau_pos=0.0), "sapo_tau_pos"),
    (dict(objective="sapo", sapo_tau_neg=-1.0), "sapo_tau_neg"),
    (dict(objective="sapo", ratio="sequence_sum"), "objective"),
    (dict(objective="vespo", ratio="token"), "objective"),
    (dict(ratio_cap=2.0), "ratio_cap"),
    (dict(objective="dppo_tv", ratio_cap=0.0), "ratio_cap"),
    (dict(objective="dppo_kl", clip_low=None), "clip_low"),
    (dict(objective="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb"),
    (dict(objective="clip_cov", clip_cov_ratio=0.0), "clip_cov_ratio"),
    (dict(objective="kl_cov", kl_cov_ratio=1.5), "kl_cov_ratio"),
    (dict(objective="kl_cov", kl_cov_coef=-1.0), "kl_cov_coef"),
    (dict(objective="dro"), "dro_beta"),
    (dict(objective="dro", dro_beta=0.0), "dro_beta"),
    (dict(objective="sapo", dual_clip=2.0), "dual_clip"),
    (dict(objective="gppo", delta=2.0), "delta"),  # GPPO's unheld branch is −A·w
    (dict(objective="gppo", clip_high=None), "clip_high"),
    (dict(objective="gppo", gppo_beta_low=0.0), "gppo_beta_low"),
    (dict(objective="gppo", gppo_beta_high=float("inf")), "gppo_beta_high"),
    (dict(objective="gppo", ratio="sequence"), "objective"),
    (dict(ratio="sequence_sum", objective="vespo", vespo_k_pos=-1.0), "vespo_k_pos"),
    (dict(ratio="sequence_sum", objective="vespo", vespo_lambda_neg=float("nan")), "vespo_lambda_neg"),
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
        "gpg": ("token", "reinforce", 0.2, 0.2, None, 0.0, "token_mean"),
        "sapo": ("token", "sapo", 0.2, 0.2, None, 0.0, "seq_mean_token_mean"),
        "dppo_tv": ("token", "dppo_tv", 0.15, 0.15, None, 0.0, "token_mean"),
        "dppo_kl": ("token", "dppo_kl", 0.05, 0.05, None, 0.0, "token_mean"),
        "clip_cov": ("token", "clip_cov", 0.2, 0.2, None, 0.0, "token_mean"),
        "kl_cov": ("token", "kl_cov", 0.2, 0.2, None, 0.0, "token_mean"),
        "dro": ("token", "dro", 0.2, 0.2, None, 0.0, "token_mean"),
        "luspo": ("sequence", "clip", 3e-4, 4e-4, None, 0.0, "seq_mean_token_sum"),
        "vespo": ("sequence_sum", "vespo", 0.2, 0.2, None, 0.0, "token_mean"),
    }
    for name, row in table.items():
        c = presets.get(name, **({"norm_length": 7} if name == "dr_grpo" else {}))
        assert (c.ratio, c.objective, c.clip_low, c.clip_high, c.kl_estimator, c.kl_coef, c.agg) == row, name
    assert presets.ppo().dual_clip == 3.0
    assert (presets.fspo().ratio, presets.fspo().fspo_c_low, presets.fspo().fspo_c_high) == ("sequence_sum", 0.03, 0.03)
    assert (presets.snis().ratio, presets.snis().objective) == ("snis", "reinforce")
    assert math.isclose(1 + presets.cispo().clip_high, 5.0)
    assert (presets.dr_grpo(norm_length=64).agg, presets.dr_grpo(norm_length=64).norm_length) == ("constant", 64)
    assert (presets.sapo().sapo_tau_pos, presets.sapo().sapo_tau_neg) == (1.0, 1.05)
    assert presets.dppo_tv().ratio_cap is None and presets.dppo_kl().ratio_cap is None
    c = presets.clip_cov()
    assert (c.clip_cov_ratio, c.clip_cov_lb, c.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (presets.kl_cov().kl_cov_ratio, presets.kl_cov().kl_cov_coef) == (2e-4, 0.1)
    assert presets.dro().dro_beta == 0.1
    v = presets.vespo()
    assert (v.vespo_k_pos, v.vespo_lambda_pos, v.vespo_k_neg, v.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    # declared with their objectives (losses/objectives.py): each objective's presets together, in the registry's order
    order = [presets.fields(name)["objective"] for name in presets.NAMES]
    runs = [o for i, o in enumerate(order) if i == 0 or o != order[i - 1]]
    assert runs == [o for o in objectives.names() if o in order]


class _Reads:
    """A config that records which of its fields are read."""

    def __init__(self, config):
        self._config, self.read = config, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._config, name)


def test_the_reference_reads_every_config_field():
    """The oracle implements every field of PolicyLossConfig: over the presets and the options of these tests, each
    field is read (it once ignored rollout_is* and rollout_rs, and returned another loss than policy_loss)."""
    import dataclasses

    inputs = random_loss_inputs(seed=5)
    rollout = inputs["old_logp"] + 0.1
    extra = [("grpo", dict(off_policy_mask=0.1, top_entropy_quantile=0.5, kl_bias_correction=True,
                           kl_bias_ratio="sequence", kl_clamp=1.0)),
             ("dapo", dict(rollout_is="sequence", rollout_is_mode="mask", rollout_is_lower=0.5,
                           rollout_is_batch_normalize=True, rollout_rs=(("token_k2", None, 1.0),))),
             ("gepo", dict(group_size=3)), ("clip_cov", dict(clip_cov_draw="verl"))]
    read = set()
    for name, overrides in [(n, {}) for n in presets.NAMES] + OPTIONS + extra:
        config = _Reads(preset(name, **overrides))
        reference.policy_loss(inputs["logp"], inputs["advantages"], inputs["mask"], config,
                              old_logp=inputs["old_logp"], ref_logp=inputs["ref_logp"], entropy=inputs["entropy"],
                              group_ids=inputs["group_ids"], rewards=inputs["rewards"], rollout_logp=rollout)
        read |= config.read
    # `scalars` holds a plug-in's own scalars, which its surrogate reads: no built-in objective has one
    assert {f.name for f in dataclasses.fields(rlkernels.PolicyLossConfig)} - read == {"scalars"}


def test_snis_gradient_by_hand():
    # On-policy, ρ_i = 1 for every row, so ŵ_i = 1 and b_g = mean_g R: the score is summed over the row, so
    # each token of row i gets −(R_i − mean_g R) / B under seq_mean_token_mean, whatever the row's length.
    inputs = random_loss_inputs(seed=13, empty_rows=())
    m, rewards, groups = inputs["mask"], inputs["rewards"], inputs["group_ids"]
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, None, m, presets.snis(), rewards=rewards, group_ids=groups)
    (grad,) = torch.autograd.grad(out.loss, logp)
    lengths = m.sum(-1)
    for i in range(m.shape[0]):
        baseline = rewards[groups == groups[i]].mean()
        expected = -(rewards[i] - baseline) / m.shape[0]
        torch.testing.assert_close(grad[i][m[i]], expected.expand(int(lengths[i])))


@pytest.mark.parametrize("seed", range(4))
def test_snis_is_the_textbook_estimator(seed):
    # Off-policy, by hand per group: ρ_j = Π_t π/π_old (the whole sequence), self-normalised weights
    # ρ_j / Σ_g ρ, baseline b_g = Σ_j (ρ_j / Σ_g ρ) R_j, score Σ_t ∇ℓ. Under seq_mean_token_mean the loss's
    # gradient is −(n_g / B') · (ρ_j / Σ_g ρ)(R_j − b_g) on every token of row j.
    inputs = random_loss_inputs(B=9, T=6, noise=0.4, group_size=3, empty_rows=(4,), seed=seed)
    m, rewards, groups = inputs["mask"], inputs["rewards"], inputs["group_ids"]
    rewards = rewards + torch.randn(9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logp = inputs["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, None, m, presets.snis(), old_logp=inputs["old_logp"], rewards=rewards,
                                group_ids=groups)
    (grad,) = torch.autograd.grad(out.loss, logp)
    lengths = m.sum(-1)
    rows = int((lengths > 0).sum())
    log_rho = torch.where(m, inputs["logp"] - inputs["old_logp"], 0.0).sum(-1)
    expected = torch.zeros_like(grad)
    for g in groups.unique():
        members = [j for j in range(9) if groups[j] == g and lengths[j] > 0]
        rho = torch.exp(log_rho[members])
        w = rho / rho.sum()
        b = (w * rewards[members]).sum()
        for j, wj in zip(members, w):
            expected[j][m[j]] = -len(members) / rows * wj * (rewards[j] - b)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(out.metrics["ratio_max"], torch.exp(log_rho[lengths > 0]).max())


def test_snis_weights_are_not_changed_by_the_log_ratio_clamp():
    # log ρ = [25, 40, 0], R = [1, 0, 0.5]: ŵ = 3·softmax(log ρ) ≈ [9e-7, 3, 2e-17], b ≈ 3e-7, so every
    # coefficient ŵ(R − b) is below 1e-6. A clamp of log ρ at ±20 gave rows 1 and 2 equal weights:
    # [0.75, −0.75, 0].
    log_rho = torch.tensor([25.0, 40.0, 0.0], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    mask = torch.ones(3, 1, dtype=torch.bool)
    w_hat = 3 * torch.softmax(log_rho, 0)
    expected = w_hat * (rewards - (w_hat * rewards).mean())
    for fn in (rlkernels.policy_loss, reference.policy_loss):
        logp = torch.full((3, 1), -1.0, dtype=torch.float64, requires_grad=True)
        out = fn(logp, None, mask, presets.snis(group_size=3), old_logp=logp.detach() - log_rho[:, None],
                 rewards=rewards)
        (grad,) = torch.autograd.grad(out.loss if fn is rlkernels.policy_loss else out[0], logp)
        torch.testing.assert_close(-3 * grad.view(-1), expected, rtol=1e-12, atol=1e-22)
        assert grad.abs().max() < 1e-6


def test_snis_has_no_length_bias():
    # Two rows, rewards 1 and 0, lengths 4 and 1, on-policy: b = 0.5, and every token gets ∓0.5/2 = ∓0.25, as
    # REINFORCE with the group-mean baseline gives (the token-mean score gave −0.0625 and +0.25).
    mask = torch.tensor([[True] * 4, [True, False, False, False]])
    logp = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    out = rlkernels.policy_loss(logp, None, mask, presets.snis(group_size=2), rewards=torch.tensor([1.0, 0.0]))
    (grad,) = torch.autograd.grad(out.loss, logp)
    expected = torch.tensor([[-0.25] * 4, [0.25, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    reinforce = presets.gpg(agg="seq_mean_token_sum")
    (grad_reinforce,) = torch.autograd.grad(
        rlkernels.policy_loss(logp, torch.tensor([0.5, -0.5]), mask, reinforce).loss, logp)
    torch.testing.assert_close(grad, grad_reinforce)


def test_snis_is_consistent():
    # What SNIS estimates: ∇_θ E_{y~π_θ}[R(y)] of one prompt, from a group of samples of π_old. A toy policy over
    # sequences of length 1 or 2 (token 0 ends the sequence; logits per position), enumerated exactly, against
    # one group of 200k samples of a different π_old: the self-normalised estimate is within a few σ of the truth.
    torch.manual_seed(0)
    theta = torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, -0.6]], dtype=torch.float64, requires_grad=True)
    theta_old = theta.detach() + torch.tensor([[0.4, -0.3, 0.1], [-0.5, 0.2, 0.3]], dtype=torch.float64)
    reward = torch.tensor([[1.0, 1.0, 1.0], [0.0, 3.0, 1.0], [2.0, 0.0, 3.0]], dtype=torch.float64)  # R[y1, y2]

    def seq_logp(th, y1, y2):
        lp = torch.log_softmax(th, -1)
        return torch.stack([lp[0][y1], torch.where(y1 == 0, 0.0, lp[1][y2])], -1)

    y1, y2 = torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij")
    seqs = [(a, b) for a in range(3) for b in (range(3) if a else [0])]
    J = sum(torch.exp(seq_logp(theta, torch.tensor(a), torch.tensor(b)).sum()) * reward[a, b] for a, b in seqs)
    (truth,) = torch.autograd.grad(J, theta)

    n = 200_000
    p_old = torch.softmax(theta_old, -1)
    s1, s2 = torch.multinomial(p_old[0], n, replacement=True), torch.multinomial(p_old[1], n, replacement=True)
    mask = torch.stack([torch.ones(n, dtype=torch.bool), s1 != 0], -1)
    logp = seq_logp(theta, s1, s2)
    old = seq_logp(theta_old, s1, s2)
    out = rlkernels.policy_loss(logp, None, mask, presets.snis(group_size=n), old_logp=old,
                                rewards=torch.where(s1 == 0, reward[0, 0], reward[s1, s2]))
    (estimate,) = torch.autograd.grad(out.loss, theta)
    # the error is ≤ 0.0025 over seeds; the old estimator (mean log-ratio, token-mean score) was 0.042 off
    torch.testing.assert_close(-estimate, truth, atol=0.01, rtol=0)
    assert (truth.abs() > 0.02).sum() >= 4  # not a vacuous comparison


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 6), name=st.sampled_from(presets.NAMES), seed=st.integers(0, 10**6),
       noise=st.sampled_from([0.0, 1e-3, 0.5]))
def test_hypothesis_shapes_match_reference(B, T, name, seed, noise):
    inputs = random_loss_inputs(B, T, noise=noise, group_size=1, empty_rows=(), seed=seed)
    _compare(preset(name), inputs, torch.float64)


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
    # Dr. GRPO on-policy: Σ_tokens (−A) / (B · N), B = non-empty rows, N = norm_length (the max completion length).
    inputs = random_loss_inputs(seed=15, per_token_adv=True)
    m, adv = inputs["mask"], inputs["advantages"]
    out = rlkernels.policy_loss(inputs["logp"], adv, m, presets.dr_grpo(norm_length=16))
    rows = (m.sum(-1) > 0).sum()
    torch.testing.assert_close(out.loss, -adv[m].sum() / (rows * 16))


def test_dr_grpo_needs_its_constant_and_ignores_padding():
    with pytest.raises(ValueError, match="norm_length"):
        presets.dr_grpo()
    with pytest.raises(ValueError, match="norm_length"):
        presets.get("dr_grpo", entropy_coef=0.01)
    with pytest.raises(ValueError, match="norm_length"):
        rlkernels.PolicyLossConfig(agg="constant")
    # the same two rows (lengths 3 and 1) padded to 3 or to 8 tokens: the same loss (the padded T gave −0.292 / −0.109)
    losses = []
    for T in (3, 8):
        logp = torch.full((2, T), -1.0, dtype=torch.float64)
        mask = torch.arange(T)[None] < torch.tensor([3, 1])[:, None]
        out = rlkernels.policy_loss(logp, torch.tensor([0.5, -0.25], dtype=torch.float64), mask,
                                    presets.dr_grpo(norm_length=4))
        losses.append(out.loss)
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(losses[0], torch.tensor(-(3 * 0.5 - 0.25) / (2 * 4), dtype=torch.float64))


@pytest.mark.parametrize("draw", ["device", "verl"])
def test_clip_cov_draw_follows_the_rng_state(draw):
    # Clip-Cov zeroes k = max(⌊ratio·N⌋, 1) of the candidates, drawn from the default generator (verl's draw:
    # torch.randperm; the device draw: uniform keys), so the same RNG state gives the same tokens.
    inputs = random_loss_inputs(B=8, T=9, noise=0.3, per_token_adv=True, seed=21)
    config = preset("clip_cov", clip_cov_ratio=0.1, clip_cov_draw=draw)
    plain = config.replace(objective="clip")

    def grads(cfg, seed):
        torch.manual_seed(seed)
        logp = inputs["logp"].clone().requires_grad_(True)
        out = rlkernels.policy_loss(logp, inputs["advantages"], inputs["mask"], cfg, old_logp=inputs["old_logp"])
        return torch.autograd.grad(out.loss, logp)[0]

    base = grads(plain, 0)
    zeroed = [(grads(config, seed) != base) for seed in range(6)]
    k = max(int(0.1 * int(inputs["mask"].sum())), 1)
    assert all(int(z.sum()) == k for z in zeroed)  # k tokens lose their gradient, nothing else changes
    torch.testing.assert_close(grads(config, 3), grads(config, 3))
    assert any(not torch.equal(zeroed[0], z) for z in zeroed[1:])  # and the draw depends on the state


def test_kl_cov_penalises_the_top_covariance_tokens():
    inputs = random_loss_inputs(B=8, T=9, noise=0.3, per_token_adv=True, seed=22)
    m, adv, old = inputs["mask"], inputs["advantages"], inputs["old_logp"]
    config = presets.kl_cov(kl_cov_ratio=0.1, kl_cov_coef=0.5)
    logp = inputs["logp"].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(rlkernels.policy_loss(logp, adv, m, config, old_logp=old).loss, logp)
    (base,) = torch.autograd.grad(rlkernels.policy_loss(logp, adv, m, config.replace(kl_cov_coef=0.0),
                                                        old_logp=old).loss, logp)
    lp = inputs["logp"]
    cov = (adv - adv[m].mean()) * (lp - lp[m].mean())
    top = torch.zeros_like(m)
    k = max(int(0.1 * int(m.sum())), 1)
    top[m] = torch.zeros(int(m.sum()), dtype=torch.bool).index_fill(0, cov[m].topk(k).indices, True)
    expected = torch.where(top, 0.5 * torch.sign(lp - old) / m.sum(), 0.0)
    torch.testing.assert_close(grad - base, expected)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_test_fields_choose_tokens(name):
    # the comparisons that iterate presets.NAMES (loss_inputs.TEST_FIELDS) are not vacuous for the covariance rules
    inputs = random_loss_inputs(noise=0.3, seed=0)
    config = preset(name)
    other = config.replace(objective="clip") if name == "clip_cov" else config.replace(kl_cov_coef=0.0)
    a = _call_with_grad(config, inputs)
    b = _call_with_grad(other, inputs)
    assert not torch.allclose(a[1], b[1])


def test_dro_and_dppo_by_hand():
    inputs = random_loss_inputs(noise=0.3, per_token_adv=True, seed=23)
    m, adv, old, lp = inputs["mask"], inputs["advantages"], inputs["old_logp"], inputs["logp"]
    n = m.sum()
    logp = lp.clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, adv, m, presets.dro(dro_beta=0.7), old_logp=old)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, torch.where(m, (-adv + 0.7 * (lp - old)) / n, 0.0))
    # DPPO-TV: −A·min(w, cap) on the tokens whose probability moved by at most ε in the direction A pushes it
    out = rlkernels.policy_loss(logp, adv, m, presets.dppo_tv(clip_low=0.05, clip_high=0.1, ratio_cap=1.5),
                                old_logp=old)
    (grad,) = torch.autograd.grad(out.loss, logp)
    dp = torch.exp(lp) - torch.exp(old)
    inside = torch.where(adv > 0, dp <= 0.1, dp >= -0.05)
    w = torch.exp(lp - old).clamp(max=1.5)
    torch.testing.assert_close(grad, torch.where(m & inside, -adv * w / n, 0.0))
    assert 0 < float(out.metrics["clip_frac"]) < 1


def test_topr_trajectory_ratio_as_the_paper():
    """TOPR's trajectory form truncates π(τ)/μ(τ), one ratio per row: the issue's example (log-ratios [+1, −1],
    A = −1, seq_mean_token_sum) has ratio 1, so both tokens keep weight 1, where the token form gives [1, e^−1]."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.tensor([-1.0], dtype=torch.float64)
    grads = {}
    for ratio in ("token", "sequence_sum"):
        out = rlkernels.policy_loss(logp, adv, mask, presets.topr(ratio=ratio, agg="seq_mean_token_sum"), old_logp=old)
        (grads[ratio],) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grads["sequence_sum"], torch.tensor([[1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(grads["token"], torch.tensor([[1.0, math.exp(-1.0)]], dtype=torch.float64))
