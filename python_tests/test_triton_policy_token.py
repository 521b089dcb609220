"""`kernels.triton.policy_token_fwd` against torch autograd of `rlkernels.losses`, in fp64.

The spec of every output is computed here from the losses code itself: ℓ and H of the same logit
values upcast to fp64 (`torch_chunked`), then `LossInputs.masked` + `per_token_loss` times the
aggregation weights, differentiated by autograd. The kernel computes in fp32 from the same
values, so every dtype is held to fp32-level tolerances. Without CUDA the kernel runs in the
Triton interpreter (slow: few rows, small V); RuntimeWarnings are errors, so an intermediate
inf·0 or inf − inf (a NaN in a lane `tl.where` discards) fails a test.
"""
import math
import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: @triton.jit picks the interpreter at decoration.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from rlkernels.kernels import torch_chunked  # noqa: E402
from rlkernels.kernels import triton as tk  # noqa: E402
from rlkernels.kernels.token_loss_params import NUM_STATS, STATS  # noqa: E402
from rlkernels.losses import PolicyLossConfig  # noqa: E402
from rlkernels.losses.aggregation import aggregation_weights  # noqa: E402
from rlkernels.losses.inputs import LossInputs  # noqa: E402
from rlkernels.losses.kl import kl_estimate  # noqa: E402
from rlkernels.losses.policy_loss import per_token_loss  # noqa: E402
from rlkernels.ops.kernel_params import token_loss_params  # noqa: E402

from kernel_cases import assert_like_spec_with_nans, with_nans  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

ON_CPU = not torch.cuda.is_available()
if ON_CPU and not tk.launch.INTERPRET:
    pytest.skip("rlkernels.kernels.triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)
DEVICE = "cpu" if ON_CPU else "cuda"
B, T = 2, 5
# fp32 arithmetic on identical inputs: ℓ is off by ~1e-6 absolute (log s of ~10 in fp32), which
# moves w = e^{ℓ − ℓ_old} by ~1e-6 relative and small KL values by ~1e-6 absolute.
RTOL, ATOL = 2e-5, 2e-6


def make_inputs(seed, vocab, dtype, c):
    """Logits, targets and (B, T) mask / advantages / ℓ_old / ℓ_ref near ℓ, with log-ratios
    beyond ±c on some tokens and NaN / inf padding on masked ones (the kernel must ignore it)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B * T, vocab, generator=g) * 2).to(dtype)
    targets = torch.randint(0, vocab, (B * T,), generator=g)
    targets[0], targets[1] = 0, vocab - 1
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, :3] = True
    mask[1, -1] = False
    logp, _, _ = torch_chunked.token_logprobs_fwd(logits.double(), targets, 1.0, False)
    logp = logp.view(B, T)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5
    adv[0, 1] = -abs(adv[0, 1])  # both signs: A < 0 is where dual_clip acts
    adv[0, 2] = abs(adv[0, 2])
    old = logp + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[0, 0] = logp[0, 0] - (c + 1.0)  # |ℓ − ℓ_old| > c: r clamped, no gradient through w
    ref[0, 1] = logp[0, 1] + (c + 1.0)  # |ℓ_ref − ℓ| > c: Δ clamped, no KL gradient
    for t, pad in ((adv, math.inf), (old, -math.inf), (ref, math.nan)):
        t[~mask] = pad
    return logits, targets, mask, adv, old, ref


def spec(logits, targets, mask, adv, old, ref, temperature, config, logp=None):
    """Every output of policy_token_fwd, from autograd of the losses code in fp64 (at ``logp``
    when given, else at ℓ of the logits)."""
    logp_fwd, entropy, lse_parts = torch_chunked.token_logprobs_fwd(logits.double(), targets,
                                                                    temperature, True)
    logp = logp_fwd if logp is None else logp.double()
    logp_leaf = logp.view(B, T).clone().requires_grad_(True)
    entropy_leaf = entropy.view(B, T).clone().requires_grad_(True)
    inputs = LossInputs.build(config, shape=(B, T), dtype=torch.float64, device=logits.device,
                              mask=mask, advantages=adv, old_logp=old, ref_logp=ref)
    b, ref_m, entropy_m = inputs.masked(logp_leaf, entropy_leaf, config)
    per_token, sur, k = per_token_loss(b, config, ref_m, entropy_m)
    weight = aggregation_weights(mask, config.agg, dtype=torch.float64)
    loss = per_token * weight
    grads = torch.autograd.grad(loss.sum(), (logp_leaf, entropy_leaf), allow_unused=True)
    grad_logp, grad_entropy = (torch.zeros(B, T, dtype=torch.float64) if gr is None else gr
                               for gr in grads)
    zero = torch.zeros(B, T, dtype=torch.float64)
    columns = {
        "loss": loss,
        "clip_low": sur.clipped_low,
        "clip_high": sur.clipped_high,
        "ratio": sur.ratio,
        "approx_kl": kl_estimate(b.old_logp, b.logp, "k3", config.log_ratio_clamp),
        "kl": zero if k is None else k,
        "entropy": entropy_m,
    }
    stats = torch.stack([torch.where(mask, columns[name].detach().double(), zero)
                         for name in STATS], -1)
    return {"logp": logp, "entropy": entropy, "lse_parts": lse_parts, "grad_logp": grad_logp.reshape(-1),
            "grad_entropy": grad_entropy.reshape(-1), "stats": stats.reshape(-1, NUM_STATS)}, weight


def run_kernel(logits, targets, mask, weight, adv, old, ref, temperature, config):
    flat = lambda t: None if t is None else t.reshape(-1).float().to(DEVICE)  # noqa: E731
    outs = tk.policy_token_fwd(logits.to(DEVICE), targets.to(DEVICE), mask.reshape(-1).to(DEVICE),
                               flat(weight), flat(adv), flat(old), flat(ref), None, temperature,
                               token_loss_params(config))
    names = ("logp", "entropy", "lse_parts", "grad_logp", "grad_entropy", "stats")
    return {name: out.cpu() for name, out in zip(names, outs)}


def case(name, *, dtype=torch.float32, temperature=1.0, vocab=200, old=True, ref=True, **config):
    config.setdefault("log_ratio_clamp", 2.0)
    return pytest.param(dtype, temperature, vocab, old, ref, config, id=name)


CASES = [
    case("clip", kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01),
    case("clip-delta-t0.7", temperature=0.7, delta=1.3),
    case("clip-dual", dual_clip=1.5, entropy_coef=-0.02),
    case("clip-asym-bf16", dtype=torch.bfloat16, temperature=0.7, clip_low=0.1, clip_high=0.28),
    case("clip-delta-dual-fp16", dtype=torch.float16, temperature=1.3, delta=1.4, dual_clip=2.0,
         kl_estimator="k1", kl_coef=0.1),
    case("cispo-no-low", objective="cispo", clip_low=None, clip_high=0.3),
    case("cispo-low-bf16", dtype=torch.bfloat16, objective="cispo", clip_low=0.2, clip_high=0.3,
         kl_estimator="k2", kl_coef=0.2),
    case("reinforce", objective="reinforce", entropy_coef=0.01),
    case("reinforce-on-policy", objective="reinforce", old=False, kl_estimator="k3", kl_coef=0.1),
    case("k1-clamp", kl_estimator="k1", kl_coef=0.1, kl_clamp=0.2),
    case("k2-bias", kl_estimator="k2", kl_coef=0.1, kl_bias_correction=True),
    case("k3-clamp-bias", kl_estimator="k3", kl_coef=0.3, kl_clamp=0.1, kl_bias_correction=True),
    case("k3-no-clamp-bias-c20", kl_estimator="k3", kl_coef=0.3, kl_bias_correction=True,
         log_ratio_clamp=20.0),
    case("abs-clamp-c0.5", kl_estimator="abs", kl_coef=0.1, kl_clamp=0.3, log_ratio_clamp=0.5),
    case("low-var-kl-plus-bias-c0.5", kl_estimator="low_var_kl+", kl_coef=0.1, kl_bias_correction=True,
         log_ratio_clamp=0.5),
    case("kl-coef-0", kl_estimator="k2", kl_coef=0.0, entropy_coef=0.01),
    case("no-ref", ref=False, entropy_coef=0.01),
    case("on-policy", old=False, kl_estimator="k3", kl_coef=0.05, kl_bias_correction=True),
    case("seq-mean-weights-two-tiles", vocab=700, agg="seq_mean_token_mean",
         kl_estimator="k3", kl_coef=0.05),
    case("small-c", log_ratio_clamp=0.3, kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01),
    case("sapo", objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_estimator="k3", kl_coef=0.05),
    case("dppo-tv", objective="dppo_tv", clip_low=0.15, clip_high=0.15, entropy_coef=0.01),
    case("dppo-kl-cap-bf16", dtype=torch.bfloat16, objective="dppo_kl", clip_low=0.05, clip_high=0.05,
         ratio_cap=1.5),
    case("dro", objective="dro", dro_beta=0.1, kl_estimator="k2", kl_coef=0.1),
    case("dro-on-policy", objective="dro", dro_beta=0.1, old=False),
    case("topr", objective="topr", kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01),
    case("topr-on-policy-bf16", dtype=torch.bfloat16, objective="topr", old=False),
]


@pytest.mark.parametrize("dtype,temperature,vocab,has_old,has_ref,config", CASES)
def test_matches_autograd_of_losses(request, dtype, temperature, vocab, has_old, has_ref, config):
    config = PolicyLossConfig(**config)
    seed = sum(map(ord, request.node.callspec.id))
    logits, targets, mask, adv, old, ref = make_inputs(seed, vocab, dtype, config.log_ratio_clamp)
    old, ref = (old if has_old else None), (ref if has_ref else None)
    expected, weight = spec(logits, targets, mask, adv, old, ref, temperature, config)
    actual = run_kernel(logits, targets, mask, weight, adv, old, ref, temperature, config)

    for name, value in actual.items():
        assert value.dtype == torch.float32, name
        torch.testing.assert_close(value.double(), expected[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("config", [
    pytest.param(dict(delta=1.3, dual_clip=1.5, kl_estimator="k3", kl_coef=0.1, kl_clamp=0.2, kl_bias_correction=True,
                      entropy_coef=0.01), id="clip-delta-dual-k3-clamp-bias"),
    pytest.param(dict(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_estimator="k2", kl_coef=0.1),
                 id="sapo-k2"),
    pytest.param(dict(objective="dppo_kl", clip_low=0.05, clip_high=0.05, ratio_cap=1.5, kl_estimator="k1",
                      kl_coef=0.1), id="dppo-kl-cap-k1"),
])
def test_nan_inputs_give_the_spec_nans(request, config):
    """NaN in ℓ_old, ℓ_ref or A of some unmasked tokens: the gradients, the loss and every statistic NaN exactly
    where the spec's are, the other values the spec's (test_policy_token_loss.py runs every objective)."""
    config = PolicyLossConfig(log_ratio_clamp=2.0, **config)
    seed = sum(map(ord, request.node.callspec.id))
    for field in ("adv", "old", "ref"):
        logits, targets, mask, *per_token = make_inputs(seed, 200, torch.float32, config.log_ratio_clamp)
        inputs = dict(zip(("adv", "old", "ref"), per_token))
        inputs[field] = with_nans(inputs[field], mask)
        expected, weight = spec(logits, targets, mask, *inputs.values(), 1.0, config)
        actual = run_kernel(logits, targets, mask, weight, *inputs.values(), 1.0, config)
        for name in ("grad_logp", "grad_entropy", "stats"):
            assert_like_spec_with_nans(f"NaN {field}, {name}", actual[name], expected[name],
                                       lambda n, a, e: torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=n))


def test_cases_reach_every_branch():
    """The inputs of CASES put tokens past each bound (else a wrong branch could pass)."""
    hits = {key: False for key in ("clip_low", "clip_high", "delta", "dual", "r_clamped",
                                   "kl_clamped")}
    for param in CASES:
        dtype, temperature, vocab, _, _, kw = param.values
        config = PolicyLossConfig(**kw)
        seed = sum(map(ord, param.id))
        logits, targets, mask, adv, old, ref = make_inputs(seed, vocab, dtype,
                                                           config.log_ratio_clamp)
        logp, _, _ = torch_chunked.token_logprobs_fwd(logits.double(), targets, temperature, False)
        logp = logp.view(B, T)
        d = logp - old
        w = d.clamp(-config.log_ratio_clamp, config.log_ratio_clamp).exp()
        hits["r_clamped"] |= bool((mask & (d.abs() > config.log_ratio_clamp)).any())
        if config.objective == "clip":
            hits["clip_low"] |= bool((mask & (w < 1 - config.clip_low) & (adv < 0)).any())
            hits["clip_high"] |= bool((mask & (w > 1 + config.clip_high) & (adv > 0)).any())
            if config.delta is not None:
                hits["delta"] |= bool((mask & (w > config.delta) & (adv < 0)).any())
            if config.dual_clip is not None:
                hits["dual"] |= bool((mask & (w > config.dual_clip) & (adv < 0)).any())
        if config.kl_clamp is not None:
            k = kl_estimate(ref, logp, config.kl_estimator, config.log_ratio_clamp)
            hits["kl_clamped"] |= bool((mask & (k.abs() > config.kl_clamp)).any())
    assert all(hits.values()), hits


def test_k3_and_expm1_near_zero():
    # k3(Δ) ≈ Δ²/2 and ∂k3/∂ℓ = −expm1(Δ) ≈ −Δ for small Δ, where e^Δ − 1 − Δ and e^Δ − 1
    # lose most bits in fp32. The spec is taken at the kernel's own ℓ, and ℓ_ref, ℓ_old are
    # ℓ + δ with ℓ_ref − ℓ exact in fp32, so only the kernel's k3 and expm1 can add error.
    logits, targets, mask, _, _, _ = make_inputs(11, 100, torch.float32, 20.0)
    mask = torch.ones_like(mask)
    logp, _, _ = tk.token_logprobs_fwd(logits.to(DEVICE), targets.to(DEVICE), 1.0, False)
    logp = logp.cpu().view(B, T)
    delta = torch.tensor([1e-5, -1e-5, 3e-4, -3e-4, 1e-2, -1e-2, 0.7, -0.7, 1.2, -1.2]).view(B, T)
    ref, old = logp + delta, logp - delta.flip(0)
    adv = torch.zeros(B, T)  # REINFORCE with A = 0: the loss is the KL term alone
    config = PolicyLossConfig(objective="reinforce", kl_estimator="k3", kl_coef=0.5,
                              log_ratio_clamp=20.0)
    expected, weight = spec(logits, targets, mask, adv, old, ref, 1.0, config, logp=logp)
    out = run_kernel(logits, targets, mask, weight, adv, old, ref, 1.0, config)
    kl, approx_kl = STATS.index("kl"), STATS.index("approx_kl")
    for actual, wanted in ((out["stats"][:, kl], expected["stats"][:, kl]),
                           (out["stats"][:, approx_kl], expected["stats"][:, approx_kl]),
                           (out["grad_logp"], expected["grad_logp"])):
        torch.testing.assert_close(actual.double(), wanted, rtol=2e-6, atol=0)


def test_target_outside_the_row_gives_nan_not_a_neighbours_logit():
    # Target V addresses the first logit of the next row, −1 on row 0 the word before the
    # tensor, 10·V a row far away. Rows 0-2 are unmasked, row 9 (the last) masked.
    logits, targets, mask, adv, old, ref = make_inputs(7, 100, torch.float32, 2.0)
    config = PolicyLossConfig(kl_estimator="k3", kl_coef=0.1)
    weight = aggregation_weights(mask, config.agg, dtype=torch.float64)
    good = run_kernel(logits, targets, mask, weight, adv, old, ref, 1.0, config)
    bad_rows = torch.tensor([0, 1, 2, 9])
    bad = targets.clone()
    bad[bad_rows] = torch.tensor([-1, 100, 1000, 100])
    out = run_kernel(logits, bad, mask, weight, adv, old, ref, 1.0, config)
    fwd = tk.token_logprobs_fwd(logits.to(DEVICE), bad.to(DEVICE), 1.0, True)

    keep = torch.ones(B * T, dtype=torch.bool)
    keep[bad_rows] = False
    for logp in (out["logp"], fwd[0].cpu()):
        assert logp[bad_rows].isnan().all()
        assert torch.equal(logp[keep], good["logp"][keep])
    for name in ("entropy", "lse_parts"):  # the row itself was read as usual
        assert torch.equal(out[name], good[name])
    # An unmasked bad token makes the loss NaN (as torch's would be); a masked one adds 0.
    assert out["stats"][:3, 0].isnan().all()
    assert (out["stats"][9] == 0).all() and out["grad_logp"][9] == 0
    for name in ("grad_logp", "stats"):
        assert torch.equal(out[name][keep], good[name][keep])


def test_all_masked():
    logits, targets, mask, adv, old, ref = make_inputs(3, 100, torch.float32, 2.0)
    mask = torch.zeros_like(mask)
    config = PolicyLossConfig(kl_estimator="k2", kl_coef=0.1, entropy_coef=0.01)
    weight = aggregation_weights(mask, config.agg, dtype=torch.float64)
    out = run_kernel(logits, targets, mask, weight, adv, old, ref, 1.0, config)
    expected, _ = spec(logits, targets, mask, adv, old, ref, 1.0, config)
    for name in ("logp", "entropy", "lse_parts"):  # the forward still runs on every row
        torch.testing.assert_close(out[name].double(), expected[name], rtol=RTOL, atol=ATOL)
    for name in ("grad_logp", "grad_entropy", "stats"):
        assert (out[name] == 0).all(), name


def test_no_rows():
    logits = torch.empty(0, 7, device=DEVICE)
    empty = torch.empty(0, device=DEVICE)
    outs = tk.policy_token_fwd(logits, torch.empty(0, dtype=torch.int64, device=DEVICE),
                               torch.empty(0, dtype=torch.bool, device=DEVICE), empty, empty,
                               None, empty, None, 1.0, token_loss_params(PolicyLossConfig()))
    assert [tuple(o.shape) for o in outs] == [(0,), (0,), (0, 2), (0,), (0,), (0, NUM_STATS)]
