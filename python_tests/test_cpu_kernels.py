"""The compiled CPU kernels (csrc/cpu/token_logprobs.cpp) against rlkernels.reference.

Called directly through rlkernels.kernels.cpu (the kernel contract of rlkernels/kernels/__init__.py),
not through ops/, so that a failure points at the C++ code. Skipped when `_C` is not built.
"""
import pytest
import torch

from rlkernels.kernels import cpu

from kernel_cases import DTYPES, SHAPES, _close, _close_grad, _inputs, _reference, check_backward_matches_autograd

_OK, _REASON = cpu.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_reference(shape, dtype, temperature):
    logits, targets = _inputs(*shape, dtype)
    logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, temperature, True)
    assert logp.dtype == entropy.dtype == lse_parts.dtype == torch.float32 and lse_parts.shape == (shape[0], 2)
    ref = _reference(logits, targets, temperature)
    _close(logp, ref.logp)
    _close(entropy, ref.entropy)
    _close(lse_parts, ref.lse_parts)
    assert (logp <= 0).all() and (entropy >= 0).all() and (lse_parts[:, 1] >= 0).all()

    logp2, entropy2, lse_parts2 = cpu.token_logprobs_fwd(logits, targets.int(), temperature, False)
    assert entropy2.numel() == 0
    torch.testing.assert_close(logp2, logp, rtol=0, atol=0)  # the entropy sums do not touch (m, log s)
    torch.testing.assert_close(lse_parts2, lse_parts, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_backward_matches_autograd(shape, dtype, with_entropy_grad):
    check_backward_matches_autograd(cpu, shape, dtype, with_entropy_grad, "cpu")


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_out_and_in_place(shape, dtype):
    """`out=` gives bitwise the allocating backward's result: into a row-strided buffer, and into
    the logits themselves (every element, the target's included, is read before it is written)."""
    logits, targets = _inputs(*shape, dtype)
    targets[0] = shape[1] - 1  # targets at both ends of a row: the tail step and the first step
    targets[-1] = 0
    g, h = torch.randn(shape[0]), torch.randn(shape[0])
    logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, 0.8, True)
    expected = cpu.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, 0.8)

    wide = torch.full((shape[0], shape[1] + 3), 7.0, dtype=dtype)
    out = wide[:, 1:-2]  # row stride V + 3, unit stride over V
    assert cpu.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, 0.8, out=out) is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert (wide[:, 0] == 7).all() and (wide[:, -2:] == 7).all()  # nothing written outside `out`

    buffer = logits.clone()
    assert cpu.token_logprobs_bwd(buffer, targets, lse_parts, entropy, g, h, 0.8, out=buffer) is buffer
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


def test_backward_out_rejects_bad_buffers():
    logits, targets = _inputs(4, 100, torch.float32)
    logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, 1.0, True)
    g = torch.randn(4)
    storage = torch.empty(4 * 100 + 50)
    cases = [
        torch.empty(4, 100, dtype=torch.bfloat16),  # dtype
        torch.empty(4, 99),  # shape
        torch.empty(100, 4).t(),  # stride over V
        storage[50:].view(4, 100),  # not the logits, yet overlapping them
    ]
    storage[:400].copy_(logits.reshape(-1))
    shared = storage[:400].view(4, 100)
    for out in cases:
        with pytest.raises(RuntimeError, match="out:"):
            cpu.token_logprobs_bwd(shared, targets, lse_parts, entropy, g, None, 1.0, out=out)


def test_shift_by_100_changes_nothing():
    # Logits on a 1/64 grid, so that z + 100 is exact in fp32 and only the kernel can differ.
    n, vocab = 17, 3001
    logits = torch.randint(-512, 512, (n, vocab)).float() / 64
    targets = torch.randint(0, vocab, (n,))
    g, h = torch.randn(n), torch.randn(n)
    logp, entropy, parts = cpu.token_logprobs_fwd(logits, targets, 1.0, True)
    logp_s, entropy_s, parts_s = cpu.token_logprobs_fwd(logits + 100, targets, 1.0, True)
    # x − m is the same exact number in both, so are the sums: logp, entropy and log s are bitwise
    # equal, and m moves by exactly 100.
    torch.testing.assert_close(logp_s, logp, rtol=0, atol=0)
    torch.testing.assert_close(entropy_s, entropy, rtol=0, atol=0)
    torch.testing.assert_close(parts_s - torch.tensor([100.0, 0.0]), parts, rtol=0, atol=0)
    grad = cpu.token_logprobs_bwd(logits, targets, parts, entropy, g, h, 1.0)
    grad_s = cpu.token_logprobs_bwd(logits + 100, targets, parts_s, entropy_s, g, h, 1.0)
    torch.testing.assert_close(grad_s, grad, rtol=0, atol=0)
    _close_grad(grad_s, _reference(logits, targets, 1.0, g, h))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits(dtype):
    """Masked vocabulary entries (−inf) contribute nothing; a row with only its target is valid."""
    n, vocab, temperature = 6, 2500, 0.9
    logits, targets = _inputs(n, vocab, dtype)
    masked = torch.rand(n, vocab) < 0.5
    masked[torch.arange(n), targets] = False
    masked[2] = True
    masked[2, targets[2]] = False  # row 2: every entry −inf except the target
    masked[4, :2100] = True  # row 4: the first block entirely −inf
    masked[4, targets[4]] = False
    logits = logits.masked_fill(masked, float("-inf"))
    g, h = torch.randn(n), torch.randn(n)

    logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, temperature, True)
    grad = cpu.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, temperature)
    # The reference computes 0·(−inf) = NaN for the entropy, so it sees a finite stand-in whose
    # exp underflows to exactly 0: the same mathematical input.
    finite = logits.double().masked_fill(masked, -1e4)
    ref = _reference(finite, targets, temperature, g, h)
    _close(logp, ref.logp)
    _close(entropy, ref.entropy)
    _close(lse_parts, ref.lse_parts)
    _close_grad(grad, ref)
    assert (grad[masked] == 0).all()
    assert logp[2] == 0 and entropy[2] == 0 and (grad[2] == 0).all()


class _TokenLogprobs(torch.autograd.Function):
    """The kernels joined by hand, only to let gradcheck see them (ops/ does it for real)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, temperature, True)
        ctx.save_for_backward(logits, targets, lse_parts, entropy)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse_parts, entropy = ctx.saved_tensors
        grad = cpu.token_logprobs_bwd(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, ctx.temperature)
        return grad, None, None


@pytest.mark.parametrize("shape", [(3, 5), (4, 37)], ids=str)
def test_gradcheck_fp64(shape):
    logits, targets = _inputs(*shape, torch.float64, scale=1.5)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: _TokenLogprobs.apply(z, targets, 0.7), (logits,))


def test_fp64_matches_reference_tightly():
    logits, targets = _inputs(7, 4099, torch.float64)
    logp, entropy, _ = cpu.token_logprobs_fwd(logits, targets, 1.3, True)
    assert logp.dtype == torch.float64
    ref = _reference(logits, targets, 1.3)
    torch.testing.assert_close(logp, ref.logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref.entropy, rtol=1e-12, atol=1e-12)


def test_empty_batch():
    logits = torch.randn(0, 11)
    targets = torch.zeros(0, dtype=torch.long)
    logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, 1.0, True)
    assert logp.shape == entropy.shape == (0,) and lse_parts.shape == (0, 2)
    grad = cpu.token_logprobs_bwd(logits, targets, lse_parts, entropy, logp, entropy, 1.0)
    assert grad.shape == (0, 11)


def test_bad_inputs_name_the_argument():
    logits, targets = _inputs(4, 10, torch.float32)
    logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, 1.0, True)
    g = torch.randn(4)
    fwd_cases = [
        ("logits", (logits.long(), targets, 1.0)),                # wrong dtype
        ("logits", (logits[None], targets, 1.0)),                 # not 2-D
        ("logits", (logits.t(), torch.zeros(10, dtype=torch.long), 1.0)),  # not contiguous
        ("targets", (logits, targets.float(), 1.0)),              # wrong dtype
        ("targets", (logits, targets[:3], 1.0)),                  # shape mismatch
        ("targets", (logits, targets + 10, 1.0)),                 # out of [0, V)
        ("temperature", (logits, targets, 0.0)),
    ]
    for name, (z, y, tau) in fwd_cases:
        with pytest.raises((RuntimeError, ValueError, TypeError), match=f"{name}:"):
            cpu.token_logprobs_fwd(z, y, tau, True)
    bwd_cases = [
        ("lse_parts", (logits, targets, lse_parts[:3], entropy, g, None)),
        ("lse_parts", (logits, targets, lse_parts.sum(1), entropy, g, None)),  # a logsumexp (N,)
        ("grad_logp", (logits, targets, lse_parts, entropy, g[:2], None)),
        ("grad_entropy", (logits, targets, lse_parts, entropy, g, g[:1])),
        ("entropy", (logits, targets, lse_parts, entropy[:0], g, g)),
        ("logits", (logits.half().t(), targets, lse_parts, entropy, g, None)),
    ]
    for name, args in bwd_cases:
        with pytest.raises((RuntimeError, ValueError, TypeError), match=f"{name}:"):
            cpu.token_logprobs_bwd(*args, 1.0)


def test_nan_or_inf_logit_gives_a_nan_row():
    """A NaN or +inf logit makes its row NaN (as log_softmax does); other rows are unaffected."""
    logits, targets = _inputs(4, 3000, torch.float32)
    logits[1, 2500] = float("nan")
    logits[2, 7] = float("inf")
    g = torch.randn(4)
    for need_entropy in (True, False):
        logp, entropy, lse_parts = cpu.token_logprobs_fwd(logits, targets, 1.0, need_entropy)
        assert logp[1:3].isnan().all() and lse_parts[1:3, 1].isnan().all()
        assert logp[[0, 3]].isfinite().all() and lse_parts[[0, 3]].isfinite().all()
    grad = cpu.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, None, 1.0)
    assert grad[1:3].isnan().all() and grad[[0, 3]].isfinite().all()
