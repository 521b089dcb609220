"""Triton kernels against rlkernels.reference (docs/design.md §2, §9).

Without CUDA the kernels run on CPU tensors in the Triton interpreter, which is slow, so those
shapes are tiny. The interpreter computes with numpy: RuntimeWarnings are errors here, so an
intermediate 0·(-inf) or (-inf) − (-inf) fails a test even where a `tl.where` would hide the
NaN it makes. The `gpu` tests repeat the checks at real sizes.
"""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: @triton.jit picks the interpreter at decoration.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from rlkernels.kernels import triton as tk  # noqa: E402
from rlkernels.kernels.triton import (  # noqa: E402
    launch_config, token_logprobs_bwd, token_logprobs_fwd,
)
from rlkernels.reference import token_logprobs as ref_token_logprobs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

ON_CPU = not torch.cuda.is_available()
if ON_CPU and not tk.token_logprobs.INTERPRET:
    pytest.skip("rlkernels.kernels.triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)
DEVICE = "cpu" if ON_CPU else "cuda"
gpu = pytest.mark.skipif(ON_CPU, reason="needs a CUDA device")

# docs/design.md §9: relative error on log-probs and gradients vs the reference on the same values.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3}
# One unit in the last place, relative: the rounding of a gradient stored in this dtype.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

# V: 1 (a one-token vocabulary), 7 (one partial tile), 1000 (two interpreter tiles, partial
# last), 4099 (just above the largest single GPU tile, 4096; 9 interpreter tiles).
SMALL_V = [1, 7, 1000, 4099]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Each dtype with temperature ≠ 1, and fp32 also at 1 (the interpreter is slow: not a full grid).
DTYPE_TEMPERATURE = pytest.mark.parametrize(
    "dtype,temperature",
    [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7), (torch.float16, 1.3)],
    ids=["fp32-t1", "fp32-t0.7", "bf16-t0.7", "fp16-t1.3"],
)
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get


def make_inputs(n, vocab, dtype, device=DEVICE, scale=3.0):
    logits = (torch.randn(n, vocab, device=device) * scale).to(dtype)
    targets = torch.randint(0, vocab, (n,), device=device)
    targets[0] = 0
    targets[-1] = vocab - 1
    return logits, targets


def reference(logits, targets, temperature, grad_logp=None, grad_entropy=None):
    """(logp, entropy, grad_logits) of the reference in fp64 on the same values upcast."""
    z = logits.detach().double().requires_grad_(grad_logp is not None)
    logp, entropy = ref_token_logprobs(z, targets, temperature)
    if grad_logp is None:
        return logp, entropy, None
    loss = (logp * grad_logp.double()).sum()
    if grad_entropy is not None:
        loss = loss + (entropy * grad_entropy.double()).sum()
    (grad,) = torch.autograd.grad(loss, z)
    return logp.detach(), entropy.detach(), grad


def safe_reference(logits, targets, temperature, grad_logp, grad_entropy):
    """fp64 truth for rows with -inf logits, where p·log p must be read as 0 (the reference's
    entropy is NaN there)."""
    z = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros((), dtype=z.dtype))).sum(-1)
    loss = (logp * grad_logp.double() + entropy * grad_entropy.double()).sum()
    (grad,) = torch.autograd.grad(loss, z)
    return logp.detach(), entropy.detach(), grad


def assert_close_rel(actual, expected, tol):
    """Relative error ≤ tol, measured against max(|expected|, 1) for log-domain values."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def assert_grad_close(actual, expected, tol):
    """Elementwise relative error ≤ tol, with entries far below the largest one (p_v/τ for a
    tail token) held to tol times the largest."""
    atol = tol * expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=atol)


def assert_rounded(grad, grad32):
    """``grad`` is ``grad32`` rounded to grad's dtype, within one ulp (the interpreter
    truncates fp32 → bf16 where CUDA rounds to nearest even)."""
    expected = grad32.to(grad.dtype).double()
    torch.testing.assert_close(grad.double(), expected, rtol=ULP[grad.dtype], atol=2.0**-24)


def run_bwd_fp32(logits, targets, lse_parts, entropy, g, h, temperature):
    """The kernel's gradient before rounding to the logits' dtype (written into fp32)."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, temperature, out=out)


@pytest.mark.parametrize("vocab", SMALL_V, ids=lambda v: f"V{v}")
@DTYPE_TEMPERATURE
def test_forward_matches_reference(vocab, dtype, temperature):
    logits, targets = make_inputs(3, vocab, dtype)
    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, temperature, True)
    ref_logp, ref_entropy, _ = reference(logits, targets, temperature)
    assert logp.dtype == entropy.dtype == lse_parts.dtype == torch.float32 and lse_parts.shape == (3, 2)
    assert_close_rel(logp, ref_logp, TOL[dtype])
    assert_close_rel(entropy, ref_entropy, TOL[dtype])
    x = logits.double() / temperature
    m = x.amax(-1)
    assert_close_rel(lse_parts[:, 0], m, TOL[dtype])
    assert_close_rel(lse_parts[:, 1], (x - m[:, None]).exp().sum(-1).log(), TOL[dtype])
    assert (logp <= 0).all() and (entropy >= 0).all() and (lse_parts[:, 1] >= 0).all()


@pytest.mark.parametrize("vocab", SMALL_V, ids=lambda v: f"V{v}")
@DTYPE_TEMPERATURE
def test_backward_matches_autograd(vocab, dtype, temperature):
    logits, targets = make_inputs(3, vocab, dtype)
    g, h = torch.randn(3, device=DEVICE), torch.randn(3, device=DEVICE)
    _, entropy, lse_parts = token_logprobs_fwd(logits, targets, temperature, True)
    _, _, ref_grad = reference(logits, targets, temperature, g, h)

    grad32 = run_bwd_fp32(logits, targets, lse_parts, entropy, g, h, temperature)
    assert_grad_close(grad32, ref_grad, TOL[dtype])
    grad = token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, temperature)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert_rounded(grad, grad32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
def test_without_entropy(dtype):
    logits, targets = make_inputs(3, 1000, dtype)
    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, 0.7, False)
    assert entropy.numel() == 0
    logp_h, _, lse_parts_h = token_logprobs_fwd(logits, targets, 0.7, True)
    torch.testing.assert_close(logp, logp_h, rtol=0, atol=0)
    torch.testing.assert_close(lse_parts, lse_parts_h, rtol=0, atol=0)
    # grad_entropy=None: the entropy term is absent and `entropy` is not read.
    g = torch.randn(3, device=DEVICE)
    _, _, ref_grad = reference(logits, targets, 0.7, g)
    grad32 = run_bwd_fp32(logits, targets, lse_parts, entropy, g, None, 0.7)
    assert_grad_close(grad32, ref_grad, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
def test_minus_inf_logits(dtype):
    vocab = 1000
    logits, targets = make_inputs(4, vocab, dtype)
    ninf = float("-inf")
    # Row 0: every entry but the target is -inf (valid; logp = 0, H = 0, zero gradient).
    logits[0] = ninf
    logits[0, targets[0]] = 1.5
    # Row 1: the first 600 entries (more than one interpreter tile) are -inf, so the running
    # max stays -inf for a while; then a random third of the rest.
    logits[1, :600] = ninf
    targets[1] = 700
    drop = torch.rand(vocab, device=DEVICE) < 0.3
    drop[700] = False
    logits[1, drop] = ninf
    # Row 3: the last entries (the partial last tile) are -inf.
    logits[3, -40:] = ninf
    targets[3] = 5
    g, h = torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE)

    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, 0.7, True)
    grad32 = run_bwd_fp32(logits, targets, lse_parts, entropy, g, h, 0.7)
    ref_logp, ref_entropy, ref_grad = safe_reference(logits, targets, 0.7, g, h)
    for t in (logp, entropy, lse_parts, grad32):
        assert not t.isnan().any()
    assert logp[0] == 0 and entropy[0] == 0 and (grad32[0] == 0).all()
    assert_close_rel(logp, ref_logp, TOL[dtype])
    assert_close_rel(logp, reference(logits, targets, 0.7)[0], TOL[dtype])
    assert_close_rel(entropy, ref_entropy, TOL[dtype])
    assert_grad_close(grad32, ref_grad, TOL[dtype])
    assert (grad32[logits == ninf] == 0).all()


def test_shift_invariance():
    # +100 moves every logit; with the tile state kept relative to the max, logp, H and the
    # gradient move only by the rounding of the shifted inputs.
    logits, targets = make_inputs(4, 1000, torch.float32)
    shifted = logits + 100
    g, h = torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE)
    outs = [token_logprobs_fwd(z, targets, 0.7, True) for z in (logits, shifted)]
    grads = [token_logprobs_bwd(z, targets, lse_parts, entropy, g, h, 0.7)
             for z, (_, entropy, lse_parts) in zip((logits, shifted), outs)]
    ref_logp, ref_entropy, ref_grad = reference(shifted, targets, 0.7, g, h)
    assert_close_rel(outs[1][0], ref_logp, 1e-5)
    assert_close_rel(outs[1][1], ref_entropy, 1e-5)
    assert_grad_close(grads[1], ref_grad, 1e-5)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=1e-4)
    torch.testing.assert_close(outs[1][2][:, 0], outs[0][2][:, 0] + 100 / 0.7, rtol=1e-6, atol=0)  # m
    torch.testing.assert_close(outs[1][2][:, 1], outs[0][2][:, 1], rtol=0, atol=1e-4)  # log s
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-4)


def test_strided_rows_int32_targets_and_in_place():
    # Rows of a wider buffer (row stride 1100 > V), int32 targets, gradient written over the
    # logits themselves.
    wide = torch.randn(3, 1100, device=DEVICE)
    logits = wide[:, :1000]
    targets = torch.randint(0, 1000, (3,), device=DEVICE, dtype=torch.int32)
    g, h = torch.randn(3, device=DEVICE), torch.randn(3, device=DEVICE)
    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, 1.0, True)
    ref_logp, ref_entropy, ref_grad = reference(logits, targets.long(), 1.0, g, h)
    assert_close_rel(logp, ref_logp, 1e-5)
    assert_close_rel(entropy, ref_entropy, 1e-5)
    tail = wide[:, 1000:].clone()
    out = token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, 1.0, out=logits)
    assert out.data_ptr() == logits.data_ptr()
    assert_grad_close(logits, ref_grad, 1e-5)
    assert torch.equal(wide[:, 1000:], tail)  # the padding past V is untouched


def test_empty_batch():
    logits = torch.empty(0, 7, device=DEVICE)
    targets = torch.empty(0, dtype=torch.int64, device=DEVICE)
    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, 1.0, True)
    assert logp.shape == entropy.shape == (0,) and lse_parts.shape == (0, 2)
    grad = token_logprobs_bwd(logits, targets, lse_parts, entropy, logp, entropy, 1.0)
    assert grad.shape == (0, 7)


def test_rejects_float64():
    logits = torch.randn(2, 7, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="logits"):
        token_logprobs_fwd(logits, torch.zeros(2, dtype=torch.int64, device=DEVICE), 1.0, True)


def test_launch_config_table():
    for vocab in [1, 7, 1000, 4096, 4099, 32768, 128256, 151936]:
        for dtype in DTYPES:
            block, warps = launch_config(vocab, dtype, interpret=False)
            assert block & (block - 1) == 0 and warps in (1, 2, 4, 8, 16)
            if vocab <= 4096:
                assert block >= vocab  # the whole row in one tile
            assert block * dtype.itemsize <= 16384  # tiles of at most 16 KB
    assert launch_config(151936, torch.bfloat16, interpret=False) == (8192, 16)
    assert launch_config(151936, torch.float32, interpret=False) == (4096, 8)
    assert launch_config(4099, torch.float32, interpret=True)[0] == 512


# ---------------------------------------------------------------------------------------------
# CUDA: real vocabularies (151936 = Qwen2, 128256 = Llama 3, 50257 = GPT-2: odd).

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("vocab", [151936, 128256, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_large_vocab(vocab, dtype):
    logits, targets = make_inputs(64, vocab, dtype, scale=4.0)
    g, h = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, 0.7, True)
    ref_logp, ref_entropy, ref_grad = reference(logits, targets, 0.7, g, h)
    assert_close_rel(logp, ref_logp, TOL[dtype])
    assert_close_rel(entropy, ref_entropy, TOL[dtype])
    grad32 = run_bwd_fp32(logits, targets, lse_parts, entropy, g, h, 0.7)
    assert_grad_close(grad32, ref_grad, TOL[dtype])
    grad = token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, 0.7)
    assert_rounded(grad, grad32)


@pytest.mark.gpu
@gpu
def test_gpu_minus_inf_and_shift():
    test_minus_inf_logits(torch.bfloat16)
    test_shift_invariance()


@pytest.mark.gpu
@gpu
def test_gpu_offsets_beyond_int32():
    # N·V > 2^31 elements (4.3 GB of bf16): the last rows need 64-bit offsets.
    vocab, n = 151936, 14200
    assert n * vocab > 2**31
    logits = torch.empty(n, vocab, dtype=torch.bfloat16, device=DEVICE).normal_(0, 3)
    targets = torch.randint(0, vocab, (n,), device=DEVICE)
    g, h = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    logp, entropy, lse_parts = token_logprobs_fwd(logits, targets, 1.0, True)
    tail = slice(n - 4, n)
    ref_logp, ref_entropy, ref_grad = reference(logits[tail], targets[tail], 1.0, g[tail], h[tail])
    assert_close_rel(logp[tail], ref_logp, 2e-3)
    assert_close_rel(entropy[tail], ref_entropy, 2e-3)
    # In place, so no second 4 GB; bf16 rounding (≤ half an ulp on CUDA) plus the bf16 tolerance.
    token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, 1.0, out=logits)
    atol = 2e-3 * ref_grad.abs().max().item()
    torch.testing.assert_close(logits[tail].double(), ref_grad, rtol=2.0**-8 + 2e-3, atol=atol)
