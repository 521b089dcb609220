"""`fused_policy_loss` equals `policy_loss(token_logprobs(...))` in value, gradient and metrics."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import rlkernels
from rlkernels import presets, reference

from loss_inputs import check_fused_against_the_composition, preset, random_loss_inputs

BACKENDS = [b for b in ("torch", "cpu") if rlkernels.backend_info()[b]["available"]]
# SNIS's value Σ_i c_i·Σ_t ℓ has Σ_{i∈g} c_i = 0: terms ~100× the result cancel, so its fp32 rounding is larger
SNIS_ATOL = 1e-4


def _case(B=6, T=7, V=37, dtype=torch.float32, seed=0, per_token_adv=False):
    inputs = random_loss_inputs(B, T, dtype=torch.float64, noise=0.2, per_token_adv=per_token_adv, seed=seed)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    return logits, targets, inputs


def _kwargs(inputs, config):
    kw = dict(old_logp=inputs["old_logp"].float(), ref_logp=inputs["ref_logp"].float(), rewards=inputs["rewards"].float())
    if config.ratio in ("group_expectation", "snis"):
        kw["group_ids"] = inputs["group_ids"]
    return kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", presets.NAMES)
def test_every_preset_equals_the_composition(backend, name):
    config = preset(name, entropy_coef=0.01)
    logits, targets, inputs = _case(seed=zlib.crc32(name.encode()) % 1000, per_token_adv=config.ratio == "token")
    adv, mask = inputs["advantages"].float(), inputs["mask"]
    kw = _kwargs(inputs, config)

    x = logits.clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov's random choice of tokens: the same draw on every path
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.8, backend=backend, **kw)
    (2.5 * fused.loss).backward()

    y = logits.clone().requires_grad_(True)
    logp, ent = rlkernels.token_logprobs(y, targets, temperature=0.8, return_entropy=True, backend=backend)
    torch.manual_seed(0)
    composed = rlkernels.policy_loss(logp, adv, mask, config, entropy=ent, **kw)
    (2.5 * composed.loss).backward()

    # SNIS's value cancels (see the fp64 check below): its two fp32 sums, in different orders, differ more
    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-6, atol=SNIS_ATOL if name == "snis" else 1e-7)
    # the two paths scale by the incoming gradient at different points: rounding only
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)
    assert set(fused.metrics) == set(composed.metrics)
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], msg=key)
    with torch.no_grad():  # no gradient: the same values (from the kernel's statistics where it has the loss)
        torch.manual_seed(0)
        evaluated = rlkernels.fused_policy_loss(logits, targets, adv, mask, config, temperature=0.8, backend=backend,
                                                **kw)
    torch.testing.assert_close(evaluated.loss, fused.loss.detach(), rtol=1e-6, atol=1e-7)
    for key in composed.metrics:
        torch.testing.assert_close(evaluated.metrics[key], fused.metrics[key], msg=key)

    # and both equal the reference evaluated on the logits in fp64
    z = logits.double().requires_grad_(True)
    ref_logp, ref_ent = reference.token_logprobs(z, targets, 0.8)
    kw64 = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
    torch.manual_seed(0)
    ref_loss, _ = reference.policy_loss(ref_logp, adv.double(), mask, config, entropy=ref_ent, **kw64)
    (2.5 * ref_loss).backward()
    torch.testing.assert_close(fused.loss.double(), ref_loss, rtol=1e-5, atol=SNIS_ATOL if name == "snis" else 1e-6)
    torch.testing.assert_close(x.grad.double(), z.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_overwrites_logits_with_the_gradient(backend, dtype):
    logits, targets, inputs = _case(dtype=dtype, seed=3)
    config = presets.grpo()
    kw = _kwargs(inputs, config)
    y = logits.clone().requires_grad_(True)
    expected = rlkernels.fused_policy_loss(y, targets, inputs["advantages"].float(), inputs["mask"], config,
                                           backend=backend, **kw)
    expected.loss.backward()

    buffer = logits.clone()
    x = buffer.view_as(buffer).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, inputs["advantages"].float(), inputs["mask"], config,
                                      inplace=True, backend=backend, **kw)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(x.grad, y.grad)
    assert x.grad.data_ptr() == buffer.data_ptr()  # no second N × V buffer


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_refuses_logits_saved_upstream(backend):
    """`inplace=True` overwrites the logits with ∂logits: a node that saved them (here exp, which
    saves its result) must get autograd's in-place error, not silently wrong gradients."""
    logits, targets, inputs = _case(seed=7)
    x = (logits / 4).requires_grad_(True)
    z = x.exp()
    out = rlkernels.fused_policy_loss(z, targets, inputs["advantages"].float(), inputs["mask"], presets.grpo(),
                                      inplace=True, backend=backend, **_kwargs(inputs, presets.grpo()))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_incoming_gradient_scales_without_a_sync(backend):
    """(loss / k).backward() for gradient accumulation: the kernel scales its per-row derivatives."""
    logits, targets, inputs = _case(seed=8)
    config = presets.dapo(entropy_coef=0.02)
    grads = []
    for scale in (1.0, 0.25):
        x = logits.clone().requires_grad_(True)
        out = rlkernels.fused_policy_loss(x, targets, inputs["advantages"].float(), inputs["mask"], config,
                                          backend=backend, **_kwargs(inputs, config))
        (out.loss * scale).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0] * 0.25)


# Token-level configs beyond the presets: every branch of the per-token formula the kernels evaluate.
TOKEN_CONFIGS = {
    "delta+asymmetric": dict(ratio="token", clip_low=0.1, clip_high=0.3, delta=1.5),
    "dual_clip+k1": dict(ratio="token", dual_clip=2.0, kl_estimator="k1", kl_coef=0.1),
    "k2+kl_clamp": dict(ratio="token", kl_estimator="k2", kl_coef=0.2, kl_clamp=0.05),
    "k3+bias_correction": dict(ratio="token", kl_estimator="k3", kl_coef=0.3, kl_bias_correction=True,
                               log_ratio_clamp=0.15),
    "cispo_two_sided": dict(ratio="token", objective="cispo", clip_low=0.1, clip_high=0.2, entropy_coef=-0.05),
    "reinforce": dict(ratio="token", objective="reinforce", kl_estimator="k3", kl_coef=0.05),
    # the call's choice of tokens (`ops/_covariance_step.py`), with every term around it
    "clip_cov+asymmetric": dict(ratio="token", objective="clip_cov", clip_cov_lb=0.0, clip_cov_ratio=0.2, clip_low=0.1,
                                clip_high=0.3, kl_estimator="k3", kl_coef=0.1, entropy_coef=0.02),
    "kl_cov+k2": dict(ratio="token", objective="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=0.3, kl_estimator="k2",
                      kl_coef=0.1, agg="seq_mean_token_mean"),
    # the entropy bonus as the call's own token mean, apart from the loss's aggregation (TRL's)
    "entropy_token_mean": dict(ratio="token", kl_estimator="k3", kl_coef=0.05, entropy_coef=0.05,
                               entropy_agg="token_mean", agg="seq_mean_token_mean"),
    "kl_cov+entropy_token_mean": dict(ratio="token", objective="kl_cov", kl_cov_ratio=0.2, entropy_coef=0.05,
                                      entropy_agg="token_mean", agg="constant", norm_length=9),
    # surrogate weights that need the kernel's ℓ or H first (a row mean, a quantile): the token step of
    # `ops/_sequence_step.py`, the surrogate times ω for any objective
    "clip+off_policy_mask": dict(ratio="token", off_policy_mask=0.02, dual_clip=3.0, kl_estimator="k3", kl_coef=0.05),
    "dppo_kl+top_entropy_quantile": dict(ratio="token", objective="dppo_kl", clip_low=0.2, clip_high=0.2,
                                         top_entropy_quantile=0.4, entropy_coef=0.03, entropy_agg="token_mean"),
    "dro+off_policy_mask": dict(ratio="token", objective="dro", dro_beta=0.5, off_policy_mask=0.0),
    # TRL's options the kernels' parameters cannot express yet (δ ≤ 1, verl's KL estimators): the general path;
    # and TRL's top_entropy_quantile = 0 (the highest-entropy token alone)
    "delta_below_one": dict(ratio="token", clip_high=0.28, delta=0.9, kl_estimator="k3", kl_coef=0.05),
    "low_var_kl+straight_through": dict(ratio="token", kl_estimator="low_var_kl+", kl_coef=0.3, entropy_coef=0.01),
    "top_entropy_quantile_zero": dict(ratio="token", top_entropy_quantile=0.0, entropy_coef=0.02,
                                      entropy_agg="token_mean"),
}


@pytest.mark.filterwarnings("ignore:the .* kernels do not evaluate")  # the general path's once-per-config note
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", TOKEN_CONFIGS)
@pytest.mark.parametrize("on_policy", [False, True])
def test_token_configs_equal_the_composition(backend, name, on_policy):
    logits, targets, inputs = _case(seed=zlib.crc32(name.encode()) % 1000 + on_policy, per_token_adv=True)
    config = rlkernels.PolicyLossConfig(**TOKEN_CONFIGS[name])
    kw = _kwargs(inputs, config)
    if on_policy:
        kw.pop("old_logp")
    check_fused_against_the_composition(config, logits, targets, inputs["advantages"].float(), inputs["mask"], kw,
                                        backend, temperature=1.3)


# Sequence-level configs beyond the presets, through the sequence step (TRL's sequence-level CISPO, with a cap
# above and below 1; SAPO's gate on the sequence ratio)
SEQUENCE_CONFIGS = {
    "cispo_sequence": dict(ratio="sequence", objective="cispo", clip_low=None, clip_high=0.3, agg="token_mean"),
    "cispo_sequence_cap_below_1": dict(ratio="sequence", objective="cispo", clip_low=0.1, clip_high=-0.2,
                                       kl_estimator="k3", kl_coef=0.04, entropy_coef=0.01),
    "sapo_sequence": dict(ratio="sequence", objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "sapo_sequence_token": dict(ratio="sequence_token", objective="sapo", agg="token_mean", kl_estimator="k2",
                                kl_coef=0.1),
    # the bias-corrected KL times the row's sequence ratio (TRL at importance_sampling_level="sequence")
    "gspo_kl_bias_row": dict(ratio="sequence", clip_low=3e-4, clip_high=4e-4, kl_estimator="k3", kl_coef=0.1,
                             kl_bias_correction=True, kl_bias_ratio="sequence"),
    "grpo_kl_bias_row": dict(ratio="token", kl_estimator="k3", kl_coef=0.1, kl_bias_correction=True,
                             kl_bias_ratio="sequence", agg="seq_mean_token_mean"),
    "gspo_entropy_token_mean": dict(ratio="sequence", clip_low=3e-4, clip_high=4e-4, entropy_coef=0.05,
                                    entropy_agg="token_mean", agg="seq_mean_token_sum"),
    # a log-ratio clamp that binds on some rows (FSPO: the summed log-ratio; GMPO: tokens), asymmetric bands
    "fspo_clamped": dict(ratio="sequence_sum", fspo_c_low=0.05, fspo_c_high=0.2, log_ratio_clamp=0.3,
                         kl_estimator="k3", kl_coef=0.05),
    "gmpo_clamped": dict(ratio="geometric", clip_low=0.1, clip_high=0.3, log_ratio_clamp=0.25, agg="token_mean",
                         entropy_coef=0.02),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SEQUENCE_CONFIGS)
def test_sequence_configs_equal_the_composition_and_the_reference(backend, name):
    logits, targets, inputs = _case(seed=zlib.crc32(name.encode()) % 1000)
    config = rlkernels.PolicyLossConfig(**SEQUENCE_CONFIGS[name])
    kw = _kwargs(inputs, config)
    fused, grad = check_fused_against_the_composition(config, logits, targets, inputs["advantages"].float(),
                                                      inputs["mask"], kw, backend, temperature=0.9)
    adv, mask = inputs["advantages"].float(), inputs["mask"]
    z = logits.double().requires_grad_(True)
    ref_logp, ref_ent = reference.token_logprobs(z, targets, 0.9)
    kw64 = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
    ref_loss, _ = reference.policy_loss(ref_logp, adv.double(), mask, config, entropy=ref_ent, **kw64)
    ref_loss.backward()
    torch.testing.assert_close(fused.loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), z.grad, rtol=1e-4, atol=1e-6)


def test_inplace_rejects_strided_logits():
    logits, targets, inputs = _case(T=8, seed=4)
    x = logits.requires_grad_(True)
    with pytest.raises(ValueError, match="inplace"):
        rlkernels.fused_policy_loss(x[:, :-1], targets[:, :-1], inputs["advantages"].float(), inputs["mask"][:, :-1],
                                    presets.dapo(), inplace=True, backend="torch")


def test_without_grad_and_bad_shapes():
    logits, targets, inputs = _case(seed=5)
    with torch.no_grad():
        out = rlkernels.fused_policy_loss(logits, targets, inputs["advantages"].float(), inputs["mask"], presets.dapo())
    logp, ent = rlkernels.token_logprobs(logits, targets, return_entropy=True)
    torch.testing.assert_close(out.loss, rlkernels.policy_loss(logp, inputs["advantages"].float(), inputs["mask"],
                                                               presets.dapo(), entropy=ent).loss)
    with pytest.raises(ValueError, match="logits"):
        rlkernels.fused_policy_loss(logits[0], targets[0], inputs["advantages"].float(), inputs["mask"], presets.dapo())
    with pytest.raises(ValueError, match="targets"):
        rlkernels.fused_policy_loss(logits.requires_grad_(True), targets[:, :3], inputs["advantages"].float(),
                                    inputs["mask"], presets.dapo())


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_mask_gives_zero_gradient(backend):
    logits, targets, inputs = _case(seed=6)
    x = logits.clone().requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, inputs["advantages"].float(), torch.zeros_like(inputs["mask"]),
                                      presets.gspo(), backend=backend)
    out.loss.backward()
    assert float(out.loss) == 0.0 and (x.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliced_logits_are_read_in_place(backend):
    """`fused_policy_loss(model(x).logits[:, :-1], ...)`: the blocks of the slice are read where they
    are (no N × V copy beside the gradient), with the contiguous copy's loss and gradient."""
    from rlkernels._peak_memory import peak_since, reset_peak

    B, T, V = 8, 128, 65536
    base = torch.randn(B, T + 1, V) * 3  # a slice's copy and its gradient: 268 MB each
    targets = torch.randint(0, V, (B, T))
    batch = random_loss_inputs(B, T, dtype=torch.float32, seed=3)
    kw = dict(old_logp=batch["old_logp"], ref_logp=batch["ref_logp"], backend=backend)
    args = (targets, batch["advantages"], batch["mask"], presets.grpo())

    copy = base[:, :-1].contiguous().requires_grad_(True)
    expected = rlkernels.fused_policy_loss(copy, *args, **kw)
    expected.loss.backward()
    leaf = base.clone().requires_grad_(True)
    start = reset_peak()
    got = rlkernels.fused_policy_loss(leaf[:, :-1], *args, **kw)  # reads the slice: no N × V copy
    extra = peak_since(start)
    got.loss.backward()
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad[:, :-1], copy.grad, rtol=0, atol=0)
    assert leaf.grad[:, -1].abs().sum() == 0
    if backend == "cpu":  # (the torch backend's chunk temporaries make its resident peak unreliable here)
        grad_bytes = copy.numel() * copy.element_size()
        assert extra < 1.5 * grad_bytes, f"{extra / 2**20:.0f} MB extra: more than the gradient, the logits were copied"


@pytest.mark.parametrize("backend", BACKENDS)
# in the kernel (clip), the general path, and the sequence-level step (row-level and token-level surrogates)
@pytest.mark.parametrize("name", ["grpo", "ppo", "cispo", "dro", "gspo", "gspo_token", "gepo", "snis", "vespo", "fspo",
                                  "gmpo", "clip_cov", "kl_cov"])
@pytest.mark.parametrize("per_row", [False, True])
def test_importance_weights_equal_the_composition(backend, name, per_row):
    """`is_weights` on both fused paths (logits, hidden states) = `policy_loss(..., is_weights=...)`:
    the token-level clip presets take them folded into the advantage inside the kernel."""
    config = preset(name, entropy_coef=0.01)
    logits, targets, inputs = _case(seed=11, per_token_adv=config.ratio == "token")
    adv, mask = inputs["advantages"].float(), inputs["mask"]
    B, T = mask.shape
    g = torch.Generator().manual_seed(3)
    w = torch.rand(B if per_row else (B, T), generator=g) * 1.6
    w = w.masked_fill(w < 0.3, 0.0)
    kw = dict(_kwargs(inputs, config), is_weights=w)
    if name in ("ppo", "gspo_token"):  # and the off-policy mask
        config = config.replace(off_policy_mask=0.01)
        kw["rollout_logp"] = inputs["old_logp"].float() + 0.1
    if name in ("cispo", "gepo", "gmpo"):  # and the entropy mask (the kernels' entropies), with TRL's bonus on its tokens
        config = config.replace(top_entropy_quantile=0.5, entropy_agg="token_mean" if name != "gmpo" else None)

    x = logits.clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov's draw
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.8, backend=backend, **kw)
    fused.loss.backward()
    y = logits.clone().requires_grad_(True)
    logp, ent = rlkernels.token_logprobs(y, targets, temperature=0.8, return_entropy=True, backend=backend)
    torch.manual_seed(0)
    composed = rlkernels.policy_loss(logp, adv, mask, config, entropy=ent, **kw)
    composed.loss.backward()
    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], msg=key)
    unweighted = rlkernels.policy_loss(logp.detach(), adv, mask, config, entropy=ent.detach(),
                                       **_kwargs(inputs, config))
    assert not torch.allclose(unweighted.loss, composed.loss), "the weights change the loss"

    H = 8  # the hidden-state path: logits = hidden @ weightᵀ
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(logits.shape[-1], H, generator=g, requires_grad=True)
    torch.manual_seed(0)
    lin = rlkernels.fused_linear_policy_loss(hidden, weight, targets, adv, mask, config, temperature=0.8,
                                             backend=backend, chunk_size=5, **kw)
    gh, gw = torch.autograd.grad(lin.loss, (hidden, weight))
    h2, w2 = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    torch.manual_seed(0)
    ref = rlkernels.fused_policy_loss(h2 @ w2.t(), targets, adv, mask, config, temperature=0.8, backend=backend, **kw)
    rh, rw = torch.autograd.grad(ref.loss, (h2, w2))
    torch.testing.assert_close(lin.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gepo", "snis"])
def test_contiguous_groups_equal_the_same_groups_by_id(backend, name):
    """`group_size=k` (reductions over a `(G, k)` view) gives what `group_ids` naming the same contiguous groups
    gives (scatters), on the fused and the plain loss, with an empty row and a group of empty rows."""
    B, T, k = 9, 7, 3
    logits, targets, inputs = _case(B=B, T=T, seed=5)
    mask = inputs["mask"].clone()
    mask[4] = False
    mask[6:] = False
    adv = inputs["advantages"].float()
    kw = _kwargs(inputs, preset(name))
    kw.pop("group_ids", None)
    by_size = preset(name, group_size=k)
    by_id = preset(name)
    outs = []
    for config, extra in ((by_size, {}), (by_id, {"group_ids": torch.arange(B) // k})):
        x = logits.clone().requires_grad_(True)
        fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.8, backend=backend, **kw,
                                            **extra)
        fused.loss.backward()
        logp = rlkernels.token_logprobs(logits, targets, temperature=0.8, backend=backend).requires_grad_(True)
        plain = rlkernels.policy_loss(logp, adv, mask, config, **kw, **extra)
        plain.loss.backward()
        outs.append((fused, x.grad, plain, logp.grad))
    (f1, g1, p1, l1), (f2, g2, p2, l2) = outs
    assert g1.abs().sum() > 0 and l1[mask].abs().sum() > 0
    # SNIS's weights take a softmax over the view but exp(log ρ − logsumexp) by ids: the same values rounded
    # differently (~1e-7 of each ŵ), and both its loss Σ ŵ_i (R_i − b_g) Σ_t ℓ (~1e-5 here, from terms ~0.1) and its
    # coefficients ŵ_i (R_i − b_g) nearly cancel (gradients ~1e-6; each path within 7e-8 of fp64's)
    loss_tol, grad_tol = (dict(rtol=1e-6, atol=5e-6), dict(rtol=1e-6, atol=3e-7)) if name == "snis" else \
        (dict(rtol=1e-6, atol=1e-7),) * 2
    torch.testing.assert_close(f1.loss, f2.loss, **loss_tol)
    torch.testing.assert_close(g1, g2, **grad_tol)
    torch.testing.assert_close(p1.loss, p2.loss, **loss_tol)
    torch.testing.assert_close(l1, l2, **grad_tol)
    for key in f2.metrics:
        torch.testing.assert_close(f1.metrics[key], f2.metrics[key], msg=key)
    for key in p2.metrics:
        torch.testing.assert_close(p1.metrics[key], p2.metrics[key], msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "gspo", "kl_cov"])  # in the kernel, the sequence step, the covariance step
@pytest.mark.parametrize("grad", [True, False])
def test_outputs_carry_the_log_probs_and_entropies(backend, name, grad):
    config = preset(name)
    logits, targets, inputs = _case(seed=4)
    adv, mask = inputs["advantages"].float(), inputs["mask"]
    kw = _kwargs(inputs, config)
    logp, ent = rlkernels.token_logprobs(logits, targets, temperature=0.7, return_entropy=True, backend=backend)
    B, T, V = logits.shape
    H = 5
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    lin_logp, lin_ent = rlkernels.linear_token_logprobs(hidden, weight, targets, temperature=0.7,
                                                        return_entropy=True, backend=backend)
    with torch.set_grad_enabled(grad):
        fused = rlkernels.fused_policy_loss(logits.clone().requires_grad_(grad), targets, adv, mask, config,
                                            temperature=0.7, backend=backend, **kw)
        lin = rlkernels.fused_linear_policy_loss(hidden.requires_grad_(grad), weight, targets, adv, mask, config,
                                                 temperature=0.7, backend=backend, chunk_size=7, **kw)
    for out, lp, h in ((fused, logp, ent), (lin, lin_logp, lin_ent)):
        # differentiable where the loss is (issue 37 item 1: they were detached, a term on them silently constant)
        assert out.logp.shape == out.entropy.shape == (B, T) and out.logp.requires_grad == out.entropy.requires_grad == grad
        torch.testing.assert_close(out.logp, lp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.entropy, h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS + (["triton"] if not torch.cuda.is_available()
                                                 and rlkernels.backend_info()["triton"]["available"] else []))
@pytest.mark.parametrize("name", ["gspo", "luspo", "gepo", "fspo", "cispo_sequence"])
def test_off_policy_mask_counts_no_padding_as_clipped(backend, name):
    """A row of one clipped token and two pads, beside a row of three unclipped tokens: a quarter of the tokens are
    clipped. The off-policy mask's keep flags once held 1 on the padding, and the sequence step counted the row's
    flag on every position of it (3/4)."""
    config = (rlkernels.PolicyLossConfig(**SEQUENCE_CONFIGS[name]) if name in SEQUENCE_CONFIGS
              else preset(name, group_size=1))
    config = config.replace(off_policy_mask=0.5)
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    logp = rlkernels.token_logprobs(logits, targets)
    old = torch.stack([logp[0] - 0.6, logp[1]])  # row 0's ratio e^0.6 is above every band; row 1 is on-policy
    kw = dict(old_logp=old, rewards=torch.ones(2))
    out = rlkernels.fused_policy_loss(logits.requires_grad_(True), targets, torch.ones(2), mask, config,
                                      backend=backend, **kw)
    spec = rlkernels.policy_loss(logp, torch.ones(2), mask, config, **kw)
    assert float(spec.metrics["clip_frac_high"]) == 0.25
    assert float(out.metrics["clip_frac_high"]) == 0.25


@pytest.mark.parametrize("backend", BACKENDS)
def test_snis_weights_take_the_log_ratio_unclamped(backend):
    """log ρ = [25, 40, 0], R = [1, 0, 0.5]: SNIS's coefficients ŵ(R − b) are all below 1e-6 (the spec's test,
    test_policy_loss.py); the ±20 clamp of log ρ once gave ∓0.75 on the first two rows."""
    logits = torch.randn(3, 1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    targets = torch.zeros(3, 1, dtype=torch.long)
    old = rlkernels.token_logprobs(logits, targets) - torch.tensor([[25.0], [40.0], [0.0]], dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, None, torch.ones(3, 1, dtype=torch.bool), presets.snis(group_size=3),
                                      old_logp=old, rewards=torch.tensor([1.0, 0.0, 0.5]), backend=backend)
    out.loss.backward()
    assert x.grad.abs().max() < 1e-6
    torch.testing.assert_close(out.metrics["ratio_max"], torch.tensor(math.exp(20.0), dtype=torch.float64))
