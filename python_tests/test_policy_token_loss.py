"""`policy_token_loss` of every backend (cpu in fp32 and fp64, triton, cuda) against the fp64 spec.

The op is the per-token loss of `policy_token_fwd` (contract in rlkernels/kernels/__init__.py)
evaluated at given log-probs ℓ (N,) and entropies H (N,) instead of logits: ``entropy=None`` is
H = 0, ``adv=None`` is A = 0 (only the KL and entropy terms), ``old_logp=None`` on-policy,
``ref_logp=None`` no reference. Cases, inputs, the spec, bounds and backends: token_loss_cases.py
(shared with test_policy_token_fwd.py). The checks that only some backends have (their own argument
checks) follow the contract's.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from token_loss_cases import (  # sets TRITON_INTERPRET=1 before triton is imported where there is no GPU
    BAD_LOSS_SCALARS, BOUNDARY_CASES, BRANCHES, BY_NAME, CASES, CLIP_HIGH, CLIP_LOW, ENTROPY, KL, LOSS, NAN_CASES,
    PADDING, RATIO, boundary_inputs, branch_gaps, close, close_to_spec, draw_inputs, make_case, missing_branches,
    params, registry_cases, seed, shape_params, spec, token_args, with_nan_fields,
)
from rlkernels.kernels import cpu, cuda
from rlkernels.kernels.token_loss_params import KL_NONE, NUM_STATS, OBJECTIVES
from rlkernels.losses import objectives
from rlkernels.losses import PolicyLossConfig
from rlkernels.ops.kernel_params import token_loss_params
from rlkernels import reference
from rlkernels.losses import policy_loss

# The interpreter evaluates the Triton kernel in numpy: an inf·0 or inf − inf in a lane that
# tl.where discards (padding read by mistake) warns, and fails the test.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CPU, TRITON, CUDA = BY_NAME["cpu"], BY_NAME["triton"], BY_NAME["cuda"]


def _inputs(case, backend, seed_, shape=None):
    return draw_inputs(case, backend.acc, seed_, shape or backend.loss_shape)


def _call(backend, x, params, padding=PADDING):
    a = token_args(x, backend.acc, backend.device, padding)
    weight = x.weight.reshape(-1).to(backend.acc).to(backend.device)
    return backend.kernels.policy_token_loss(a["logp"], a["entropy"], x.mask.reshape(-1).to(backend.device), weight,
                                             a["adv"], a["old"], a["ref"], params)


@pytest.mark.parametrize("acc, shape", shape_params("loss"))
def test_cases_reach_their_branches(acc, shape):
    """Every case's inputs put some, not all, unmasked tokens in each branch it is about (else the
    comparison would not test it), at every backend's shape and dtype (test_matches_autograd_of_the_spec
    asserts it again on the inputs it runs); and between them the cases name every branch."""
    assert not branch_gaps(list(CASES), acc, shape)
    assert set(BRANCHES) <= {b for case in CASES.values() for b in case.exercises}


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("name", list(CASES))
def test_matches_autograd_of_the_spec(name, backend):
    case, acc, device = CASES[name], backend.acc, backend.device
    x = _inputs(case, backend, seed(name))
    s = spec(case, x)
    assert not missing_branches(case, x, s), "these inputs do not reach the branches of the case"

    out = _call(backend, x, case.params)
    grad_logp, grad_entropy, stats = out
    n = x.mask.numel()
    assert all(t.dtype == acc and t.device.type == device for t in out)
    assert grad_logp.shape == grad_entropy.shape == (n,) and stats.shape == (n, NUM_STATS)
    close_to_spec(grad_logp, grad_entropy, stats, s, backend.loss_tol)
    # The clip flags exactly as the spec's; masked tokens exactly 0 whatever padding they hold.
    assert torch.equal(stats[:, CLIP_LOW:CLIP_HIGH + 1].cpu().double(), s.stats[:, CLIP_LOW:CLIP_HIGH + 1])
    masked = ~x.mask.reshape(-1).to(device)
    assert (grad_logp[masked] == 0).all() and (grad_entropy[masked] == 0).all() and (stats[masked] == 0).all()

    if not case.adv:
        # A = 0: the loss is the KL and entropy terms alone, w_agg·(β·kl − c_H·H) ...
        p = case.params
        beta = p.kl_coef if p.kl_estimator != KL_NONE else 0.0
        kl, h = stats[:, KL].double().cpu(), stats[:, ENTROPY].double().cpu()
        terms = x.weight.reshape(-1) * (beta * kl - p.entropy_coef * h)
        close("loss without advantages", stats[:, LOSS], terms, backend.loss_tol)
        if case.config.objective != "cispo":  # ... and nothing is clipped (CISPO's flags do not depend on A)
            assert (stats[:, CLIP_LOW:CLIP_HIGH + 1] == 0).all()
    if not case.entropy:
        assert (stats[:, ENTROPY] == 0).all()  # H = 0
    if case.params.entropy_coef != 0:  # −w_agg·c_H, whether H is given or not
        torch.testing.assert_close(grad_entropy.double().cpu(), -x.weight.reshape(-1) * case.params.entropy_coef,
                                   rtol=1e-15 if backend.fp64 else 1e-6, atol=0)


def test_every_table_objective_has_a_case_without_a_hand_written_one():
    """With no hand-written case, the registry gives each objective of the kernels' table a case (but the covariance
    pair, which chooses its tokens over the whole call first): its token preset's, which the CPU kernel evaluates as
    the spec does. `CASES` holds one for every objective, hand-written or derived."""
    per_token = {e.name for e in OBJECTIVES if not objectives.get(e.name).chooses_tokens}
    derived = registry_cases(covered=set())
    assert {case.config.objective for case in derived.values()} == per_token
    assert per_token <= {case.config.objective for case in CASES.values()}
    for name, case in derived.items():
        x = _inputs(case, CPU, seed(name))
        grad_logp, grad_entropy, stats = _call(CPU, x, case.params)
        close_to_spec(grad_logp, grad_entropy, stats, spec(case, x), CPU.loss_tol)


@pytest.mark.parametrize("backend", params())
def test_many_tokens(backend):
    """More tokens than one CPU chunk (4096) and many Triton programs / CUDA blocks; the CPU splits
    them over its threads."""
    case = CASES["clip_asymmetric_delta_dual"]
    shape = (4, 300) if backend is TRITON else (5, 2600)  # triton: 5 programs (the interpreter is slow)
    x = _inputs(case, backend, 11, shape)
    close_to_spec(*_call(backend, x, case.params), spec(case, x), backend.loss_tol)


@pytest.mark.parametrize("backend", params())
def test_masked_tokens_read_nothing(backend):
    """Masked tokens give exact zeros whatever they hold (NaN / ±inf in every input, a nonzero weight),
    and change nothing on the others: bitwise the same outputs as with zero padding."""
    case = make_case(ref=True, dual_clip=2.0, kl_estimator="k3", kl_coef=0.1, kl_bias_correction=True,
                     entropy_coef=0.01)
    x = _inputs(case, backend, 5)
    m = x.mask.reshape(-1).to(backend.device)
    clean = _call(backend, x, case.params, {name: 0.0 for name in PADDING})
    x_pad = dataclasses.replace(x, weight=torch.where(x.mask, x.weight, 2.5))  # outside the contract, not read
    for pad in (PADDING, {name: -v for name, v in PADDING.items()}, {name: math.nan for name in PADDING}):
        out = _call(backend, x_pad, case.params, pad)
        for name, a, b in zip(("grad_logp", "grad_entropy", "stats"), out, clean):
            assert (a[~m] == 0).all(), f"{name}: nonzero on a masked token with padding {pad}"
            assert torch.equal(a[m], b[m]), name


@pytest.mark.parametrize("backend", params())
def test_nan_logp_keeps_its_gradient_nan(backend):
    """An unmasked NaN ℓ (a target outside [0, V) on a GPU) gives a NaN gradient and loss, even where
    a clipped branch would give 0; the other tokens are unaffected."""
    case = make_case(dual_clip=2.0, ref=True, kl_estimator="k3", kl_coef=0.1, kl_clamp=0.2)
    x = _inputs(case, backend, 9)
    clean = _call(backend, x, case.params)
    m = x.mask.reshape(-1)
    nan_at = torch.nonzero(m)[:8, 0]
    x.logp.view(-1)[nan_at] = math.nan
    grad_logp, _, stats = out = _call(backend, x, case.params)
    assert grad_logp[nan_at].isnan().all() and stats[nan_at, LOSS].isnan().all()
    keep = torch.ones_like(m)
    keep[nan_at] = False
    keep = keep.to(backend.device)
    for a, b in zip(out, clean):
        assert torch.equal(a[keep], b[keep])


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_inputs_give_the_spec_nans(name, backend):
    """NaN in old_logp, ref_logp or the advantages of some unmasked tokens: the gradients, the loss and every
    statistic NaN exactly where the spec's are, the other values the spec's."""
    case = NAN_CASES[name]
    for x in with_nan_fields(lambda: _inputs(case, backend, seed(name))):
        close_to_spec(*_call(backend, x, case.params), spec(case, x), backend.loss_tol, nans=True)


@pytest.mark.parametrize("backend", params())
def test_zero_entropy_coef_ignores_entropy(backend):
    """With c_H = 0 the loss has no entropy term (`per_token_loss` skips it): a non-finite H of an
    unmasked token shows in the entropy statistic only."""
    case = make_case(dual_clip=2.0, ref=True, kl_estimator="k1", kl_coef=0.1)
    x = _inputs(case, backend, 13)
    s = spec(case, x)
    bad = torch.nonzero(x.mask.reshape(-1))[:2, 0]
    x.entropy.view(-1)[bad] = torch.tensor([math.nan, math.inf], dtype=torch.float64)
    grad_logp, grad_entropy, stats = _call(backend, x, case.params)
    close("grad_logp", grad_logp, s.grad_logp, backend.loss_tol)
    close("stats[:, 0] (loss)", stats[:, LOSS], s.stats[:, LOSS], backend.loss_tol)
    assert (grad_entropy == 0).all()
    assert stats[bad[0], ENTROPY].isnan() and stats[bad[1], ENTROPY] == math.inf


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("optional", [True, False], ids=["with_optionals", "without_optionals"])
def test_no_tokens(backend, optional):
    acc, device = backend.acc, backend.device
    empty = torch.empty(0, dtype=acc, device=device)
    opt = empty if optional else None
    p = token_loss_params(PolicyLossConfig(kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01))
    out = backend.kernels.policy_token_loss(empty, opt, torch.empty(0, dtype=torch.bool, device=device), empty, opt,
                                            opt, opt, p)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, NUM_STATS)]
    assert all(t.dtype == acc and t.device.type == device for t in out)


# --------------------------------------------------------------------------------------------
# Argument errors: each backend's own checks.


def _valid_args(n=4, acc=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    r = lambda: torch.randn(n, generator=gen, dtype=torch.float64).to(acc).to(device)  # noqa: E731
    return dict(logp=r() - 3, entropy=r().abs(), mask=torch.ones(n, dtype=torch.bool, device=device),
                weight=r().abs(), adv=r(), old_logp=r() - 3, ref_logp=r() - 3)


_PARAMS = token_loss_params(PolicyLossConfig(delta=3.0, dual_clip=3.0, kl_estimator="k3", kl_coef=0.1, kl_clamp=1.0,
                                             entropy_coef=0.01))


def _call_args(kernels, args, **params):
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


@pytest.mark.parametrize("backend", params([CPU]))
def test_cpu_bad_tensors_name_the_argument(backend):
    a = _valid_args()
    _call_args(cpu, a)  # valid as they are
    for name, error, change in _bad_tensors(a):
        with pytest.raises(error, match=_names(name)):
            _call_args(cpu, {**a, **change})
    # fp64 log-probs take fp64 per-token inputs: fp32 ones are refused, not converted.
    a64 = _valid_args(acc=torch.float64)
    _call_args(cpu, a64)
    for name in ("entropy", "weight", "adv", "old_logp", "ref_logp"):
        with pytest.raises(TypeError, match=_names(name) + ".*Double"):
            _call_args(cpu, {**a64, name: a64[name].float()})


@pytest.mark.parametrize("backend", params([CPU]))
@pytest.mark.parametrize("n", [4, 0])
def test_cpu_bad_scalars_name_the_argument(backend, n):
    """Refused on every batch, the empty one too."""
    a = _valid_args(n)
    for name, change in BAD_LOSS_SCALARS:
        with pytest.raises(ValueError, match=_names(name)):
            _call_args(cpu, a, **change)


@pytest.mark.parametrize("backend", params([TRITON]))
def test_triton_bad_tensors_name_the_argument(backend):
    a = _valid_args(device=backend.device)
    cases = [
        ("logp", dict(logp=a["logp"].double())),
        ("logp", dict(logp=a["logp"][None])),
        ("mask", dict(mask=a["mask"][:3])),
        ("weight", dict(weight=a["weight"][:3])),
        ("entropy", dict(entropy=a["entropy"][None])),
        ("adv", dict(adv=a["adv"][:1])),
        ("old_logp", dict(old_logp=a["old_logp"][:3])),
        ("ref_logp", dict(ref_logp=torch.zeros(5, device=backend.device))),
    ]
    for name, change in cases:
        with pytest.raises((RuntimeError, ValueError, TypeError), match=_names(name)):
            _call_args(backend.kernels, {**a, **change})


@pytest.mark.parametrize("backend", params([CUDA]))
def test_cuda_bad_tensors_and_devices_name_the_argument(backend):
    a = _valid_args(device="cuda")
    _call_args(cuda, a)
    for name, error, change in _bad_tensors(a):
        with pytest.raises(error, match=_names(name)):
            _call_args(cuda, {**a, **change})
    for name in ("entropy", "mask", "weight", "adv", "old_logp", "ref_logp"):
        with pytest.raises(ValueError, match=_names(name) + ": expected a tensor on cuda"):
            _call_args(cuda, {**a, name: a[name].cpu()})
    # CPU log-probs with CUDA inputs go to the CUDA implementation, which names them.
    with pytest.raises(ValueError, match=_names("logp")):
        _call_args(cuda, {**a, "logp": a["logp"].cpu()})


# --- exact bounds, against reference.py ------------------------------------------------------------------------------

def _reference_at_bounds(name, dtype):
    """(config, inputs, loss, ∂loss/∂ℓ, clip fractions) of reference.py at BOUNDARY_CASES[name], in `dtype`."""
    config, logp, old, adv, mask = boundary_inputs(BOUNDARY_CASES[name], dtype)
    lp = logp.clone().requires_grad_()
    loss, metrics = reference.policy_loss(lp, adv, mask, config, old_logp=old)
    (grad,) = torch.autograd.grad(loss, lp)
    return config, (logp, old, adv, mask), loss, grad, (metrics["clip_frac_low"], metrics["clip_frac_high"])


_BOUND_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.float64: dict(rtol=1e-13, atol=1e-15)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(BOUNDARY_CASES))
def test_spec_at_exact_bounds_matches_the_reference(name, dtype):
    """The torch backend's loss (policy_loss of losses/, the generated token_formulas) on the bounds: its value,
    autograd's gradient and the clip fractions as reference.py's."""
    config, (logp, old, adv, mask), loss, grad, fracs = _reference_at_bounds(name, dtype)
    lp = logp.clone().requires_grad_()
    out = policy_loss(lp, adv, mask, config, old_logp=old)
    (g,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(out.loss, loss, **_BOUND_TOL[dtype])
    torch.testing.assert_close(g, grad, **_BOUND_TOL[dtype])
    assert (out.metrics["clip_frac_low"].item(), out.metrics["clip_frac_high"].item()) == tuple(f.item() for f in fracs)


@pytest.mark.parametrize("backend", params())
@pytest.mark.parametrize("name", list(BOUNDARY_CASES))
def test_kernels_at_exact_bounds_match_the_reference(name, backend):
    """policy_token_loss on the bounds (w exactly 1 − ε_low, 1 + ε_high, δ, the dual clip; ℓ − ℓ_old exactly ±c):
    the loss, the gradient and the flags of each token as reference.py's in the op's dtype. The kernels' derivative
    is generated (kernels/derive_token_loss.py): a clamp's interval open where it is closed, or a tie of min / max
    given wholly to one side, fails here."""
    acc, device = backend.acc, backend.device
    config, (logp, old, adv, mask), loss, grad, fracs = _reference_at_bounds(name, acc)
    n = mask.numel()
    flat = lambda x: x.reshape(-1).to(device)  # noqa: E731
    weight = torch.full((n,), 1.0 / n, dtype=acc, device=device)
    grad_logp, _, stats = backend.kernels.policy_token_loss(flat(logp), None, flat(mask), weight, flat(adv),
                                                            flat(old), None, token_loss_params(config))
    w = torch.exp(torch.clamp(logp - old, -config.log_ratio_clamp, config.log_ratio_clamp)).reshape(-1)
    if not torch.equal(stats[:, RATIO].cpu(), w):  # a GPU's exp may round e^r to a neighbour of the bound
        assert device == "cuda", f"{backend.name}: the op's w is not torch's e^r"
        pytest.skip(f"{backend.name}: its e^r is not torch's, the bound not met")
    torch.testing.assert_close(stats[:, LOSS].sum().cpu(), loss, **_BOUND_TOL[acc])
    torch.testing.assert_close(grad_logp.cpu(), grad.reshape(-1), **_BOUND_TOL[acc])
    assert tuple(stats[:, col].double().mean().item() for col in (CLIP_LOW, CLIP_HIGH)) == \
        tuple(f.item() for f in fracs)
