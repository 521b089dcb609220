"""`policy_token_fwd` of every backend (cpu in fp32 and fp64, triton, cuda) against the fp64 spec.

The op computes ℓ and H of the logits and the per-token loss at them: its logp / entropy / lse_parts
must be those of the same logits upcast to fp64, its grad_logp / grad_entropy autograd's gradients of
the weighted loss, its stats the spec's per-token statistics (rlkernels/kernels/__init__.py gives the
contract). Cases, inputs, the spec, bounds and backends: token_loss_cases.py (shared with
test_policy_token_loss.py). The checks that only some backends have (their own argument checks, a
target outside the row) follow the contract's.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from token_loss_cases import (  # sets TRITON_INTERPRET=1 before triton is imported where there is no GPU
    BACKENDS, BAD_LOSS_SCALARS, BY_NAME, CASES, CLIP_HIGH, CLIP_LOW, NAN_CASES, PADDING, Inputs, branch_gaps,
    checks_branches_per_case, close, close_to_spec, draw_inputs, fwd_cases, make_case, missing_branches, params, seed,
    shape_params, spec, token_args, with_nan_fields,
)
from rlkernels.kernels import cpu, cuda
from rlkernels.kernels.token_loss_params import NUM_STATS, STATS
from rlkernels.losses import PolicyLossConfig
from rlkernels.losses.aggregation import aggregation_weights
from rlkernels.ops.kernel_params import token_loss_params

# Under the interpreter the Triton kernel computes with numpy: an inf·0 or inf − inf in a lane that
# tl.where discards (padding read by mistake) warns, and fails the test.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CPU, TRITON, CUDA = BY_NAME["cpu"], BY_NAME["triton"], BY_NAME["cuda"]


def _inputs(case, backend, seed_):
    return draw_inputs(case, backend.acc, seed_, backend.fwd_shape)


def _call(backend, case, x, padding=PADDING):
    """policy_token_fwd on `x` (A = 0 where the case has no advantages); is_weights: the fused tests."""
    a = token_args(x, backend.acc, backend.device, padding, names=("adv", "old", "ref"))
    n = x.mask.numel()
    adv = a["adv"] if a["adv"] is not None else torch.zeros(n, dtype=backend.acc, device=backend.device)
    weight = x.weight.reshape(-1).to(backend.acc).to(backend.device)
    return backend.kernels.policy_token_fwd(x.logits.to(backend.device), x.targets.to(backend.device),
                                            x.mask.reshape(-1).to(backend.device), weight, adv, a["old"], a["ref"],
                                            None, case.temperature, case.params)


def _close_logprobs(backend, out, x):
    """The forward's ℓ, H and (m, log s): those of the same logits in fp64."""
    logp, entropy, lse_parts = out[:3]
    close("logp", logp, x.logp.reshape(-1), backend.fwd_tol)
    close("entropy", entropy, x.entropy.reshape(-1), backend.fwd_tol)
    close("lse_parts", lse_parts, x.lse_parts, backend.fwd_tol)


@pytest.mark.parametrize("acc, shape", shape_params("fwd"))
def test_cases_reach_their_branches(acc, shape):
    """Every case's inputs put some, not all, unmasked tokens in each branch it is about, at every
    backend's shape and dtype (where a shape is too small for that, the Triton interpreter's, the cases
    between them reach every branch)."""
    assert not branch_gaps(fwd_cases(), acc, shape)


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("name", fwd_cases())
def test_matches_autograd_of_the_spec(name, backend):
    case, device = CASES[name], backend.device
    x = _inputs(case, backend, seed(name))
    s = spec(case, x)
    if checks_branches_per_case(backend.fwd_shape):  # else test_cases_reach_their_branches checks their union
        assert not missing_branches(case, x, s), "these inputs do not reach the branches of the case"

    out = _call(backend, case, x)
    logp, entropy, lse_parts, grad_logp, grad_entropy, stats = out
    n = x.mask.numel()
    assert all(t.dtype == backend.acc and t.device.type == device for t in out)
    assert stats.shape == (n, NUM_STATS) and lse_parts.shape == (n, 2) and logp.shape == grad_entropy.shape == (n,)
    _close_logprobs(backend, out, x)
    close_to_spec(grad_logp, grad_entropy, stats, s, backend.fwd_tol)
    # Masked tokens: exactly 0 (their inputs are NaN / ±inf); the clip flags exactly as the spec's.
    masked = ~x.mask.reshape(-1).to(device)
    assert (grad_logp[masked] == 0).all() and (grad_entropy[masked] == 0).all() and (stats[masked] == 0).all()
    assert torch.equal(stats[:, CLIP_LOW:CLIP_HIGH + 1].cpu().double(), s.stats[:, CLIP_LOW:CLIP_HIGH + 1])


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_inputs_give_the_spec_nans(name, backend):
    """NaN in old_logp, ref_logp or the advantages of some unmasked tokens: the gradients, the loss and every
    statistic NaN exactly where the spec's are, the other values the spec's."""
    case = NAN_CASES[name]
    for x in with_nan_fields(lambda: _inputs(case, backend, seed(name))):
        _, _, _, grad_logp, grad_entropy, stats = _call(backend, case, x)
        close_to_spec(grad_logp, grad_entropy, stats, spec(case, x), backend.fwd_tol, nans=True)


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("optional", [True, False], ids=["with_optionals", "without_optionals"])
def test_no_tokens(backend, optional):
    acc, device = backend.acc, backend.device
    empty = torch.empty(0, dtype=acc, device=device)
    opt = empty if optional else None
    out = backend.kernels.policy_token_fwd(torch.zeros(0, 7, dtype=acc, device=device),
                                           torch.zeros(0, dtype=torch.long, device=device),
                                           torch.zeros(0, dtype=torch.bool, device=device), empty, empty, opt, opt,
                                           opt, 1.0, token_loss_params(PolicyLossConfig(entropy_coef=0.01)))
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, 2), (0,), (0,), (0, NUM_STATS)]


@pytest.mark.parametrize("backend", params())
def test_all_masked(backend):
    """No token counts: ℓ, H and (m, log s) are still there for the backward; the rest is exactly 0,
    whatever (NaN / ±inf) the per-token inputs hold."""
    case = make_case(ref=True, kl_estimator="k2", kl_coef=0.1, entropy_coef=0.01)
    x = _inputs(case, backend, 3)
    x = dataclasses.replace(x, mask=torch.zeros_like(x.mask), weight=torch.zeros_like(x.weight))
    out = _call(backend, case, x)
    _close_logprobs(backend, out, x)
    _, _, _, grad_logp, grad_entropy, stats = out
    assert (grad_logp == 0).all() and (grad_entropy == 0).all() and (stats == 0).all()


@pytest.mark.parametrize("backend", params())
def test_batch_strided_view_in_one_call(backend):
    """logits[:, :-1] of a (B, T + 1, V) parent, read where it lies in one call (a batch stride beside the row
    stride, issue 30), gives what its rows copied contiguous give. V odd: rows aligned differently in turn."""
    B, T, V, n = 2, 5, 37, 10
    acc, device = backend.acc, backend.device
    gen = torch.Generator().manual_seed(5)
    parent = torch.randn(B, T + 1, V, generator=gen, dtype=acc).to(device)
    r = lambda: torch.randn(n, generator=gen, dtype=acc).to(device)  # noqa: E731
    args = (torch.randint(0, V, (n,), generator=gen).to(device), (torch.rand(n, generator=gen) < 0.8).to(device),
            r().abs(), r(), r() - 3, r() - 3, r().abs())
    params = token_loss_params(PolicyLossConfig(clip_low=0.2, clip_high=0.2, kl_estimator="k3", kl_coef=0.1,
                                                entropy_coef=0.01))
    view = backend.kernels.policy_token_fwd(parent[:, :-1], *args, 0.8, params)
    copy = backend.kernels.policy_token_fwd(parent[:, :-1].reshape(-1, V).contiguous(), *args, 0.8, params)
    for actual, expected in zip(view, copy):
        torch.testing.assert_close(actual, expected, rtol=backend.fwd_tol[0], atol=backend.fwd_tol[1])


@pytest.mark.parametrize("backend", params())
def test_k3_and_expm1_near_zero(backend):
    """k3(Δ) ≈ Δ²/2 and ∂k3/∂ℓ = −expm1(Δ) ≈ −Δ for small Δ, where e^Δ − 1 − Δ and e^Δ − 1 lose most
    bits in fp32 (and even expm1(Δ) − Δ loses log2(2/|Δ|): 2e-3 relative at |Δ| = 1e-5, as the compiled
    kernels had it). The spec is taken at the kernel's own ℓ (its first call's), and ℓ_ref, ℓ_old are
    ℓ + δ with ℓ_ref − ℓ exact in fp32, so only the kernel's k3 and expm1 can add error."""
    acc = backend.acc
    gen = torch.Generator().manual_seed(11)
    b, t = 2, 5
    logits = (torch.randn(b * t, 100, generator=gen, dtype=torch.float64) * 2).to(acc)
    targets = torch.randint(0, 100, (b * t,), generator=gen)
    mask = torch.ones(b, t, dtype=torch.bool)
    case = make_case(objective="reinforce", kl_estimator="k3", kl_coef=0.5, log_ratio_clamp=20.0)
    weight = aggregation_weights(mask, case.config.agg, dtype=torch.float64).to(acc).double()
    zero = torch.zeros(b, t, dtype=torch.float64)  # REINFORCE with A = 0: the loss is the KL term alone
    x = Inputs(mask, weight, zero, zero, zero, None, None, logits, targets)
    logp, entropy = (v.cpu().view(b, t) for v in _call(backend, case, x)[:2])
    delta = torch.tensor([1e-5, -1e-5, 3e-4, -3e-4, 1e-2, -1e-2, 0.7, -0.7, 1.2, -1.2], dtype=acc).view(b, t)
    ref, old = logp + delta, logp - delta.flip(0)
    x = dataclasses.replace(x, logp=logp.double(), entropy=entropy.double(), old=old.double(), ref=ref.double())
    s = spec(case, x)
    _, _, _, grad_logp, _, stats = _call(backend, case, x)
    kl, approx_kl = STATS.index("kl"), STATS.index("approx_kl")
    for actual, wanted in ((stats[:, kl], s.stats[:, kl]), (stats[:, approx_kl], s.stats[:, approx_kl]),
                           (grad_logp, s.grad_logp)):
        torch.testing.assert_close(actual.cpu().double(), wanted, rtol=2e-6, atol=0)


@pytest.mark.parametrize("backend", params([b for b in BACKENDS if b.nan_for_bad_targets]))
def test_target_outside_the_row_gives_nan_not_a_neighbours_logit(backend):
    """GPU backends do not check target values (that would synchronise; the cpu raises: see the bad
    tensors). Target V addresses the first logit of the next row, −1 on row 0 the word before the
    tensor, 10·V a row far away. Rows 0-2 are unmasked, row 9 (the last) masked."""
    case = make_case(ref=True, kl_estimator="k3", kl_coef=0.1)
    x = draw_inputs(case, backend.acc, 7, (2, 5, 100))
    mask = torch.ones_like(x.mask)
    mask[1, -1] = False
    x = dataclasses.replace(x, mask=mask, weight=aggregation_weights(mask, case.config.agg, dtype=torch.float64))
    good = _call(backend, case, x)
    bad_rows = torch.tensor([0, 1, 2, 9])
    bad = x.targets.clone()
    bad[bad_rows] = torch.tensor([-1, 100, 1000, 100])
    out = _call(backend, case, dataclasses.replace(x, targets=bad))
    fwd = backend.kernels.token_logprobs_fwd(x.logits.to(backend.device), bad.to(backend.device), 1.0, True)
    names = ("logp", "entropy", "lse_parts", "grad_logp", "grad_entropy", "stats")
    good, out = (dict(zip(names, (t.cpu() for t in o))) for o in (good, out))

    keep = torch.ones(x.mask.numel(), dtype=torch.bool)
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


# --------------------------------------------------------------------------------------------
# Argument errors: each backend's own checks.


def _valid_args(n=4, vocab=10, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda: torch.randn(n, generator=gen, dtype=acc).to(device)  # noqa: E731
    return dict(logits=torch.randn(n, vocab, generator=gen).to(dtype).to(device),
                targets=torch.randint(0, vocab, (n,), generator=gen).to(device),
                mask=torch.ones(n, dtype=torch.bool, device=device), weight=r().abs(), adv=r(), old_logp=r() - 3,
                ref_logp=r() - 3, is_weights=r().abs())


def _call_args(kernels, args, temperature=1.0, **params):
    base = token_loss_params(PolicyLossConfig(delta=3.0, dual_clip=3.0, kl_estimator="k3", kl_coef=0.1, kl_clamp=1.0))
    return kernels.policy_token_fwd(*args.values(), temperature, dataclasses.replace(base, **params))


@pytest.mark.parametrize("backend", params([CPU]))
def test_cpu_bad_tensors_name_the_argument(backend):
    a = _valid_args()
    n = a["logits"].shape[0]
    cases = [  # a dtype is a TypeError, a shape, layout or value a ValueError (docs/design.md §8)
        ("logits", TypeError, dict(logits=a["logits"].long())),
        ("logits", ValueError, dict(logits=a["logits"][None, None])),  # (N, V) or (B, T, V) only
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
            _call_args(cpu, {**a, **change})
    # fp64 logits accumulate in fp64: fp32 per-token inputs are refused.
    a64 = _valid_args(dtype=torch.float64)
    with pytest.raises(TypeError, match="^weight: expected dtype Double"):
        _call_args(cpu, {**a64, "weight": a64["weight"].float()})


@pytest.mark.parametrize("backend", params([CPU]))
def test_cpu_bad_scalars_name_the_argument(backend):
    a = _valid_args()
    cases = [("temperature", dict(temperature=0.0))] + [(name, dict(change)) for name, change in BAD_LOSS_SCALARS]
    for name, change in cases:
        temperature = change.pop("temperature", 1.0)
        with pytest.raises(ValueError, match=f"^{name}:"):
            _call_args(cpu, a, temperature, **change)
    # Every bound may be inf ("no bound"): the loss is then the unbounded one.
    inf = dict(clip_low=math.inf, clip_high=math.inf, delta=math.inf, dual_clip=math.inf, kl_clamp=math.inf,
               log_ratio_clamp=math.inf)
    unbounded = _call_args(cpu, a, **inf)
    w = torch.exp(unbounded[0] - a["old_logp"])
    torch.testing.assert_close(unbounded[5][:, STATS.index("ratio")], w)
    dk3 = torch.expm1(a["ref_logp"] - unbounded[0])  # ∂k3/∂Δ, and ∂Δ/∂ℓ = −1
    # ω times the surrogate only, not the KL term
    torch.testing.assert_close(unbounded[3], a["weight"] * (-a["adv"] * w * a["is_weights"] - 0.1 * dk3))


@pytest.mark.parametrize("backend", params([TRITON]))
def test_triton_bad_tensors_name_the_argument(backend):
    """Triton checks the logits' dtype and every shape (per-token values it converts to fp32)."""
    a = _valid_args(device=backend.device)
    cases = [
        ("logits", TypeError, dict(logits=a["logits"].double())),
        ("logits", ValueError, dict(logits=a["logits"][None, None])),  # (N, V) or (B, T, V) only
        ("logits", ValueError, dict(logits=a["logits"].t())),  # strided over V
        ("targets", ValueError, dict(targets=a["targets"][:3])),
        ("mask", ValueError, dict(mask=a["mask"][:3])),
        ("weight", ValueError, dict(weight=a["weight"][:3])),
        ("adv", ValueError, dict(adv=a["adv"][None])),
        ("old_logp", ValueError, dict(old_logp=a["old_logp"][:1])),
        ("ref_logp", ValueError, dict(ref_logp=torch.zeros(5, device=backend.device))),
        ("is_weights", ValueError, dict(is_weights=a["is_weights"][:2])),
    ]
    for name, error, change in cases:
        with pytest.raises(error, match=f"^{name}:"):
            _call_args(backend.kernels, {**a, **change})


@pytest.mark.parametrize("backend", params([CUDA]))
def test_cuda_argument_devices(backend):
    a = _valid_args(device="cuda")
    for name in ("mask", "weight", "adv", "old_logp", "ref_logp"):
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor on cuda"):
            _call_args(cuda, {**a, name: a[name].cpu()})
