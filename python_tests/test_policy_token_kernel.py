"""`policy_token_fwd` of the compiled kernels (csrc/include/rlkernels/token_loss.h) against the spec.

The spec is torch autograd of `rlkernels.losses` in fp64: log-probs and entropies of the same
(upcast) logits, the per-token loss of `per_token_loss`, weighted by `aggregation_weights`; the
kernel's grad_logp / grad_entropy must be autograd's gradients of that weighted sum, its stats
the spec's per-token statistics (rlkernels/kernels/__init__.py gives the contract).

Log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are drawn directly, away from every kink of the loss (the clip
bounds, δ, the dual clip, ±c, ±kl_clamp): there the fp32 kernel and the fp64 spec may take
different sides, and the derivative jumps. Each case checks that its inputs reach the branches it
is about. Runs on the CPU; the same cases run on CUDA where a GPU and a CUDA build exist.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from rlkernels.kernels import cpu, cuda, torch_chunked
from rlkernels.kernels.token_loss_params import NUM_STATS, STATS
from rlkernels.losses import PolicyLossConfig
from rlkernels.losses.aggregation import aggregation_weights
from rlkernels.losses.inputs import LossInputs
from rlkernels.losses.kl import kl_estimate
from rlkernels.losses.policy_loss import per_token_loss
from rlkernels.ops.kernel_params import token_loss_params

from kernel_cases import BAD_LOSS_SCALARS, assert_like_spec_with_nans, close_to, kl_term, uniform_away, with_nans

_CPU_OK, _CPU_REASON = cpu.available()
_CUDA_OK, _CUDA_REASON = cuda.available()
pytestmark = pytest.mark.skipif(not _CPU_OK, reason=_CPU_REASON)

B, T, V = 4, 16, 301  # V odd: a partial last vector step on the CPU, a misaligned row on CUDA
HALF_WIDTH = 1.2  # log-ratios in [−1.2, 1.2]: ratios from 0.3 to 3.3, through every clip bound


@dataclasses.dataclass(frozen=True)
class Case:
    config: PolicyLossConfig
    dtype: torch.dtype = torch.float32
    temperature: float = 1.0
    on_policy: bool = False
    ref: bool = False
    exercises: tuple = ()  # the branches whose presence among the unmasked tokens is asserted


def _case(dtype=torch.float32, temperature=1.0, on_policy=False, ref=False, exercises=(), **config):
    return Case(PolicyLossConfig(**config), dtype, temperature, on_policy, ref, exercises)


CASES = {
    "clip": _case(exercises=("clip_low", "clip_high")),
    "clip_delta": _case(delta=1.5, exercises=("delta",)),
    "clip_delta_below_one": _case(delta=0.9, exercises=("delta",)),  # TRL accepts any δ > 0
    "clip_dual": _case(dual_clip=2.0, exercises=("dual_clip",)),
    "clip_asymmetric_delta_dual": _case(clip_low=0.1, clip_high=0.28, delta=3.0, dual_clip=1.8, agg="seq_mean_token_sum",
                                        exercises=("clip_low", "clip_high", "dual_clip")),
    "cispo_no_low": _case(objective="cispo", clip_low=None, clip_high=0.3, exercises=("clip_high",)),
    "cispo": _case(objective="cispo", clip_low=0.2, clip_high=0.4, exercises=("clip_low", "clip_high")),
    "reinforce": _case(objective="reinforce", agg="seq_mean_token_mean"),
    "sapo": _case(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, ref=True, kl_estimator="k3", kl_coef=0.05),
    # Log-probs here are ~−6 (V = 301): every token is inside DPPO's trust region (test_policy_token_loss.py
    # reaches both sides with log-probs drawn directly).
    "dppo_tv": _case(objective="dppo_tv", clip_low=0.15, clip_high=0.1),
    "dppo_kl_cap": _case(objective="dppo_kl", clip_low=0.05, clip_high=0.03, ratio_cap=1.5, entropy_coef=0.01),
    "dro": _case(objective="dro", dro_beta=0.3, ref=True, kl_estimator="k2", kl_coef=0.1),
    "dro_on_policy": _case(objective="dro", dro_beta=0.3, on_policy=True),
    "topr": _case(objective="topr", clip_low=None, clip_high=None, ref=True, kl_estimator="k3", kl_coef=0.05,
                  exercises=("clip_high",)),
    "topr_on_policy": _case(objective="topr", on_policy=True, entropy_coef=0.01),
    "kl_k1": _case(ref=True, kl_estimator="k1", kl_coef=0.1),
    "kl_k1_bias": _case(ref=True, kl_estimator="k1", kl_coef=0.2, kl_bias_correction=True),
    "kl_k2_clamp": _case(ref=True, kl_estimator="k2", kl_coef=0.05, kl_clamp=0.2, exercises=("kl_clamp",)),
    "kl_k3_clamp_bias": _case(ref=True, kl_estimator="k3", kl_coef=0.1, kl_clamp=0.1, kl_bias_correction=True,
                              exercises=("kl_clamp",)),
    "kl_abs_clamp": _case(ref=True, kl_estimator="abs", kl_coef=0.1, kl_clamp=0.3, log_ratio_clamp=0.5,
                          exercises=("kl_clamp", "kl_log_ratio_clamp")),
    "kl_low_var_kl_plus_bias": _case(ref=True, kl_estimator="low_var_kl+", kl_coef=0.1, kl_bias_correction=True,
                                     log_ratio_clamp=0.5, exercises=("log_ratio_clamp", "kl_log_ratio_clamp")),
    "kl_metric_only": _case(ref=True, kl_estimator="k2", kl_coef=0.0),
    "on_policy": _case(on_policy=True, ref=True, kl_estimator="k3", kl_coef=0.1),
    "entropy": _case(entropy_coef=0.01, agg="constant", norm_length=T),
    "entropy_negative_reinforce": _case(objective="reinforce", entropy_coef=-0.02, ref=True, kl_estimator="k1",
                                        kl_coef=0.1),
    "log_ratio_clamp": _case(log_ratio_clamp=0.5, ref=True, kl_estimator="k2", kl_coef=0.1,
                             exercises=("log_ratio_clamp", "kl_log_ratio_clamp")),
    "cispo_log_ratio_clamp": _case(objective="cispo", clip_low=0.1, clip_high=0.1, log_ratio_clamp=0.7,
                                   exercises=("log_ratio_clamp",)),
    "bf16_tau": _case(dtype=torch.bfloat16, temperature=0.7, dual_clip=3.0, ref=True, kl_estimator="k3", kl_coef=0.1,
                      entropy_coef=0.01),
    "fp16_tau": _case(dtype=torch.float16, temperature=1.3, objective="cispo", clip_low=None, clip_high=0.2,
                      entropy_coef=0.005),
    "fp64": _case(dtype=torch.float64, temperature=0.8, delta=2.5, dual_clip=2.0, ref=True, kl_estimator="k3",
                  kl_coef=0.1, kl_clamp=0.3, kl_bias_correction=True, entropy_coef=0.01, log_ratio_clamp=1.0),
    "fp64_on_policy_reinforce": _case(dtype=torch.float64, objective="reinforce", on_policy=True, ref=True,
                                      kl_estimator="k2", kl_coef=0.3),
}


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class Inputs:
    logits: torch.Tensor  # (N, V) in the case's dtype
    targets: torch.Tensor
    mask: torch.Tensor  # (B, T)
    adv: torch.Tensor  # (B, T) fp64
    old_logp: Optional[torch.Tensor]  # (B, T) fp64
    ref_logp: Optional[torch.Tensor]


def _inputs(case: Case, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    cfg = case.config
    logits = (torch.randn(B * T, V, generator=gen, dtype=torch.float64) * 2).to(case.dtype)
    targets = torch.randint(0, V, (B * T,), generator=gen)
    lengths = torch.tensor([T, T - 5, 0, 9])  # ragged rows and an empty one
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv[0, :3] = 0.0  # A = 0: every branch of the clip objective ties
    logp, _, _ = torch_chunked.token_logprobs_fwd(logits.double(), targets, case.temperature, False)
    logp = logp.view(B, T)
    c = cfg.log_ratio_clamp
    old = ref = None
    if not case.on_policy:
        bounds = [1 + cfg.clip_high if cfg.clip_high is not None else None, cfg.delta, cfg.dual_clip]
        if cfg.clip_low is not None and cfg.clip_low < 1:
            bounds.append(1 - cfg.clip_low)
        kinks = [-c, c] + [math.log(b) for b in bounds if b is not None]
        old = logp - uniform_away(gen, B * T, HALF_WIDTH, lambda r: close_to(r, kinks)).view(B, T)
    if case.ref:
        def kl_kinks(d):
            near = close_to(d, [-c, c])
            if cfg.kl_coef > 0 and cfg.kl_clamp is not None:
                near |= close_to(kl_term(d, cfg.kl_estimator, c).abs(), [cfg.kl_clamp])
            return near

        ref = logp + uniform_away(gen, B * T, 1.5, kl_kinks).view(B, T)
    return Inputs(logits, targets, mask, adv, old, ref)


@dataclasses.dataclass
class Spec:
    logp: torch.Tensor  # (N,) each
    entropy: torch.Tensor
    lse_parts: torch.Tensor  # (N, 2)
    grad_logp: torch.Tensor
    grad_entropy: torch.Tensor
    stats: torch.Tensor  # (N, NUM_STATS)
    log_ratio: torch.Tensor  # (N,) ℓ − ℓ_old, for the coverage checks
    surrogate: torch.Tensor  # (N,) before the dual clip's cap is applied


def _spec(case: Case, x: Inputs) -> Spec:
    """Torch autograd of rlkernels.losses in fp64 on the same logits."""
    cfg = case.config
    logp, entropy, lse_parts = torch_chunked.token_logprobs_fwd(x.logits.double(), x.targets, case.temperature, True)
    lp = logp.view(B, T).clone().requires_grad_()
    ent = entropy.view(B, T).clone().requires_grad_()
    inputs = LossInputs.build(cfg, shape=(B, T), dtype=torch.float64, device=torch.device("cpu"), mask=x.mask,
                              advantages=x.adv, old_logp=x.old_logp, ref_logp=x.ref_logp)
    b, ref_m, ent_m = inputs.masked(lp, ent, cfg)
    per_token, sur, k = per_token_loss(b, cfg, ref_m, ent_m)
    weights = aggregation_weights(x.mask, cfg.agg, norm_length=cfg.norm_length, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    weighted = torch.where(x.mask, per_token * weights, zero)
    g_logp, g_ent = torch.autograd.grad(weighted.sum(), (lp, ent), allow_unused=True)
    g_ent = torch.zeros_like(ent) if g_ent is None else g_ent
    approx_kl = kl_estimate(b.old_logp, b.logp.detach(), "k3", cfg.log_ratio_clamp)
    cols = [weighted, sur.clipped_low, sur.clipped_high, sur.ratio, approx_kl, zero.expand(B, T) if k is None else k,
            ent_m]
    stats = torch.where(x.mask[..., None], torch.stack([col.detach().double() for col in cols], -1), zero)
    unclipped = -b.adv * (sur.ratio.clamp(max=cfg.delta) if cfg.delta is not None else sur.ratio)
    surrogate = torch.maximum(unclipped, -b.adv * sur.ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)) \
        if cfg.objective == "clip" else sur.loss.detach()
    return Spec(logp, entropy, lse_parts, g_logp.reshape(-1), g_ent.reshape(-1), stats.reshape(-1, NUM_STATS),
                (b.logp - b.old_logp).detach().reshape(-1), surrogate.reshape(-1))


def _missing_branches(case: Case, x: Inputs, spec: Spec):
    """The branches of `case.exercises` that no unmasked token reaches (the case would test nothing)."""
    cfg, m = case.config, x.mask.reshape(-1)
    adv, w = x.adv.reshape(-1), spec.stats[:, STATS.index("ratio")]
    reached = {
        "clip_low": spec.stats[:, 1].bool(),
        "clip_high": spec.stats[:, 2].bool(),
        "delta": (w > (cfg.delta or math.inf)) & (adv < 0),  # u = −A·δ wins over k = −A·(1+ε): no gradient
        "dual_clip": (adv < 0) & (spec.surrogate > -(cfg.dual_clip or math.inf) * adv),
        "log_ratio_clamp": spec.log_ratio.abs() > cfg.log_ratio_clamp,
    }
    if x.ref_logp is not None:
        delta = (x.ref_logp.reshape(-1) - spec.logp)
        reached["kl_log_ratio_clamp"] = delta.abs() > cfg.log_ratio_clamp
        if cfg.kl_clamp is not None:
            reached["kl_clamp"] = kl_term(delta, cfg.kl_estimator, cfg.log_ratio_clamp).abs() > cfg.kl_clamp
    # each branch taken by some tokens, and not by all of them
    return [name for name in case.exercises if not (reached[name] & m).any() or (reached[name] | ~m).all()]


def _kernel_args(case: Case, x: Inputs, device):
    """The kernel's flat inputs; masked positions hold NaN, which the kernel must not read."""
    acc = _acc(case.dtype)
    flat_m = x.mask.reshape(-1)
    weights = aggregation_weights(x.mask, case.config.agg, norm_length=case.config.norm_length, dtype=torch.float64)

    def token_input(t):
        return None if t is None else torch.where(flat_m, t.reshape(-1), math.nan).to(acc).to(device)

    return (x.logits.to(device), x.targets.to(device), flat_m.to(device), weights.reshape(-1).to(acc).to(device),
            token_input(x.adv), token_input(x.old_logp), token_input(x.ref_logp), None)  # is_weights: the fused tests


BACKENDS = [
    pytest.param(cpu, "cpu", id="cpu"),
    pytest.param(cuda, "cuda", id="cuda", marks=pytest.mark.skipif(not _CUDA_OK, reason=_CUDA_REASON)),
]


def _close(name, actual, expected, fp64):
    """Each element within rtol of its value plus atol of the largest in its column: fp32's ℓ is exact
    to ~1e-6 absolute, which every term of the loss inherits relative to its own size."""
    rtol, atol = (1e-9, 1e-11) if fp64 else (1e-5, 1e-5)
    scale = expected.abs().amax(0) if expected.numel() else 1.0
    err = (actual.double().cpu() - expected).abs()
    bound = rtol * expected.abs() + atol * torch.clamp(torch.as_tensor(scale, dtype=torch.float64), min=1e-3)
    assert (err <= bound).all(), f"{name}: max error / bound {(err / bound).max():.3g} at {(err / bound).argmax()}"


@pytest.mark.parametrize("kernels, device", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_autograd_of_the_spec(name, kernels, device):
    case = CASES[name]
    if device == "cuda" and case.dtype == torch.float64:
        pytest.skip("the CUDA kernels take no fp64 logits")
    x = _inputs(case, seed=list(CASES).index(name))
    spec = _spec(case, x)
    assert not _missing_branches(case, x, spec), "these inputs reach no token in that branch"

    out = kernels.policy_token_fwd(*_kernel_args(case, x, device), case.temperature, token_loss_params(case.config))
    logp, entropy, lse_parts, grad_logp, grad_entropy, stats = out
    acc = _acc(case.dtype) if device == "cpu" else torch.float32
    assert all(t.dtype == acc and t.device.type == device for t in out)
    assert stats.shape == (B * T, NUM_STATS) and logp.shape == grad_entropy.shape == (B * T,)
    fp64 = case.dtype == torch.float64
    for col_name, actual, expected in [("logp", logp, spec.logp), ("entropy", entropy, spec.entropy),
                                       ("lse_parts", lse_parts, spec.lse_parts),
                                       ("grad_logp", grad_logp, spec.grad_logp),
                                       ("grad_entropy", grad_entropy, spec.grad_entropy)]:
        _close(col_name, actual, expected, fp64)
    for j, col_name in enumerate(STATS):
        _close(f"stats[:, {j}] ({col_name})", stats[:, j], spec.stats[:, j], fp64)
    # Masked tokens: exactly 0 (their inputs are NaN); the clip flags exactly as the spec's.
    masked = ~x.mask.reshape(-1).to(device)
    assert (grad_logp[masked] == 0).all() and (grad_entropy[masked] == 0).all() and (stats[masked] == 0).all()
    assert torch.equal(stats[:, 1:3].cpu().double(), spec.stats[:, 1:3])


@pytest.mark.parametrize("kernels, device", BACKENDS)
@pytest.mark.parametrize("name", ["clip", "bf16_tau", "log_ratio_clamp", "kl_k3_clamp_bias", "sapo", "dppo_kl_cap"])
def test_nan_inputs_give_the_spec_nans(name, kernels, device):
    """NaN in old_logp, ref_logp or the advantages of some unmasked tokens: the gradients, the loss and every
    statistic NaN exactly where the spec's are, the other values the spec's (test_policy_token_loss.py runs every
    objective)."""
    case = CASES[name]
    for field in ("old_logp", "ref_logp", "adv"):
        x = _inputs(case, seed=list(CASES).index(name))
        if getattr(x, field) is None:
            continue
        setattr(x, field, with_nans(getattr(x, field), x.mask))
        spec = _spec(case, x)
        _, _, _, grad_logp, grad_entropy, stats = kernels.policy_token_fwd(
            *_kernel_args(case, x, device), case.temperature, token_loss_params(case.config))
        columns = [("grad_logp", grad_logp, spec.grad_logp), ("grad_entropy", grad_entropy, spec.grad_entropy)]
        columns += [(f"stats[:, {j}] ({col})", stats[:, j], spec.stats[:, j]) for j, col in enumerate(STATS)]
        for col, actual, expected in columns:
            assert_like_spec_with_nans(f"NaN {field}, {col}", actual, expected,
                                       lambda *a: _close(*a, case.dtype == torch.float64))


@pytest.mark.parametrize("kernels, device", BACKENDS)
def test_empty_batch_and_all_masked(kernels, device):
    params = token_loss_params(PolicyLossConfig(entropy_coef=0.01))
    z = torch.zeros((), device=device)
    empty = kernels.policy_token_fwd(torch.zeros(0, 7, device=device), torch.zeros(0, dtype=torch.long, device=device),
                                     torch.zeros(0, dtype=torch.bool, device=device), z.new_zeros(0), z.new_zeros(0),
                                     z.new_zeros(0), None, None, 1.0, params)
    assert [tuple(t.shape) for t in empty] == [(0,), (0,), (0, 2), (0,), (0,), (0, NUM_STATS)]

    gen = torch.Generator().manual_seed(7)
    n = 5
    logits = torch.randn(n, 50, generator=gen).to(device)
    targets = torch.randint(0, 50, (n,), generator=gen).to(device)
    nan = torch.full((n,), math.nan, device=device)
    logp, entropy, lse_parts, grad_logp, grad_entropy, stats = kernels.policy_token_fwd(
        logits, targets, torch.zeros(n, dtype=torch.bool, device=device), torch.zeros(n, device=device), nan, nan,
        nan, nan, 1.0, params)
    expected = torch_chunked.token_logprobs_fwd(logits.cpu().double(), targets.cpu(), 1.0, True)
    for actual, want in zip((logp, entropy, lse_parts), expected):  # the forward is still there for the backward
        torch.testing.assert_close(actual.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert (grad_logp == 0).all() and (grad_entropy == 0).all() and (stats == 0).all()


def _valid_args(n=4, vocab=10, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    acc = _acc(dtype)
    r = lambda: torch.randn(n, generator=gen, dtype=acc).to(device)  # noqa: E731
    return dict(logits=torch.randn(n, vocab, generator=gen).to(dtype).to(device),
                targets=torch.randint(0, vocab, (n,), generator=gen).to(device),
                mask=torch.ones(n, dtype=torch.bool, device=device), weight=r().abs(), adv=r(), old_logp=r() - 3,
                ref_logp=r() - 3, is_weights=r().abs())


def _call(kernels, args, temperature=1.0, **params):
    base = token_loss_params(PolicyLossConfig(delta=3.0, dual_clip=3.0, kl_estimator="k3", kl_coef=0.1, kl_clamp=1.0))
    return kernels.policy_token_fwd(*args.values(), temperature, dataclasses.replace(base, **params))


def test_bad_tensors_name_the_argument():
    a = _valid_args()
    n = a["logits"].shape[0]
    cases = [  # a dtype is a TypeError, a shape, layout or value a ValueError (docs/design.md §8)
        ("logits", TypeError, dict(logits=a["logits"].long())),
        ("logits", ValueError, dict(logits=a["logits"][None])),
        ("logits", ValueError, dict(logits=torch.randn(10, n).t())),  # not contiguous
        ("targets", TypeError, dict(targets=a["targets"].float())),
        ("targets", ValueError, dict(targets=a["targets"][:3])),
        ("targets", ValueError, dict(targets=a["targets"] + 10)),  # outside [0, V): raised on the CPU
        ("mask", TypeError, dict(mask=a["mask"].float())),
        ("mask", ValueError, dict(mask=a["mask"][:3])),
        ("weight", TypeError, dict(weight=a["weight"].double())),  # not the accumulation dtype
        ("weight", ValueError, dict(weight=torch.zeros(n, 2)[:, 0])),  # not contiguous
        ("adv", TypeError, dict(adv=a["adv"].half())),
        ("adv", ValueError, dict(adv=a["adv"][None])),
        ("old_logp", TypeError, dict(old_logp=a["old_logp"].double())),
        ("old_logp", ValueError, dict(old_logp=a["old_logp"][:1])),
        ("ref_logp", TypeError, dict(ref_logp=a["ref_logp"].bfloat16())),
        ("ref_logp", ValueError, dict(ref_logp=torch.zeros(n + 1))),
        ("is_weights", TypeError, dict(is_weights=a["is_weights"].double())),
        ("is_weights", ValueError, dict(is_weights=a["is_weights"][:2])),
    ]
    for name, error, change in cases:
        with pytest.raises(error, match=f"^{name}:"):
            _call(cpu, {**a, **change})
    # fp64 logits accumulate in fp64: fp32 per-token inputs are refused.
    a64 = _valid_args(dtype=torch.float64)
    with pytest.raises(TypeError, match="^weight: expected dtype Double"):
        _call(cpu, {**a64, "weight": a64["weight"].float()})


def test_bad_scalars_name_the_argument():
    a = _valid_args()
    cases = [("temperature", dict(temperature=0.0))] + [(name, dict(change)) for name, change in BAD_LOSS_SCALARS]
    for name, change in cases:
        temperature = change.pop("temperature", 1.0)
        with pytest.raises(ValueError, match=f"^{name}:"):
            _call(cpu, a, temperature, **change)
    # Every bound may be inf ("no bound"): the loss is then the unbounded one.
    inf = dict(clip_low=math.inf, clip_high=math.inf, delta=math.inf, dual_clip=math.inf, kl_clamp=math.inf,
               log_ratio_clamp=math.inf)
    unbounded = _call(cpu, a, **inf)
    w = torch.exp(unbounded[0] - a["old_logp"])
    torch.testing.assert_close(unbounded[5][:, STATS.index("ratio")], w)
    dk3 = torch.expm1(a["ref_logp"] - unbounded[0])  # ∂k3/∂Δ, and ∂Δ/∂ℓ = −1
    # ω times the surrogate only, not the KL term
    torch.testing.assert_close(unbounded[3], a["weight"] * (-a["adv"] * w * a["is_weights"] - 0.1 * dk3))


@pytest.mark.skipif(not _CUDA_OK, reason=_CUDA_REASON)
def test_cuda_argument_devices_and_bad_targets():
    a = _valid_args(device="cuda")
    for name in ("mask", "weight", "adv", "old_logp", "ref_logp"):
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor on cuda"):
            _call(cuda, {**a, name: a[name].cpu()})
    # A target outside [0, V) is not checked on the device (that would synchronise): its row is NaN.
    targets = a["targets"].clone()
    targets[1] = 10
    logp, _, _, grad_logp, _, stats = _call(cuda, {**a, "targets": targets})
    assert logp[1].isnan() and grad_logp[1].isnan() and stats[1, 0].isnan()
    assert logp[[0, 2, 3]].isfinite().all()
