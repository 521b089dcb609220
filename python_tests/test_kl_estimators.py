"""The KL estimators of docs/math.md §6: verl's under verl's names equal `kl_penalty`, value and gradient; every
estimator in `policy_loss` equals the reference, and the fused ops give what the composition gives."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.losses.kl import kl_estimate
from rlkernels.ops._plan import kernel_supports

from loss_inputs import random_loss_inputs

VERL_NAMES = ("kl", "k1", "mse", "k2", "abs", "low_var_kl", "k3")
NEW = ("kl", "mse", "abs", "low_var_kl", "kl+", "mse+", "abs+", "low_var_kl+")


@pytest.mark.parametrize("name", VERL_NAMES + tuple(n + "+" for n in VERL_NAMES))
def test_verl_names_equal_verls_kl_penalty(name):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from rlkernels.integrations.verl import kl_estimator

    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(400, generator=g, dtype=torch.float64) * 15).requires_grad_(True)  # |Δ| well past 20
    ref = torch.randn(400, generator=g, dtype=torch.float64) * 15
    theirs = core_algos.kl_penalty(logp, ref, name)
    ours = kl_estimate(ref, logp, kl_estimator(name), 20.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # expm1 against exp − 1: rounding
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), logp)[0], torch.autograd.grad(theirs.sum(), logp)[0],
                               rtol=1e-12, atol=1e-12)


def test_low_var_kl_is_clamped_and_k3_is_not():
    """At Δ = 3: verl's low_var_kl is 10 with no gradient; the grpo preset's k3 is e³ − 4 = 16.09, gradient −19.09."""
    ref = torch.tensor([0.0], dtype=torch.float64)
    for estimator, value, grad in (("low_var_kl", 10.0, 0.0), ("k3", 16.0855369, -19.0855369)):
        logp = torch.tensor([-3.0], dtype=torch.float64, requires_grad=True)
        k = kl_estimate(ref, logp, estimator, 20.0)
        torch.testing.assert_close(float(k), value)
        torch.testing.assert_close(float(torch.autograd.grad(k.sum(), logp)[0]), grad)
    assert presets.grpo().kl_estimator == "k3"


def test_full_and_unknown_estimators_are_named():
    with pytest.raises(ValueError, match="kl_estimator: 'full'"):
        presets.grpo(kl_estimator="full")
    with pytest.raises(ValueError, match="kl_estimator"):
        presets.grpo(kl_estimator="k3+")  # "+" forms are verl's names: low_var_kl+
    from rlkernels.integrations.verl import kl_estimator

    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimator("full")


@pytest.mark.parametrize("estimator", NEW)
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_policy_loss_equals_the_reference(estimator, name):
    inputs = random_loss_inputs(seed=3, noise=0.5)
    ref_logp = inputs["ref_logp"].clone()
    ref_logp[0, :2] -= 30.0  # Δ beyond the log-ratio clamp, where verl's estimators and k1, k2, k3 differ
    config = presets.get(name, kl_estimator=estimator, kl_coef=0.3, kl_clamp=25.0)
    kw = dict(old_logp=inputs["old_logp"], ref_logp=ref_logp, entropy=inputs["entropy"])
    logp = inputs["logp"].clone().requires_grad_(True)
    ours = rlkernels.policy_loss(logp, inputs["advantages"], inputs["mask"], config, **kw)
    logp_ref = inputs["logp"].clone().requires_grad_(True)
    loss_ref, metrics_ref = reference.policy_loss(logp_ref, inputs["advantages"], inputs["mask"], config, **kw)
    torch.testing.assert_close(ours.loss, loss_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, logp)[0], torch.autograd.grad(loss_ref, logp_ref)[0],
                               rtol=1e-10, atol=1e-12)
    for key, value in metrics_ref.items():
        torch.testing.assert_close(ours.metrics[key], value, msg=key)


BACKENDS = [b for b in ("torch", "cpu") if rlkernels.backend_info()[b]["available"]]


@pytest.mark.filterwarnings("ignore:the .* kernels do not evaluate")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("estimator", ["low_var_kl", "abs+"])
@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_fused_takes_the_general_path(backend, estimator, name):
    """An estimator the kernels lack takes the general path, with the composition's values; k1, k2, k3 stay in the
    kernel."""
    config = presets.get(name, kl_estimator=estimator, kl_coef=0.2)
    assert not kernel_supports(config)
    assert kernel_supports(presets.dapo(kl_estimator="k2", kl_coef=0.2))
    _fused_equals_composed(config, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("estimator", ["abs", "low_var_kl+"])
def test_fused_kernel_evaluates_abs_and_low_var_kl_plus(backend, estimator):
    """verl's abs and low_var_kl+ (k3+) stay in the forward kernel (a table entry each), with the composition's
    values; Δ ~ 3·N(0, 1), past the log-ratio clamp and the low_var_kl bound of 10."""
    config = presets.dapo(kl_estimator=estimator, kl_coef=0.2, log_ratio_clamp=5.0)
    assert kernel_supports(config)
    _fused_equals_composed(config, backend)


def _fused_equals_composed(config, backend):
    g = torch.Generator().manual_seed(1)
    B, T, V = 4, 5, 11
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    adv = torch.randn(B, generator=g)
    logp0 = rlkernels.token_logprobs(logits, targets)
    kw = dict(old_logp=logp0 + 0.1 * torch.randn(B, T, generator=g),
              ref_logp=logp0 + 3 * torch.randn(B, T, generator=g))
    x = logits.clone().requires_grad_(True)
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, backend=backend, **kw)
    fused.loss.backward()
    y = logits.clone().requires_grad_(True)
    logp, ent = rlkernels.token_logprobs(y, targets, return_entropy=True, backend=backend)
    composed = rlkernels.policy_loss(logp, adv, mask, config, entropy=ent, **kw)
    composed.loss.backward()
    torch.testing.assert_close(fused.loss, composed.loss)
    torch.testing.assert_close(x.grad, y.grad)
    for key, value in composed.metrics.items():
        torch.testing.assert_close(fused.metrics[key], value, msg=key)
