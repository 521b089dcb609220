"""The compiled CUDA kernels (csrc/cuda/token_logprobs.cu) against rlkernels.reference.

Called directly through rlkernels.kernels.cuda (the kernel contract), then once through ops/.
Marked `gpu`: skipped without a CUDA device or without an extension built with CUDA; run by
benchmarks/gpu_check.sh. The reference and the error bounds are those of kernel_cases.py.
"""
import pytest
import torch

import rlkernels
from rlkernels import presets
from rlkernels.kernels import cuda

from kernel_cases import DTYPES, _close, _close_grad, _inputs, _reference, check_backward_matches_autograd

_OK, _REASON = cuda.available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

# V: 1, 7 (all head/tail, no 16-byte pack); 1000; 2048 / 2049 (last warp-per-row size, first
# block-per-row one); 4099 (odd: every other row starts misaligned); 32768 / 32769 (256 → 512
# threads); 151936 (Qwen's vocabulary).
SHAPES = [(5, 1), (9, 7), (37, 1000), (19, 2048), (11, 2049), (13, 4099), (5, 32768), (4, 32769), (3, 151936)]


def _misaligned(logits):
    """The same values in a contiguous tensor whose first element is not 16-byte aligned."""
    flat = torch.empty(logits.numel() + 1, dtype=logits.dtype, device=logits.device)[1:]
    return flat.view(logits.shape).copy_(logits)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_reference(shape, dtype, temperature):
    logits, targets = _inputs(*shape, dtype)
    ref = _reference(logits, targets, temperature)
    for z in (logits.cuda(), _misaligned(logits.cuda())):
        logp, entropy, lse_parts = cuda.token_logprobs_fwd(z, targets.cuda(), temperature, True)
        assert logp.dtype == entropy.dtype == lse_parts.dtype == torch.float32 and logp.is_cuda
        _close(logp.cpu(), ref.logp)
        _close(entropy.cpu(), ref.entropy)
        _close(lse_parts.cpu(), ref.lse_parts)
        assert (logp <= 0).all() and (entropy >= 0).all()
        logp2, entropy2, lse_parts2 = cuda.token_logprobs_fwd(z, targets.cuda().int(), temperature, False)
        assert entropy2.numel() == 0
        torch.testing.assert_close(logp2, logp, rtol=0, atol=0)
        torch.testing.assert_close(lse_parts2, lse_parts, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_backward_matches_autograd(shape, dtype, with_entropy_grad):
    check_backward_matches_autograd(cuda, shape, dtype, with_entropy_grad, "cuda")


@pytest.mark.parametrize("shape", [(9, 7), (13, 4099), (4, 32769)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_out_and_in_place(shape, dtype):
    """`out=` gives bitwise the allocating backward's result: in place (aligned or not), and into a
    buffer whose rows are aligned differently from the logits' (the element-by-element path)."""
    logits, targets = _inputs(*shape, dtype)
    targets[0], targets[-1] = shape[1] - 1, 0
    z, y = logits.cuda(), targets.cuda()
    g, h = torch.randn(shape[0], device="cuda"), torch.randn(shape[0], device="cuda")
    logp, entropy, lse_parts = cuda.token_logprobs_fwd(z, y, 0.8, True)
    expected = cuda.token_logprobs_bwd(z, y, lse_parts, entropy, g, h, 0.8)

    wide = torch.full((shape[0], shape[1] + 3), 7.0, dtype=dtype, device="cuda")
    out = wide[:, 1:-2]
    assert cuda.token_logprobs_bwd(z, y, lse_parts, entropy, g, h, 0.8, out=out) is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert (wide[:, 0] == 7).all() and (wide[:, -2:] == 7).all()

    for buffer in (z.clone(), _misaligned(z)):
        assert cuda.token_logprobs_bwd(buffer, y, lse_parts, entropy, g, h, 0.8, out=buffer) is buffer
        torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits_and_nan_rows(dtype):
    n, vocab, temperature = 6, 2500, 0.9
    logits, targets = _inputs(n, vocab, dtype)
    masked = torch.rand(n, vocab) < 0.5
    masked[torch.arange(n), targets] = False
    masked[2] = True
    masked[2, targets[2]] = False  # row 2: every entry −inf except the target
    logits = logits.masked_fill(masked, float("-inf"))
    g, h = torch.randn(n), torch.randn(n)
    z, y = logits.cuda(), targets.cuda()
    logp, entropy, lse_parts = cuda.token_logprobs_fwd(z, y, temperature, True)
    grad = cuda.token_logprobs_bwd(z, y, lse_parts, entropy, g.cuda(), h.cuda(), temperature).cpu()
    ref = _reference(logits.double().masked_fill(masked, -1e4), targets, temperature, g, h)
    _close(logp.cpu(), ref.logp)
    _close(entropy.cpu(), ref.entropy)
    _close_grad(grad, ref)
    assert (grad[masked] == 0).all()
    assert logp[2] == 0 and entropy[2] == 0 and (grad[2] == 0).all()

    bad = z.clone()
    bad[1, 2400] = float("nan")
    bad[3, 7] = float("inf")
    bad[4] = float("-inf")
    bad[4, 5] = float("nan")  # a NaN among −inf only must not be lost either
    logp, entropy, lse_parts = cuda.token_logprobs_fwd(bad, y, temperature, True)
    assert logp[[1, 3, 4]].isnan().all() and entropy[[1, 3, 4]].isnan().all()
    assert lse_parts[[1, 3, 4], 1].isnan().all()
    assert logp[[0, 2, 5]].isfinite().all()


def test_shift_by_100_changes_nothing():
    n, vocab = 17, 3001
    logits = (torch.randint(-512, 512, (n, vocab)).float() / 64).cuda()
    targets = torch.randint(0, vocab, (n,), device="cuda")
    logp, entropy, parts = cuda.token_logprobs_fwd(logits, targets, 1.0, True)
    logp_s, entropy_s, parts_s = cuda.token_logprobs_fwd(logits + 100, targets, 1.0, True)
    torch.testing.assert_close(logp_s, logp, rtol=0, atol=0)
    torch.testing.assert_close(entropy_s, entropy, rtol=0, atol=0)
    torch.testing.assert_close(parts_s - torch.tensor([100.0, 0.0], device="cuda"), parts, rtol=0, atol=0)
    g, h = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    grad = cuda.token_logprobs_bwd(logits, targets, parts, entropy, g, h, 1.0)
    torch.testing.assert_close(cuda.token_logprobs_bwd(logits + 100, targets, parts_s, entropy_s, g, h, 1.0), grad,
                               rtol=0, atol=0)


def test_empty_batch_and_bad_inputs():
    logits = torch.randn(0, 11, device="cuda")
    targets = torch.zeros(0, dtype=torch.long, device="cuda")
    logp, entropy, lse_parts = cuda.token_logprobs_fwd(logits, targets, 1.0, True)
    assert logp.shape == entropy.shape == (0,) and lse_parts.shape == (0, 2)
    assert cuda.token_logprobs_bwd(logits, targets, lse_parts, entropy, logp, entropy, 1.0).shape == (0, 11)

    z = torch.randn(4, 10, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    for name, args in [("logits", (z.double(), y)), ("logits", (z.t(), y)), ("targets", (z, y.cpu())),
                       ("targets", (z, y[:3]))]:
        with pytest.raises(RuntimeError, match=f"{name}:"):
            cuda.token_logprobs_fwd(*args, 1.0, True)
    logp, entropy, lse_parts = cuda.token_logprobs_fwd(z, y, 1.0, True)
    with pytest.raises(RuntimeError, match="out:"):
        cuda.token_logprobs_bwd(z, y, lse_parts, entropy, logp, None, 1.0, out=torch.empty(4, 10, device="cuda").half())
    with pytest.raises(RuntimeError, match="lse_parts:"):  # a logsumexp (N,) is not the pair
        cuda.token_logprobs_bwd(z, y, lse_parts.sum(1), entropy, logp, None, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ops_and_fused_loss_in_place(dtype):
    """Through ops/: token_logprobs' gradient and fused_policy_loss(inplace=True) equal the torch backend's."""
    B, T, V = 4, 9, 3001
    logits = (torch.randn(B, T, V, device="cuda") * 2).to(dtype)
    targets = torch.randint(0, V, (B, T), device="cuda")
    results = {}
    for backend in ("torch", "cuda"):
        x = logits.clone().requires_grad_(True)
        logp, ent = rlkernels.token_logprobs(x, targets, temperature=0.9, return_entropy=True, backend=backend)
        (logp.sum() + 0.1 * ent.sum()).backward()
        results[backend] = (logp, ent, x.grad)
    (logp, ent, grad), (logp_t, ent_t, grad_t) = results["cuda"], results["torch"]
    torch.testing.assert_close(logp, logp_t, rtol=2e-5, atol=2e-5)  # fp32 from the same values
    torch.testing.assert_close(ent, ent_t, rtol=2e-5, atol=2e-5)
    # bf16 gradients: the two fp32 results may round to neighbouring bf16 values (2^-8 apart).
    torch.testing.assert_close(grad, grad_t, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-6)

    adv, mask = torch.randn(B, device="cuda"), torch.ones(B, T, device="cuda")
    y = logits.clone().requires_grad_(True)
    expected = rlkernels.fused_policy_loss(y, targets, adv, mask, presets.dapo(), backend="torch")
    expected.loss.backward()
    buffer = logits.clone()
    x = buffer.view_as(buffer).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, presets.dapo(), inplace=True, backend="cuda")
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-6)
    assert x.grad.data_ptr() == buffer.data_ptr()
