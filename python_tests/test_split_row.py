"""The Triton two-pass row (kernels/triton/split_row.py, docs/design.md §7): `policy_token_fwd_grad` with each row
split over several programs. Under the interpreter (no GPU) its phases run as two launches through the same jitted
code; the one-launch wait is the protocol of split_row_protocol.py (test_split_row_protocol.py) and a GPU
check. Against the three-pass Triton composition (policy_token_fwd, then token_logprobs_bwd at the token's
derivatives times the scale) on the cases of token_loss_cases.py, and through `fused_policy_loss` against
`two_pass=False` and the fp64 reference on every preset the forward kernel evaluates: fresh random inputs, V odd and
not a multiple of the chunk, −inf and NaN rows, masked and empty rows, τ ≠ 1, a soft cap, fp32/bf16/fp16, into a new
buffer, a parent's box and the logits themselves. The values are not the composition's bits: the row's (m, s, u)
is merged from K chunks instead of from one program's lanes, so ℓ, H and p_v differ in their last fp32 bits."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.losses import PolicyLossConfig
from rlkernels.ops._plan import Step, plan
from rlkernels.ops.kernel_params import token_loss_params
from token_loss_cases import BY_NAME, CASES, NAN_CASES, draw_inputs, fwd_cases, seed, token_args, with_edge_rows, with_nan_fields
from loss_inputs import preset, preset_case

TRITON = BY_NAME["triton"]
pytestmark = pytest.mark.skipif(not TRITON.available[0], reason=TRITON.available[1])
if TRITON.available[0]:
    from rlkernels.kernels import triton as tk
    from rlkernels.kernels.triton import split_row
    from rlkernels.kernels.triton.split_row import split_plan

DEVICE = TRITON.device
INTERPRETED = DEVICE == "cpu"
# V odd, several chunks, the last one partial, at every alignment: under the interpreter 2 chunks of 128, on a GPU
# 3 of 8192 fp32 logits
SHAPE = (2, 3, 203 if INTERPRETED else 20011)
# ℓ, H and the statistics: fp32 roundings of a different merge order
VALUE_TOL = (1e-5, 1e-6)
# ∂logits: a few fp32 ulp of p_v, then one rounding in the dtype (fp16: a step of its subnormals)
GRAD_TOL = {torch.float32: (1e-5, 1e-7), torch.bfloat16: (2 ** -7, 1e-9), torch.float16: (2 ** -10, 2 ** -24)}


def _same(name, actual, expected, tol):
    torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1], equal_nan=True,
                               msg=lambda m: f"{name}: {m}")


def _args(case, x):
    a = token_args(x, torch.float32, DEVICE, names=("adv", "old", "ref"))
    adv = a["adv"] if a["adv"] is not None else torch.zeros(x.mask.numel(), device=DEVICE)
    return [x.targets.to(DEVICE), x.mask.reshape(-1).to(DEVICE), x.weight.reshape(-1).float().to(DEVICE), adv,
            a["old"], a["ref"], None]


def _check(case, x, scale, entropy_grad=None, softcap=0.0, out=None, dtype=None):
    """The split row against policy_token_fwd then token_logprobs_bwd (logits in `dtype`, else the case's)."""
    args = _args(case, x)
    logits = x.logits.to(DEVICE, dtype or x.logits.dtype)
    if entropy_grad is not None:
        entropy_grad = entropy_grad.to(DEVICE)
    logp, entropy, lse, g, h, stats = tk.policy_token_fwd(logits, *args, case.temperature, case.params,
                                                          softcap=softcap)
    if entropy_grad is not None:
        h = entropy_grad
    elif case.params.entropy_coef == 0:
        h = None
    expected = tk.token_logprobs_bwd(logits, args[0], lse, entropy, g * scale, None if h is None else h * scale,
                                     case.temperature, softcap=softcap)
    into = logits.clone() if out == "logits" else out
    got = tk.policy_token_fwd_grad(into if out == "logits" else logits, *args, entropy_grad, case.temperature,
                                   case.params, scale, out=into, softcap=softcap)
    if out is not None:
        assert got[3] is into
    for name, a, b in zip(("logp", "entropy", "stats"), got[:3], (logp, entropy, stats)):
        _same(name, a, b, VALUE_TOL)
    _same("grad", got[3], expected, GRAD_TOL[logits.dtype])
    return got[3]


def test_rows_take_several_chunks_and_a_partial_one():
    """What the cases below rely on, and a 152k row on a GPU in chunks of at most 40 KB."""
    block, _, chunk, chunks = split_plan(SHAPE[2], torch.float32)
    assert chunks >= 2 and SHAPE[2] % chunk and chunk % block == 0
    for dtype in (torch.float32, torch.bfloat16):
        block, _, chunk, chunks = split_plan(151936, dtype, interpret=False)
        assert chunk * dtype.itemsize <= 40 * 1024 and chunk % block == 0
        lead = 16 // dtype.itemsize - 1
        assert (chunks - 1) * chunk < 151936 <= chunks * chunk - lead  # every alignment covered, no empty chunk


FAST = ["all_terms_t0_8"]  # the interpreter takes ~3 s a check: every other case is `exhaustive` (conftest.py)


def _fast(names):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.exhaustive) for n in names]


@pytest.mark.parametrize("name", _fast(fwd_cases()))
def test_equals_forward_then_backward(name):
    case = CASES[name]
    x = draw_inputs(case, torch.float32, seed(name), SHAPE)
    _check(case, x, 0.375)  # a caller's gradient accumulation: the scale goes in before rounding
    edges = dataclasses.replace(x, logits=with_edge_rows(x.logits))
    grad = _check(case, edges, 1.0, softcap=7.5)
    assert grad[2].isnan().all() and grad[1].isnan().all()  # the NaN row and the all −inf one


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_inputs(name):
    case = NAN_CASES[name]
    for x in with_nan_fields(lambda: draw_inputs(case, torch.float32, seed(name), SHAPE)):
        _check(case, x, 2.0)


def test_fast_cases_exist():
    assert set(FAST) <= set(fwd_cases())


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_16_bit_logits_entropy_bonus_and_over_the_logits(dtype):
    """16-bit logits (8 per 16 bytes: other alignments), ∂/∂H from `entropy_grad`, the gradient over the logits."""
    case = CASES[FAST[0]]
    x = draw_inputs(case, torch.float32, 11, SHAPE)
    bonus = torch.where(x.mask.reshape(-1), -0.05 / x.mask.sum(), 0.0).float()
    _check(case, x, 1.0, entropy_grad=bonus, dtype=dtype, out="logits")


def test_into_a_box(monkeypatch):
    """`out`: the rows of a parent-shaped buffer (the gradient of `parent[:, :-1]`); a view of logits too. In chunks
    of 32: rows of 7 chunks, 5 in the middle of their row."""
    monkeypatch.setattr(split_row, "_INTERPRET_BLOCK_V", 32)
    assert not INTERPRETED or split_plan(SHAPE[2], torch.float32)[3] == 7
    case = CASES[FAST[0]]
    x = draw_inputs(case, torch.float32, 5, SHAPE)
    n, vocab = x.logits.shape
    parent = torch.randn(2, n // 2 + 1, vocab + 1, device=DEVICE)  # rows vocab + 1 apart: each at another alignment
    parent[:, :-1, 1:] = x.logits.view(2, n // 2, vocab).to(DEVICE)
    sliced = dataclasses.replace(x, logits=parent[:, :-1, 1:])
    box = torch.full_like(parent, 7.0)
    _check(case, sliced, 1.0, out=box[:, :-1, :-1])  # out at another alignment than the logits: element-wise
    assert (box[:, -1] == 7.0).all() and (box[..., -1] == 7.0).all()  # nothing outside the box is written


def test_no_tokens_and_all_masked():
    empty = torch.empty(0, device=DEVICE)
    params = token_loss_params(PolicyLossConfig(entropy_coef=0.01))
    out = tk.policy_token_fwd_grad(torch.zeros(0, 7, device=DEVICE), torch.zeros(0, dtype=torch.long, device=DEVICE),
                                   torch.zeros(0, dtype=torch.bool, device=DEVICE), empty, empty, None, None, None,
                                   None, 1.0, params, 1.0)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, 7), (0, 7)]
    case = CASES[FAST[0]]
    x = draw_inputs(case, torch.float32, 3, SHAPE)
    x.mask[:] = False
    x.weight[:] = 0.0
    _, _, stats, grad = tk.policy_token_fwd_grad(x.logits.to(DEVICE), *_args(case, x), None, case.temperature,
                                                 case.params, 1.0)
    assert (stats[:, :-1] == 0).all() and (grad == 0).all()


def test_bad_arguments_name_themselves():
    case = CASES[FAST[0]]
    x = draw_inputs(case, torch.float32, 1, SHAPE)
    x.logits = x.logits.to(DEVICE)
    for scale in (math.inf, 0.0, math.nan):
        with pytest.raises(ValueError, match="scale"):
            tk.policy_token_fwd_grad(x.logits, *_args(case, x), None, 1.0, case.params, scale)
    with pytest.raises(ValueError, match="entropy_grad"):
        tk.policy_token_fwd_grad(x.logits, *_args(case, x), torch.zeros(3, device=DEVICE), 1.0, case.params, 1.0)
    with pytest.raises(ValueError, match="out"):
        tk.policy_token_fwd_grad(x.logits, *_args(case, x), None, 1.0, case.params, 1.0, out=x.logits[:, :5])
    with pytest.raises(ValueError, match="out"):
        tk.policy_token_fwd_grad(x.logits, *_args(case, x), None, 1.0, case.params, 1.0, out=x.logits.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_grad(dtype):
    """Nothing changes when the incoming gradient is the assumed one (rounded to fp32); any other multiplies by
    incoming / assumed in fp32, every element including a tail past the last whole block."""
    grad = torch.randn(3, 1001, device=DEVICE).to(dtype)
    kept = grad.clone()
    tk.scale_grad_(grad, torch.tensor(0.1, device=DEVICE), 0.1)
    assert torch.equal(grad, kept)
    tk.scale_grad_(grad, torch.tensor(0.3, device=DEVICE), 0.1)
    ratio = torch.tensor(torch.tensor(0.3).double().item() / 0.1, dtype=torch.float32)
    # one bf16 step: the interpreter's fp32 → bf16 conversion truncates, a GPU's rounds to nearest
    tol = 2 ** -7 if dtype == torch.bfloat16 and INTERPRETED else 0.0
    torch.testing.assert_close(grad, (kept.float() * ratio.to(DEVICE)).to(dtype), rtol=tol, atol=0)
    with pytest.raises(ValueError, match="assumed"):
        tk.scale_grad_(grad, torch.tensor(1.0), 0.0)
    with pytest.raises(ValueError, match="grad: expected a contiguous"):
        tk.scale_grad_(torch.zeros(4, 4).t(), torch.tensor(2.0), 1.0)
    with pytest.raises(ValueError, match="grad_out"):
        tk.scale_grad_(grad, torch.ones(2), 1.0)


# --- through fused_policy_loss ---------------------------------------------------------------------------------

B, T, V = 3, 4, SHAPE[2]
FORWARD_PRESETS = [n for n in presets.NAMES if TRITON.available[0] and plan(preset(n), tk).step is Step.FORWARD]
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)


def _case(name, dtype, seed):
    return preset_case(name, B, T, V, dtype, seed, DEVICE)


def _run(config, logits, targets, adv, mask, kw, softcap, two_pass, incoming=1.0):
    x = logits.clone().requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.7, softcap=softcap,
                                      backend="triton", two_pass=two_pass, **kw)
    (out.loss * incoming).backward()
    return out, x.grad


def _presets(*sample):
    """The presets of `sample` in every run, the others `exhaustive` (conftest.py)."""
    return [n if n in sample else pytest.param(n, marks=pytest.mark.exhaustive) for n in FORWARD_PRESETS]


@pytest.mark.parametrize("softcap", [9.0, pytest.param(None, marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("name", _presets("grpo", "dapo"))
def test_every_forward_preset_matches_three_passes_and_the_reference(name, softcap):
    config, logits, targets, adv, mask, kw = _case(name, torch.float32, seed=len(name))
    two, grad2 = _run(config, logits, targets, adv, mask, kw, softcap, True)
    three, grad3 = _run(config, logits, targets, adv, mask, kw, softcap, False)
    torch.testing.assert_close(two.loss, three.loss, **LOSS_TOL)
    _same("grad", grad2, grad3, GRAD_TOL[torch.float32])
    for key in three.metrics:
        torch.testing.assert_close(two.metrics[key], three.metrics[key], equal_nan=True, msg=key, **LOSS_TOL)

    z = logits.cpu().double().requires_grad_(True)
    capped = softcap * torch.tanh(z / softcap) if softcap else z
    logp, ent = reference.token_logprobs(capped, targets.cpu(), 0.7)
    loss, _ = reference.policy_loss(logp, adv.cpu().double(), mask.cpu(), config, entropy=ent,
                                    **{k: v.cpu().double() for k, v in kw.items()})
    loss.backward()
    grad2 = grad2.cpu()
    torch.testing.assert_close(two.loss.cpu().double(), loss, rtol=1e-5, atol=1e-6)
    # The all −inf row is NaN on every backend (docs/design.md §2), where the reference's masked row has 0.
    assert grad2[1, 2].isnan().all()
    grad2[1, 2] = z.grad[1, 2]
    assert torch.equal(grad2.isnan(), z.grad.isnan())
    torch.testing.assert_close(grad2.double().nan_to_num(0.0), z.grad.nan_to_num(0.0), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_through_fused_policy_loss_with_a_scaled_incoming_gradient(dtype):
    """An incoming gradient 1/4 of the assumed one: bf16 rescales by a power of two (exact), fp16 refuses."""
    config, logits, targets, adv, mask, kw = _case("grpo", dtype, seed=3)
    _, expected = _run(config, logits, targets, adv, mask, kw, None, False, incoming=0.25)
    if dtype == torch.float16:
        with pytest.raises(RuntimeError, match="grad_scale"):
            _run(config, logits, targets, adv, mask, kw, None, True, incoming=0.25)
        return
    _, got = _run(config, logits, targets, adv, mask, kw, None, True, incoming=0.25)
    assert torch.equal(got.isnan(), expected.isnan())
    _same("grad", got.nan_to_num(0.0), expected.nan_to_num(0.0), GRAD_TOL[dtype])


def test_the_default_stays_three_passes_on_triton():
    """Opt-in until a device run shows the split row faster (TWO_PASS_BY_DEFAULT)."""
    from rlkernels.ops.fused_policy_loss import TWO_PASS_BY_DEFAULT
    assert "triton" not in TWO_PASS_BY_DEFAULT


@pytest.mark.slow
def test_inplace_writes_the_gradient_over_the_logits_in_the_forward():
    """`two_pass=True, inplace=True`: the logits hold the three-pass gradient when the call returns."""
    config, logits, targets, adv, mask, kw = _case("grpo", torch.float32, seed=4)
    _, expected = _run(config, logits, targets, adv, mask, kw, None, False)
    buffer = logits.clone()
    x = buffer.view_as(buffer).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.7, backend="triton",
                                      two_pass=True, inplace=True, **kw)
    assert torch.equal(buffer.isnan(), expected.isnan())
    _same("in place", buffer.nan_to_num(0.0), expected.nan_to_num(0.0), GRAD_TOL[torch.float32])
    out.loss.backward()
    assert x.grad.data_ptr() == buffer.data_ptr()
