"""`policy_token_loss` of every backend (cpu, triton, cuda) against the spec.

The op is the per-token loss of `policy_token_fwd` (contract in rlkernels/kernels/__init__.py)
evaluated at given log-probs ℓ (N,) and entropies H (N,) instead of logits: ``entropy=None`` is
H = 0, ``adv=None`` is A = 0 (only the KL and entropy terms), ``old_logp=None`` on-policy,
``ref_logp=None`` no reference. The spec is torch autograd of `rlkernels.losses` in fp64
(`LossInputs.masked` + `per_token_loss`, weighted by `aggregation_weights`), evaluated at exactly the
values the op receives (every input is drawn in fp64 and rounded to the op's dtype first), so the
op differs from it only by its own arithmetic.

Log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are drawn directly, away from every kink of the loss (the clip
bounds, δ, the dual clip, ±c, ±kl_clamp), so that fp32 and fp64 cannot take different branches;
each case asserts that its inputs reach the branches it is about. Masked tokens hold NaN / ±inf
padding, which the op must not read. Triton runs on CPU tensors in its interpreter when there is
no GPU (TRITON_INTERPRET=1 must be set before triton is imported); cuda only with a GPU.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: @triton.jit picks the interpreter at decoration.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from rlkernels.kernels import cpu, cuda  # noqa: E402
from rlkernels.kernels.token_loss_params import KL_NONE, NUM_STATS, STATS, TokenLossParams  # noqa: E402
from rlkernels.losses import PolicyLossConfig  # noqa: E402
from rlkernels.losses.aggregation import aggregation_weights  # noqa: E402
from rlkernels.losses.inputs import LossInputs  # noqa: E402
from rlkernels.losses.kl import kl_estimate  # noqa: E402
from rlkernels.losses.policy_loss import per_token_loss  # noqa: E402
from rlkernels.ops.kernel_params import surrogate_params, token_loss_params, token_terms_params  # noqa: E402
from kernel_cases import (  # noqa: E402
    BAD_LOSS_SCALARS, assert_like_spec_with_nans, close_to, kl_term, uniform_away, with_nans,
)

try:
    from rlkernels.kernels import triton as tk  # noqa: E402
except ImportError as e:  # triton not installed
    tk, _TRITON_OK, _TRITON_REASON = None, False, f"triton is not importable ({e})"
else:
    _TRITON_OK, _TRITON_REASON = tk.available()  # False on CPU when triton was imported before TRITON_INTERPRET=1

_CPU_OK, _CPU_REASON = cpu.available()
_CUDA_OK, _CUDA_REASON = cuda.available()

# The interpreter evaluates the Triton kernel in numpy: an inf·0 or inf − inf in a lane that
# tl.where discards (padding read by mistake) warns, and fails the test.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

B, T = 6, 50  # N = 300
TRITON_SHAPE = (5, 50)  # one program of 256 (the interpreter is slow); test_many_tokens runs several
HALF_WIDTH = 1.2  # ℓ − ℓ_old in [−1.2, 1.2]: ratios from 0.3 to 3.3, through every clip bound
REF_HALF_WIDTH = 1.5  # ℓ_ref − ℓ in [−1.5, 1.5]
LOSS, CLIP_LOW, CLIP_HIGH, RATIO, APPROX_KL, KL, ENTROPY = range(NUM_STATS)
assert STATS == ("loss", "clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy")


# --------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Case:
    config: PolicyLossConfig  # the loss the spec evaluates
    params: TokenLossParams  # what the op is given
    old: bool = True  # old_logp given (else on-policy)
    ref: bool = False  # ref_logp given
    entropy: bool = True  # entropy given (else None: H = 0)
    adv: bool = True  # adv given (else None: A = 0)
    exercises: tuple = ()  # branches that some, not all, unmasked tokens must reach


def _case(*, old=True, ref=False, entropy=True, adv=True, exercises=(), **config):
    cfg = PolicyLossConfig(**config)
    return Case(cfg, token_loss_params(cfg), old, ref, entropy, adv, tuple(exercises))


def _terms_case(*, old=True, entropy=True, exercises=(), **config):
    """`token_terms_params` of a clip config without advantages (how sequence-level losses take their
    KL and entropy terms): the spec is REINFORCE at A = 0, whose surrogate is 0."""
    full = PolicyLossConfig(**config)
    spec = dataclasses.replace(full, objective="reinforce", delta=None, dual_clip=None)
    return Case(spec, token_terms_params(full), old, True, entropy, False, tuple(exercises))


def _kl_cases():
    # each below the estimate's largest value on the drawn Δ
    clamps = {"k1": 0.5, "k2": 0.3, "k3": 0.2, "abs": 0.5, "low_var_kl+": 0.2}
    cases = {}
    for est in clamps:
        for clamp in (None, clamps[est]):
            for bias in (False, True):
                name = f"kl_{est.replace('+', '_plus')}" + ("_clamp" if clamp else "") + ("_bias" if bias else "")
                # with bias correction, c = 1: some w (and so the KL weight) clamped, and some Δ
                c = 1.0 if bias else 20.0
                exercises = ("kl_clamp",) if clamp else ()
                if bias:
                    exercises += ("log_ratio_clamp", "kl_log_ratio_clamp")
                cases[name] = _case(ref=True, kl_estimator=est, kl_coef=0.1 if est != "k2" else 0.3, kl_clamp=clamp,
                                    kl_bias_correction=bias, log_ratio_clamp=c, exercises=exercises)
    return cases


CASES = {
    "clip": _case(exercises=("clip_low", "clip_high")),
    "clip_asymmetric": _case(clip_low=0.1, clip_high=0.28, agg="seq_mean_token_sum",
                             exercises=("clip_low", "clip_high")),
    "clip_delta": _case(delta=1.5, exercises=("clip_low", "clip_high", "delta")),
    "clip_delta_below_one": _case(delta=0.9, exercises=("clip_low", "delta")),  # TRL accepts any δ > 0
    "clip_dual": _case(dual_clip=2.0, entropy_coef=0.01, exercises=("clip_low", "clip_high", "dual_clip")),
    "clip_asymmetric_delta_dual": _case(clip_low=0.15, clip_high=0.3, delta=3.0, dual_clip=1.8, ref=True,
                                        kl_estimator="k3", kl_coef=0.05, agg="seq_mean_token_mean",
                                        exercises=("clip_low", "clip_high", "dual_clip")),
    "clip_log_ratio_clamp": _case(log_ratio_clamp=0.8, exercises=("clip_low", "clip_high", "log_ratio_clamp")),
    "cispo": _case(objective="cispo", clip_low=0.2, clip_high=0.4, exercises=("clip_low", "clip_high")),
    "sapo": _case(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, ref=True, kl_estimator="k3", kl_coef=0.05),
    "dppo_tv": _case(objective="dppo_tv", clip_low=0.05, clip_high=0.03, exercises=("clip_low", "clip_high")),
    "dppo_kl_cap": _case(objective="dppo_kl", clip_low=0.05, clip_high=0.03, ratio_cap=1.5, entropy_coef=0.01,
                         exercises=("clip_low", "clip_high")),
    "dro": _case(objective="dro", dro_beta=0.3, ref=True, kl_estimator="k2", kl_coef=0.1),
    "dro_on_policy": _case(objective="dro", dro_beta=0.3, old=False),
    "topr": _case(objective="topr", clip_low=None, clip_high=None, exercises=("clip_high",)),
    "topr_clamp_kl": _case(objective="topr", log_ratio_clamp=0.8, ref=True, kl_estimator="k1", kl_coef=0.1,
                           entropy_coef=0.01, exercises=("clip_high", "log_ratio_clamp")),
    "cispo_no_low_clamp": _case(objective="cispo", clip_low=None, clip_high=0.3, log_ratio_clamp=0.8,
                                ref=True, kl_estimator="k1", kl_coef=0.1,
                                exercises=("clip_high", "log_ratio_clamp", "kl_log_ratio_clamp")),
    "reinforce": _case(objective="reinforce", entropy_coef=0.01, agg="seq_mean_token_mean"),
    "reinforce_on_policy_kl": _case(objective="reinforce", old=False, ref=True, kl_estimator="k2", kl_coef=0.3),
    **_kl_cases(),
    "kl_metric_only": _case(ref=True, kl_estimator="k2", kl_coef=0.0),  # β = 0: the kl statistic is k3
    "on_policy_kl_bias": _case(old=False, ref=True, kl_estimator="k3", kl_coef=0.1, kl_bias_correction=True),
    "entropy_none": _case(entropy=False, entropy_coef=0.02, ref=True, kl_estimator="k1", kl_coef=0.1),
    "entropy_negative_coef": _case(entropy_coef=-0.02, agg="constant", norm_length=T),
    "no_adv_terms": _terms_case(kl_estimator="k3", kl_coef=0.1, kl_clamp=0.2, kl_bias_correction=True,
                                log_ratio_clamp=1.0, entropy_coef=0.01, delta=2.0,
                                exercises=("kl_clamp", "log_ratio_clamp", "kl_log_ratio_clamp")),
    "no_adv_terms_on_policy_no_entropy": _terms_case(old=False, entropy=False, kl_estimator="k1", kl_coef=0.2,
                                                     entropy_coef=0.01),
    "no_adv_clip": _case(adv=False, ref=True, kl_estimator="k2", kl_coef=0.1, dual_clip=2.0, entropy_coef=0.01),
    # CISPO's clip flags depend on w only: set at A = 0 too, while its surrogate is 0
    "no_adv_cispo": _case(adv=False, objective="cispo", ref=True, kl_estimator="k1", kl_coef=0.1,
                          exercises=("clip_low", "clip_high")),
    "no_adv_no_ref": _case(adv=False, objective="reinforce", entropy=False),
}

# `surrogate_params`: the clip surrogate of a config with its KL and entropy terms left out.
_FULL = PolicyLossConfig(clip_low=0.1, clip_high=0.3, delta=2.0, kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01)
CASES["surrogate_params_clip"] = Case(PolicyLossConfig(clip_low=0.1, clip_high=0.3, delta=2.0),
                                      surrogate_params(_FULL, "clip"),
                                      exercises=("clip_low", "clip_high", "delta"))

# --------------------------------------------------------------------------------------------
# Inputs and the spec


@dataclasses.dataclass
class Inputs:
    """(B, T) fp64 tensors holding values exactly representable in the op's dtype."""
    mask: torch.Tensor
    weight: torch.Tensor
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    adv: Optional[torch.Tensor]
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]


def _inputs(case: Case, acc: torch.dtype, seed: int, shape=(B, T)) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    cfg = case.config
    b, t = shape
    n = b * t
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0], lengths[min(2, b - 1)] = t, 0  # a full row and an empty one
    mask = (torch.arange(t)[None, :] < lengths[:, None]) & (torch.rand(b, t, generator=gen) > 0.1)  # and holes
    weight = aggregation_weights(mask, cfg.agg, norm_length=cfg.norm_length, dtype=torch.float64)
    # ℓ ≤ −HALF_WIDTH, so that ℓ_old = ℓ − r ≤ 0 too: log-probs (DPPO's e^ℓ_old is a probability)
    logp = -HALF_WIDTH - torch.rand(b, t, generator=gen, dtype=torch.float64) * 5
    entropy = torch.rand(b, t, generator=gen, dtype=torch.float64) * 4 if case.entropy else None
    adv = None
    if case.adv:
        adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
        adv[0, :3] = 0.0  # A = 0: every branch of the clip objective ties
    c = cfg.log_ratio_clamp
    old = ref = None
    if case.old:
        bounds = [1 + cfg.clip_high if cfg.clip_high is not None else None, cfg.delta, cfg.dual_clip]
        if cfg.clip_low is not None and cfg.clip_low < 1:
            bounds.append(1 - cfg.clip_low)
        kinks = [-c, c] + [math.log(x) for x in bounds if x is not None]
        old = logp - uniform_away(gen, n, HALF_WIDTH, lambda r: close_to(r, kinks)).view(b, t)
    if case.ref:
        def kl_kinks(d):
            near = close_to(d, [-c, c])
            if case.params.kl_estimator != KL_NONE and cfg.kl_clamp is not None:
                near |= close_to(kl_term(d, cfg.kl_estimator, c).abs(), [cfg.kl_clamp])
            return near

        ref = logp + uniform_away(gen, n, REF_HALF_WIDTH, kl_kinks).view(b, t)
    exact = lambda x: None if x is None else x.to(acc).double()  # noqa: E731
    return Inputs(mask, exact(weight), exact(logp), exact(entropy), exact(adv), exact(old), exact(ref))


@dataclasses.dataclass
class Spec:
    grad_logp: torch.Tensor  # (N,)
    grad_entropy: torch.Tensor  # (N,)
    stats: torch.Tensor  # (N, NUM_STATS)


def _spec(case: Case, x: Inputs) -> Spec:
    """Torch autograd of rlkernels.losses in fp64 at the op's input values (None: H = 0, A = 0)."""
    cfg = case.config
    shape = tuple(x.mask.shape)
    zeros = torch.zeros(shape, dtype=torch.float64)
    lp = x.logp.clone().requires_grad_()
    ent = (zeros if x.entropy is None else x.entropy).clone().requires_grad_()
    inputs = LossInputs.build(cfg, shape=shape, dtype=torch.float64, device=torch.device("cpu"), mask=x.mask,
                              advantages=zeros if x.adv is None else x.adv, old_logp=x.old, ref_logp=x.ref)
    b, ref_m, ent_m = inputs.masked(lp, ent, cfg)
    per_token, sur, k = per_token_loss(b, cfg, ref_m, ent_m)
    zero = torch.zeros((), dtype=torch.float64)
    weighted = torch.where(x.mask, per_token * x.weight, zero)
    g_logp, g_ent = torch.autograd.grad(weighted.sum(), (lp, ent), allow_unused=True)
    g_logp = torch.zeros_like(lp) if g_logp is None else g_logp
    g_ent = torch.zeros_like(ent) if g_ent is None else g_ent
    approx_kl = kl_estimate(b.old_logp, b.logp.detach(), "k3", cfg.log_ratio_clamp)
    cols = [weighted, sur.clipped_low, sur.clipped_high, sur.ratio, approx_kl, zeros if k is None else k, ent_m]
    stats = torch.where(x.mask[..., None], torch.stack([col.detach().double() for col in cols], -1), zero)
    return Spec(g_logp.reshape(-1), g_ent.reshape(-1), stats.reshape(-1, NUM_STATS))


def _missing_branches(case: Case, x: Inputs, spec: Spec):
    """The branches of `case.exercises` that no unmasked token reaches, or that all of them do."""
    cfg, m = case.config, x.mask.reshape(-1)
    c = cfg.log_ratio_clamp
    w = spec.stats[:, RATIO]
    adv = torch.zeros_like(w) if x.adv is None else x.adv.reshape(-1)
    logp = x.logp.reshape(-1)
    reached = {"clip_low": spec.stats[:, CLIP_LOW].bool(), "clip_high": spec.stats[:, CLIP_HIGH].bool()}
    if cfg.objective == "clip":
        delta = cfg.delta if cfg.delta is not None else math.inf
        # u = −A·δ wins over k = −A·(1 + ε_high): the delta branch, no gradient
        reached["delta"] = (w > delta) & (adv < 0)
        surrogate = torch.maximum(-adv * w.clamp(max=delta), -adv * w.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
        reached["dual_clip"] = (adv < 0) & (surrogate > -(cfg.dual_clip or math.inf) * adv)
    if x.old is not None:
        reached["log_ratio_clamp"] = (logp - x.old.reshape(-1)).abs() > c
    if x.ref is not None:
        d = x.ref.reshape(-1) - logp
        reached["kl_log_ratio_clamp"] = d.abs() > c
        if cfg.kl_clamp is not None and cfg.kl_estimator is not None:
            reached["kl_clamp"] = kl_term(d, cfg.kl_estimator, c).abs() > cfg.kl_clamp
    return [name for name in case.exercises
            if name not in reached or not (reached[name] & m).any() or (reached[name] | ~m).all()]


# --------------------------------------------------------------------------------------------
# Backends and the op's arguments


def _backend(name):
    """(module, device) of a backend name."""
    if name == "cpu":
        return cpu, "cpu"
    if name == "cuda":
        return cuda, "cuda"
    return tk, "cuda" if torch.cuda.is_available() else "cpu"


BACKENDS = [
    pytest.param("cpu", torch.float32, id="cpu-fp32", marks=pytest.mark.skipif(not _CPU_OK, reason=_CPU_REASON)),
    pytest.param("cpu", torch.float64, id="cpu-fp64", marks=pytest.mark.skipif(not _CPU_OK, reason=_CPU_REASON)),
    pytest.param("triton", torch.float32, id="triton-fp32",
                 marks=pytest.mark.skipif(not _TRITON_OK, reason=_TRITON_REASON)),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.skipif(not _CUDA_OK, reason=_CUDA_REASON)),
]
ALL_BACKENDS = [p for p in BACKENDS if p.id != "cpu-fp64"]

# Padding of masked tokens: the op must not read it (the weight is 0 there, as the contract says).
PADDING = {"logp": math.nan, "entropy": math.inf, "adv": -math.inf, "old": -math.inf, "ref": math.nan}


def _op_args(x: Inputs, acc, device, padding=PADDING):
    """(logp, entropy, mask, weight, adv, old_logp, ref_logp), flat, in `acc` on `device`."""
    m = x.mask.reshape(-1)

    def token(name):
        t = getattr(x, name)
        if t is None:
            return None
        return torch.where(m, t.reshape(-1), padding[name]).to(acc).to(device)

    return (token("logp"), token("entropy"), m.to(device), x.weight.reshape(-1).to(acc).to(device), token("adv"),
            token("old"), token("ref"))


def _close(name, actual, expected, fp64):
    """Each element within rtol of its value plus atol of the largest of its column: the inputs are
    the same values, so only the op's rounding is allowed (fp32: a few units of 6e-8 per operation;
    measured on cpu and the triton interpreter: under a tenth of these bounds)."""
    rtol, atol = (1e-12, 1e-14) if fp64 else (2e-6, 5e-7)
    scale = expected.abs().amax(0).clamp(min=1e-3) if expected.numel() else 1.0
    actual = actual.double().cpu()
    err = (actual - expected).abs()
    bound = rtol * expected.abs() + atol * scale
    assert not err.isnan().any(), f"{name}: NaN where the spec is {expected[err.isnan()][:5].tolist()}"
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), (f"{name}: max error / bound {(err / bound).max():.3g} at {worst} (got "
                                  f"{actual.reshape(-1)[worst].item()!r}, want {expected.reshape(-1)[worst].item()!r})")


def _seed(name):
    return sum(map(ord, name))


# --------------------------------------------------------------------------------------------
# Tests


def test_cases_reach_their_branches():
    """Every case's inputs put some, not all, unmasked tokens in each branch it is about (else the
    comparison would not test it), in both dtypes and both shapes (test_matches_autograd_of_the_spec
    asserts it again on the inputs it runs)."""
    missing = {}
    for name, case in CASES.items():
        for acc, shape in ((torch.float32, (B, T)), (torch.float64, (B, T)), (torch.float32, TRITON_SHAPE)):
            x = _inputs(case, acc, _seed(name), shape)
            if gaps := _missing_branches(case, x, _spec(case, x)):
                missing[f"{name} {acc} {shape}"] = gaps
    assert not missing, missing
    # and between them, every branch
    assert {"clip_low", "clip_high", "delta", "dual_clip", "log_ratio_clamp", "kl_log_ratio_clamp",
            "kl_clamp"} <= {b for case in CASES.values() for b in case.exercises}


@pytest.mark.parametrize("backend, acc", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_autograd_of_the_spec(name, backend, acc):
    case = CASES[name]
    kernels, device = _backend(backend)
    x = _inputs(case, acc, _seed(name), TRITON_SHAPE if backend == "triton" else (B, T))
    spec = _spec(case, x)
    assert not _missing_branches(case, x, spec), "these inputs do not reach the branches of the case"

    out = kernels.policy_token_loss(*_op_args(x, acc, device), case.params)
    grad_logp, grad_entropy, stats = out
    n = x.mask.numel()
    assert all(t.dtype == acc and t.device.type == device for t in out)
    assert grad_logp.shape == grad_entropy.shape == (n,) and stats.shape == (n, NUM_STATS)
    fp64 = acc == torch.float64
    _close("grad_logp", grad_logp, spec.grad_logp, fp64)
    _close("grad_entropy", grad_entropy, spec.grad_entropy, fp64)
    for j, col in enumerate(STATS):
        _close(f"stats[:, {j}] ({col})", stats[:, j], spec.stats[:, j], fp64)
    # The clip flags exactly as the spec's; masked tokens exactly 0 whatever padding they hold.
    assert torch.equal(stats[:, CLIP_LOW:CLIP_HIGH + 1].cpu().double(), spec.stats[:, CLIP_LOW:CLIP_HIGH + 1])
    masked = ~x.mask.reshape(-1).to(device)
    assert (grad_logp[masked] == 0).all() and (grad_entropy[masked] == 0).all() and (stats[masked] == 0).all()

    if not case.adv:
        # A = 0: the loss is the KL and entropy terms alone, w_agg·(β·kl − c_H·H) ...
        p = case.params
        beta = p.kl_coef if p.kl_estimator != KL_NONE else 0.0
        kl, h = stats[:, KL].double().cpu(), stats[:, ENTROPY].double().cpu()
        terms = x.weight.reshape(-1) * (beta * kl - p.entropy_coef * h)
        _close("loss without advantages", stats[:, LOSS], terms, fp64)
        if case.config.objective != "cispo":  # ... and nothing is clipped (CISPO's flags do not depend on A)
            assert (stats[:, CLIP_LOW:CLIP_HIGH + 1] == 0).all()
    if not case.entropy:
        assert (stats[:, ENTROPY] == 0).all()  # H = 0
    if case.params.entropy_coef != 0:  # −w_agg·c_H, whether H is given or not
        torch.testing.assert_close(grad_entropy.double().cpu(), -x.weight.reshape(-1) * case.params.entropy_coef,
                                   rtol=1e-6 if not fp64 else 1e-15, atol=0)


@pytest.mark.parametrize("backend, acc", BACKENDS)
def test_many_tokens(backend, acc):
    """More tokens than one CPU chunk (4096) and many Triton programs / CUDA blocks; the CPU splits
    them over its threads."""
    case = CASES["clip_asymmetric_delta_dual"]
    shape = (4, 300) if backend == "triton" else (5, 2600)  # triton: 5 programs (the interpreter is slow)
    kernels, device = _backend(backend)
    x = _inputs(case, acc, 11, shape)
    spec = _spec(case, x)
    grad_logp, grad_entropy, stats = kernels.policy_token_loss(*_op_args(x, acc, device), case.params)
    fp64 = acc == torch.float64
    _close("grad_logp", grad_logp, spec.grad_logp, fp64)
    _close("grad_entropy", grad_entropy, spec.grad_entropy, fp64)
    for j, col in enumerate(STATS):
        _close(f"stats[:, {j}] ({col})", stats[:, j], spec.stats[:, j], fp64)


@pytest.mark.parametrize("backend, acc", BACKENDS)
def test_masked_tokens_read_nothing(backend, acc):
    """Masked tokens give exact zeros whatever they hold (NaN / ±inf in every input, a nonzero weight),
    and change nothing on the others: bitwise the same outputs as with zero padding."""
    case = _case(ref=True, dual_clip=2.0, kl_estimator="k3", kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01)
    kernels, device = _backend(backend)
    x = _inputs(case, acc, 5)
    m = x.mask.reshape(-1)
    zero_pad = {name: 0.0 for name in PADDING}
    clean = kernels.policy_token_loss(*_op_args(x, acc, device, zero_pad), case.params)
    for pad in (PADDING, {name: -v for name, v in PADDING.items()}, {name: math.nan for name in PADDING}):
        logp, entropy, mask, weight, adv, old, ref = _op_args(x, acc, device, pad)
        weight = torch.where(mask, weight, 2.5)  # outside the contract (0 where masked), still never read
        out = kernels.policy_token_loss(logp, entropy, mask, weight, adv, old, ref, case.params)
        for name, a, b in zip(("grad_logp", "grad_entropy", "stats"), out, clean):
            assert (a[~m.to(device)] == 0).all(), f"{name}: nonzero on a masked token with padding {pad}"
            assert torch.equal(a[m.to(device)], b[m.to(device)]), name


@pytest.mark.parametrize("backend, acc", BACKENDS)
def test_nan_logp_keeps_its_gradient_nan(backend, acc):
    """An unmasked NaN ℓ (a target outside [0, V) on a GPU) gives a NaN gradient and loss, even where
    a clipped branch would give 0; the other tokens are unaffected."""
    case = _case(dual_clip=2.0, ref=True, kl_estimator="k3", kl_coef=0.1, kl_clamp=0.2)
    kernels, device = _backend(backend)
    x = _inputs(case, acc, 9)
    args = list(_op_args(x, acc, device))
    clean = kernels.policy_token_loss(*args, case.params)
    m = x.mask.reshape(-1)
    nan_at = torch.nonzero(m)[:8, 0]
    args[0] = args[0].clone()
    args[0][nan_at.to(device)] = math.nan
    grad_logp, _, stats = out = kernels.policy_token_loss(*args, case.params)
    assert grad_logp[nan_at].isnan().all() and stats[nan_at, LOSS].isnan().all()
    keep = torch.ones_like(m)
    keep[nan_at] = False
    keep = keep.to(device)
    for a, b in zip(out, clean):
        assert torch.equal(a[keep], b[keep])


# Configs whose old_logp, ref_logp or advantages hold NaN: every objective, each KL estimator, clamp and the bias
# correction, δ, the dual clip and the log-ratio clamp. (min(w, δ) once took δ for a NaN w: grpo's loss was ±inf.)
NAN_CASES = {
    "grpo": _case(ref=True, kl_estimator="k3", kl_coef=0.04),
    "clip_delta_dual_k1_clamp_bias": _case(delta=1.5, dual_clip=2.0, ref=True, kl_estimator="k1", kl_coef=0.1,
                                           kl_clamp=0.2, kl_bias_correction=True, entropy_coef=0.01),
    "clip_log_ratio_clamp_k2": _case(log_ratio_clamp=0.5, ref=True, kl_estimator="k2", kl_coef=0.1),
    "cispo_k3": _case(objective="cispo", clip_low=0.2, clip_high=0.4, ref=True, kl_estimator="k3", kl_coef=0.1),
    "sapo_k3_clamp": _case(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, ref=True, kl_estimator="k3",
                           kl_coef=0.05, kl_clamp=0.1),
    "dppo_tv": _case(objective="dppo_tv", clip_low=0.05, clip_high=0.03, ref=True, kl_estimator="k1", kl_coef=0.1),
    "dppo_kl_cap": _case(objective="dppo_kl", clip_low=0.05, clip_high=0.03, ratio_cap=1.5, ref=True,
                         kl_estimator="k2", kl_coef=0.1),
    "dro": _case(objective="dro", dro_beta=0.3, ref=True, kl_estimator="k2", kl_coef=0.1),
    "reinforce_k3_bias": _case(objective="reinforce", ref=True, kl_estimator="k3", kl_coef=0.1,
                               kl_bias_correction=True, log_ratio_clamp=1.0),
    "kl_metric_only": _case(ref=True, kl_estimator="k2", kl_coef=0.0),
}


@pytest.mark.parametrize("backend, acc", BACKENDS)
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_inputs_give_the_spec_nans(name, backend, acc):
    """NaN in old_logp, ref_logp or the advantages of some unmasked tokens: the gradients, the loss and every
    statistic NaN exactly where the spec's are, the other values the spec's."""
    case = NAN_CASES[name]
    kernels, device = _backend(backend)
    for field in ("old", "ref", "adv"):
        x = _inputs(case, acc, _seed(name), TRITON_SHAPE if backend == "triton" else (B, T))
        setattr(x, field, with_nans(getattr(x, field), x.mask))
        spec = _spec(case, x)
        grad_logp, grad_entropy, stats = kernels.policy_token_loss(*_op_args(x, acc, device), case.params)
        columns = [("grad_logp", grad_logp, spec.grad_logp), ("grad_entropy", grad_entropy, spec.grad_entropy)]
        columns += [(f"stats[:, {j}] ({col})", stats[:, j], spec.stats[:, j]) for j, col in enumerate(STATS)]
        for col, actual, expected in columns:
            assert_like_spec_with_nans(f"NaN {field}, {col}", actual, expected,
                                       lambda *a: _close(*a, acc == torch.float64))


@pytest.mark.parametrize("backend, acc", BACKENDS)
def test_zero_entropy_coef_ignores_entropy(backend, acc):
    """With c_H = 0 the loss has no entropy term (`per_token_loss` skips it): a non-finite H of an
    unmasked token shows in the entropy statistic only."""
    case = _case(dual_clip=2.0, ref=True, kl_estimator="k1", kl_coef=0.1)
    kernels, device = _backend(backend)
    x = _inputs(case, acc, 13)
    spec = _spec(case, x)
    args = list(_op_args(x, acc, device))
    bad = torch.nonzero(x.mask.reshape(-1))[:2, 0].to(device)
    args[1] = args[1].clone()
    args[1][bad] = torch.tensor([math.nan, math.inf], dtype=acc, device=device)
    grad_logp, grad_entropy, stats = kernels.policy_token_loss(*args, case.params)
    fp64 = acc == torch.float64
    _close("grad_logp", grad_logp, spec.grad_logp, fp64)
    _close("stats[:, 0] (loss)", stats[:, LOSS], spec.stats[:, LOSS], fp64)
    assert (grad_entropy == 0).all()
    assert stats[bad[0], ENTROPY].isnan() and stats[bad[1], ENTROPY] == math.inf


@pytest.mark.parametrize("backend, acc", BACKENDS)
@pytest.mark.parametrize("optional", [True, False], ids=["with_optionals", "without_optionals"])
def test_no_tokens(backend, acc, optional):
    kernels, device = _backend(backend)
    empty = torch.empty(0, dtype=acc, device=device)
    opt = empty if optional else None
    params = token_loss_params(PolicyLossConfig(kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01))
    out = kernels.policy_token_loss(empty, opt, torch.empty(0, dtype=torch.bool, device=device), empty, opt, opt,
                                    opt, params)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, NUM_STATS)]
    assert all(t.dtype == acc and t.device.type == device for t in out)


# --------------------------------------------------------------------------------------------
# Argument errors


def _valid_args(n=4, acc=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    r = lambda: torch.randn(n, generator=gen, dtype=torch.float64).to(acc).to(device)  # noqa: E731
    return dict(logp=r() - 3, entropy=r().abs(), mask=torch.ones(n, dtype=torch.bool, device=device),
                weight=r().abs(), adv=r(), old_logp=r() - 3, ref_logp=r() - 3)


_PARAMS = token_loss_params(PolicyLossConfig(delta=3.0, dual_clip=3.0, kl_estimator="k3", kl_coef=0.1, kl_clamp=1.0,
                                             entropy_coef=0.01))


def _call(kernels, args, **params):
    return kernels.policy_token_loss(*args.values(), dataclasses.replace(_PARAMS, **params))


def _names(name):
    """A message that names `name` (not merely contains it: `logp` is in `old_logp`)."""
    return rf"(?<![\w]){name}\b"


def _bad_tensors(a):
    """(argument, exception, change): a dtype is a TypeError, a shape or layout a ValueError (docs/design.md §8)."""
    n, dev = a["logp"].shape[0], a["logp"].device
    strided = lambda: torch.zeros(n, 2, dtype=a["logp"].dtype, device=dev)[:, 0]  # noqa: E731  not contiguous
    return [
        ("logp", TypeError, dict(logp=a["logp"].half())),
        ("logp", TypeError, dict(logp=a["logp"].long())),
        ("logp", ValueError, dict(logp=a["logp"][None])),
        ("logp", ValueError, dict(logp=strided())),
        ("entropy", TypeError, dict(entropy=a["entropy"].double())),
        ("entropy", ValueError, dict(entropy=a["entropy"][:3])),
        ("entropy", ValueError, dict(entropy=strided())),
        ("mask", TypeError, dict(mask=a["mask"].float())),
        ("mask", ValueError, dict(mask=a["mask"][:3])),
        ("weight", TypeError, dict(weight=a["weight"].double())),
        ("weight", ValueError, dict(weight=a["weight"][:, None])),
        ("weight", ValueError, dict(weight=strided())),
        ("adv", TypeError, dict(adv=a["adv"].half())),
        ("adv", ValueError, dict(adv=a["adv"][None])),
        ("old_logp", TypeError, dict(old_logp=a["old_logp"].double())),
        ("old_logp", ValueError, dict(old_logp=a["old_logp"][:1])),
        ("ref_logp", TypeError, dict(ref_logp=a["ref_logp"].bfloat16())),
        ("ref_logp", ValueError, dict(ref_logp=torch.zeros(n + 1, dtype=a["logp"].dtype, device=dev))),
    ]


@pytest.mark.skipif(not _CPU_OK, reason=_CPU_REASON)
def test_cpu_bad_tensors_name_the_argument():
    a = _valid_args()
    _call(cpu, a)  # valid as they are
    for name, error, change in _bad_tensors(a):
        with pytest.raises(error, match=_names(name)):
            _call(cpu, {**a, **change})
    # fp64 log-probs take fp64 per-token inputs: fp32 ones are refused, not converted.
    a64 = _valid_args(acc=torch.float64)
    _call(cpu, a64)
    for name in ("entropy", "weight", "adv", "old_logp", "ref_logp"):
        with pytest.raises(TypeError, match=_names(name) + ".*Double"):
            _call(cpu, {**a64, name: a64[name].float()})


@pytest.mark.skipif(not _CPU_OK, reason=_CPU_REASON)
@pytest.mark.parametrize("n", [4, 0])
def test_cpu_bad_scalars_name_the_argument(n):
    """Refused on every batch, the empty one too."""
    a = _valid_args(n)
    for name, change in BAD_LOSS_SCALARS:
        with pytest.raises(ValueError, match=_names(name)):
            _call(cpu, a, **change)


@pytest.mark.skipif(not _TRITON_OK, reason=_TRITON_REASON)
def test_triton_bad_tensors_name_the_argument():
    device = _backend("triton")[1]
    a = _valid_args(device=device)
    cases = [
        ("logp", dict(logp=a["logp"].double())),
        ("logp", dict(logp=a["logp"][None])),
        ("mask", dict(mask=a["mask"][:3])),
        ("weight", dict(weight=a["weight"][:3])),
        ("entropy", dict(entropy=a["entropy"][None])),
        ("adv", dict(adv=a["adv"][:1])),
        ("old_logp", dict(old_logp=a["old_logp"][:3])),
        ("ref_logp", dict(ref_logp=torch.zeros(5, device=device))),
    ]
    for name, change in cases:
        with pytest.raises((RuntimeError, ValueError, TypeError), match=_names(name)):
            _call(tk, {**a, **change})


@pytest.mark.skipif(not _CUDA_OK, reason=_CUDA_REASON)
def test_cuda_bad_tensors_and_devices_name_the_argument():
    a = _valid_args(device="cuda")
    _call(cuda, a)
    for name, error, change in _bad_tensors(a):
        with pytest.raises(error, match=_names(name)):
            _call(cuda, {**a, **change})
    for name in ("entropy", "mask", "weight", "adv", "old_logp", "ref_logp"):
        with pytest.raises(ValueError, match=_names(name) + ": expected a tensor on cuda"):
            _call(cuda, {**a, name: a[name].cpu()})
    # CPU log-probs with CUDA inputs go to the CUDA implementation, which names them.
    with pytest.raises(ValueError, match=_names("logp")):
        _call(cuda, {**a, "logp": a["logp"].cpu()})
