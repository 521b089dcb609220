"""`policy_token_fwd_grad` (the two-pass row, docs/design.md §2) and `scale_grad_`, on the backends that have them.

The op is `policy_token_fwd` plus `token_logprobs_bwd` at the token's derivatives times `scale`, from one read of
each row. Both of those are checked against the fp64 spec and autograd (test_policy_token_fwd.py,
test_kernel_contract.py); here the two-pass op must give that composition's values on every case of
token_loss_cases.py (every objective and KL term, NaN inputs, all-masked and empty batches), on logits with −inf
entries, an all −inf row, a NaN row, a soft cap and τ ≠ 1, written into a new buffer, into a parent's box, and over
the logits: ℓ, H and the statistics bit for bit; the gradient bit for bit where the row takes the per-element
formula (a cap, a leading −inf block), else with p_v from the forward's kept e^d, within a few ulp of p.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from token_loss_cases import CASES, NAN_CASES, BY_NAME, draw_inputs, fwd_cases, seed, token_args, with_edge_rows, with_nan_fields
from rlkernels.kernels.token_loss_params import NUM_STATS
from rlkernels.losses import PolicyLossConfig
from rlkernels.ops.kernel_params import token_loss_params

TWO_PASS = [b.param() for b in (BY_NAME["cpu"], BY_NAME["cpu-fp64"])]


def _same(name, actual, expected, tol=(0.0, 0.0)):
    torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1], equal_nan=True, msg=lambda m: f"{name}: {m}")


# p from the kept e^d against exp(d − log s): exp_u20's ≤ 20 ulp twice in fp32, then a last rounding in the dtype
# (fp16: one step of its subnormals)
P_TOL = {torch.float32: (1e-5, 0.0), torch.float64: (1e-13, 0.0), torch.bfloat16: (2 ** -7, 0.0),
         torch.float16: (2 ** -10, 2 ** -24)}


def _args(backend, case, x):
    a = token_args(x, backend.acc, backend.device, names=("adv", "old", "ref"))
    n = x.mask.numel()
    adv = a["adv"] if a["adv"] is not None else torch.zeros(n, dtype=backend.acc)
    return [x.targets, x.mask.reshape(-1), x.weight.reshape(-1).to(backend.acc), adv, a["old"], a["ref"], None]


def _check(backend, case, x, scale, entropy_grad=None, softcap=0.0, out=None):
    """The two-pass op against policy_token_fwd then token_logprobs_bwd, bit for bit."""
    k, args = backend.kernels, _args(backend, case, x)
    logits = x.logits if out is None or out is not x.logits else x.logits.clone()
    logp, entropy, lse, g, h, stats = k.policy_token_fwd(logits, *args, case.temperature, case.params, softcap=softcap)
    if entropy_grad is not None:
        h = entropy_grad
    elif case.params.entropy_coef == 0:
        h = None
    expected = k.token_logprobs_bwd(logits, x.targets, lse, entropy, g * scale, None if h is None else h * scale,
                                    case.temperature, softcap=softcap)
    got = k.policy_token_fwd_grad(x.logits, *args, entropy_grad, case.temperature, case.params, scale, out=out,
                                  softcap=softcap)
    assert len(got) == 4 and got[2].shape == (x.mask.numel(), NUM_STATS)
    for name, a, b in zip(("logp", "entropy", "stats"), got[:3], (logp, entropy, stats)):
        _same(name, a, b)
    _same("grad", got[3], expected, (0.0, 0.0) if softcap else P_TOL[logits.dtype])
    return got[3]


@pytest.mark.parametrize("backend", TWO_PASS)
@pytest.mark.parametrize("name", fwd_cases())
def test_equals_forward_then_backward(name, backend):
    case = CASES[name]
    x = draw_inputs(case, backend.acc, seed(name), backend.fwd_shape)
    _check(backend, case, x, 1.0)
    _check(backend, case, x, 0.375)  # a caller's gradient accumulation: the scale goes in before rounding
    edges = dataclasses.replace(x, logits=with_edge_rows(x.logits))
    grad = _check(backend, case, edges, 1.0, softcap=7.5)
    assert grad[2].isnan().all()  # the NaN row


@pytest.mark.parametrize("backend", TWO_PASS)
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_inputs(name, backend):
    case = NAN_CASES[name]
    for x in with_nan_fields(lambda: draw_inputs(case, backend.acc, seed(name), backend.fwd_shape)):
        _check(backend, case, x, 2.0)


@pytest.mark.parametrize("backend", TWO_PASS)
def test_entropy_grad_replaces_the_tokens_own(backend):
    """An entropy bonus outside the token's loss (`entropy_agg="token_mean"`): ∂/∂H comes from `entropy_grad`."""
    case = CASES[fwd_cases()[0]]
    x = draw_inputs(case, backend.acc, 11, backend.fwd_shape)
    bonus = torch.where(x.mask.reshape(-1), -0.05 / x.mask.sum(), 0.0).to(backend.acc)
    _check(backend, case, x, 1.0, entropy_grad=bonus)


@pytest.mark.parametrize("backend", TWO_PASS)
def test_into_a_box_and_over_the_logits(backend):
    """`out`: the rows of a parent-shaped buffer (the gradient of `parent[:, :-1]`), and the logits themselves."""
    case = CASES["grpo"] if "grpo" in CASES else CASES[fwd_cases()[0]]
    x = draw_inputs(case, backend.acc, 5, backend.fwd_shape)
    n, vocab = x.logits.shape
    parent = torch.randn(4, n // 4 + 1, vocab, dtype=x.logits.dtype)
    parent[:, :-1] = x.logits.view(4, n // 4, vocab)
    view = parent[:, :-1]
    box = torch.full_like(parent, 7.0)
    sliced = dataclasses.replace(x, logits=view)
    expected = _check(backend, case, sliced, 1.0)
    _check(backend, case, sliced, 1.0, out=box[:, :-1])
    assert (box[:, -1] == 7.0).all()  # nothing outside the box is written
    over = x.logits.clone()
    got = backend.kernels.policy_token_fwd_grad(over, *_args(backend, case, x), None, case.temperature, case.params,
                                                1.0, out=over)
    assert got[3] is over
    _same("in place", over, expected.reshape(n, vocab), P_TOL[over.dtype])


@pytest.mark.parametrize("backend", TWO_PASS)
def test_no_tokens(backend):
    acc = backend.acc
    empty = torch.empty(0, dtype=acc)
    out = backend.kernels.policy_token_fwd_grad(torch.zeros(0, 7, dtype=acc), torch.zeros(0, dtype=torch.long),
                                                torch.zeros(0, dtype=torch.bool), empty, empty, None, None, None, None,
                                                1.0, token_loss_params(PolicyLossConfig(entropy_coef=0.01)), 1.0)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, NUM_STATS), (0, 7)]


@pytest.mark.parametrize("backend", TWO_PASS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scale_grad(backend, dtype):
    """Nothing changes when the incoming gradient is the assumed one (rounded to its dtype); any other
    multiplies by incoming / assumed in the accumulation precision, every element including a tail."""
    grad = torch.randn(3, 1001, dtype=dtype)
    kept = grad.clone()
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    backend.kernels.scale_grad_(grad, torch.tensor(0.1, dtype=loss_dtype), 0.1)
    assert torch.equal(grad, kept)
    backend.kernels.scale_grad_(grad, torch.tensor(0.3, dtype=loss_dtype), 0.1)
    ratio = torch.tensor(0.3, dtype=loss_dtype).double().item() / 0.1
    expected = (kept.to(loss_dtype) * torch.tensor(ratio, dtype=loss_dtype)).to(dtype)
    _same("scaled", grad, expected)


@pytest.mark.parametrize("backend", TWO_PASS)
def test_bad_arguments_name_themselves(backend):
    k = backend.kernels
    with pytest.raises(ValueError, match="assumed"):
        k.scale_grad_(torch.zeros(4), torch.tensor(1.0), 0.0)
    with pytest.raises(ValueError, match="grad: expected a contiguous"):
        k.scale_grad_(torch.zeros(4, 4).t(), torch.tensor(2.0), 1.0)
    with pytest.raises(ValueError, match="grad_out"):
        k.scale_grad_(torch.zeros(4), torch.ones(2), 1.0)
    case = CASES[fwd_cases()[0]]
    x = draw_inputs(case, backend.acc, 1, backend.fwd_shape)
    with pytest.raises(ValueError, match="scale"):
        k.policy_token_fwd_grad(x.logits, *_args(backend, case, x), None, 1.0, case.params, math.inf)
    with pytest.raises(ValueError, match="entropy_grad"):
        k.policy_token_fwd_grad(x.logits, *_args(backend, case, x), torch.zeros(3, dtype=backend.acc), 1.0,
                                case.params, 1.0)
    with pytest.raises(ValueError, match="out"):
        k.policy_token_fwd_grad(x.logits, *_args(backend, case, x), None, 1.0, case.params, 1.0,
                                out=x.logits[:, :5])
