"""Final-logit soft capping (Gemma 2 and 3): `softcap=c` reads the logits as c·tanh(z/c) on every
backend that runs here, forward and backward, on the logits path and the hidden-state path, against
fp64 autograd of `reference.token_logprobs(..., softcap=c)` on the same values. The logits are large
enough that the cap changes every result (a kernel that ignored it fails), and a fifth of them are
−inf, which stay −inf (masked entries, and the kernels' own padding)."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import presets, reference

_DEVICE = {"cpu": "cpu", "torch": "cpu", "cuda": "cuda", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
BACKENDS = [b for b in ("cpu", "torch", "triton", "cuda") if rlkernels.backend_info()[b]["available"]]
CAP = 15.0
SMALL_CAP = 0.5  # logits capped to ±0.5: a −inf entry read as −c instead of −inf would hold a large share of p


def _logits(n, vocab, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=gen) * 20
    targets = torch.randint(0, vocab, (n,), generator=gen)
    z[torch.rand(n, vocab, generator=gen) < 0.2] = float("-inf")
    z[torch.arange(n), targets] = torch.randn(n, generator=gen) * 20  # a finite target
    return z.to(dtype), targets


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf arithmetic, under the Triton interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_stays_masked_under_a_small_cap(backend):
    dev = _DEVICE[backend]
    z, targets = _logits(5, 300, torch.float32, seed=6)
    logp, entropy = rlkernels.token_logprobs(z.to(dev), targets.to(dev), softcap=SMALL_CAP, return_entropy=True,
                                             backend=backend)
    want_logp, want_entropy = reference.token_logprobs(z.double(), targets, softcap=SMALL_CAP)
    torch.testing.assert_close(logp.cpu().double(), want_logp, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), want_entropy, rtol=1e-6, atol=2e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf arithmetic, under the Triton interpreter
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_match_fp64(backend, dtype, temperature):
    dev = _DEVICE[backend]
    z, targets = _logits(7, 1037, dtype, seed=3)  # 1037: several interpreter tiles, a partial last one
    gen = torch.Generator().manual_seed(4)
    g, h = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    x = z.to(dev).requires_grad_(True)
    logp, entropy = rlkernels.token_logprobs(x, targets.to(dev), temperature=temperature, softcap=CAP,
                                             return_entropy=True, backend=backend)
    (grad,) = torch.autograd.grad((logp * g.to(dev) + entropy * h.to(dev)).sum(), x)

    xd = z.double().requires_grad_(True)
    want_logp, want_entropy = reference.token_logprobs(xd, targets, temperature, softcap=CAP)
    (want_grad,) = torch.autograd.grad((want_logp * g.double() + want_entropy * h.double()).sum(), xd)
    torch.testing.assert_close(logp.cpu().double(), want_logp, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), want_entropy, rtol=1e-6, atol=2e-5)
    # bf16: the gradient is rounded to bf16 on the way out (2^-8 relative)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2**-7, 1e-5)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=rtol, atol=atol)

    uncapped = rlkernels.token_logprobs(z.to(dev), targets.to(dev), temperature=temperature, backend=backend)
    assert (uncapped.cpu().double() - want_logp).abs().max() > 1.0  # the cap matters at these logits


def _loss_case(name, seed):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, V = 4, 5, 16, 301
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.8  # logits of scale ~3: the cap at 2 binds
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    advantages = torch.randn(B, generator=gen)
    logp, _ = reference.token_logprobs(hidden.double() @ weight.double().T, targets, 0.9, softcap=2.0)
    old_logp, ref_logp = ((logp + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
                          for _ in range(2))
    return hidden, weight, targets, mask, advantages, old_logp, ref_logp, presets.get(name, entropy_coef=0.01)


def _reference_loss(hidden, weight, targets, mask, advantages, old_logp, ref_logp, config):
    h, w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp, entropy = reference.token_logprobs(h @ w.T, targets, 0.9, softcap=2.0)
    loss, _ = reference.policy_loss(logp, advantages.double(), mask, config, entropy=entropy,
                                    old_logp=old_logp.double(), ref_logp=ref_logp.double())
    loss.backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("name", ["grpo", "gspo"])  # the fused token kernel; the sequence step
@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_losses_match_fp64(backend, name):
    dev = _DEVICE[backend]
    hidden, weight, targets, mask, adv, old, ref, config = _loss_case(name, seed=5)
    want_loss, want_dh, want_dw = _reference_loss(hidden, weight, targets, mask, adv, old, ref, config)
    kw = dict(old_logp=old.to(dev), ref_logp=ref.to(dev), temperature=0.9, softcap=2.0, backend=backend)

    h, w = hidden.to(dev).requires_grad_(True), weight.to(dev).requires_grad_(True)
    out = rlkernels.fused_linear_policy_loss(h, w, targets.to(dev), adv.to(dev), mask.to(dev), config,
                                             chunk_size=4, **kw)
    out.loss.backward()
    torch.testing.assert_close(out.loss.cpu().double(), want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.cpu().double(), want_dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.cpu().double(), want_dw, rtol=1e-4, atol=1e-6)

    logits = (hidden @ weight.T).to(dev).requires_grad_(True)
    out = rlkernels.fused_policy_loss(logits, targets.to(dev), adv.to(dev), mask.to(dev), config, **kw)
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss.cpu().double(), want_loss, rtol=1e-5, atol=1e-6)
    # ∂hidden through the plain matmul: the logits gradient carries the cap's slope
    torch.testing.assert_close((grad.cpu().double() @ weight.double()), want_dh, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True])
def test_bad_softcap_is_refused_by_name(bad):
    z, targets = _logits(2, 10, torch.float32, seed=0)
    error = TypeError if isinstance(bad, bool) else ValueError
    with pytest.raises(error, match="softcap"):
        rlkernels.token_logprobs(z, targets, softcap=bad)
    with pytest.raises(error, match="softcap"):
        rlkernels.linear_token_logprobs(torch.randn(2, 4), torch.randn(10, 4), targets, softcap=bad)
    with pytest.raises(error, match="softcap"):
        rlkernels.fused_policy_loss(z[None].requires_grad_(True), targets[None], torch.zeros(1),
                                    torch.ones(1, 2, dtype=torch.bool), presets.get("grpo"), softcap=bad)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf arithmetic, under the Triton interpreter
@pytest.mark.parametrize("cap", [1e8, 1e30])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_cap_is_nearly_no_cap(backend, cap):
    """c·tanh(z/c) → z as c grows: the tanh of a tiny z/c must keep its relative precision (the interpreter's
    (1 − e)/(1 + e) in fp32 was 3.9 nats off at c = 1e8)."""
    dev = _DEVICE[backend]
    z, targets = _logits(3, 300, torch.float32, seed=7)
    x = z.to(dev).requires_grad_(True)
    logp, entropy = rlkernels.token_logprobs(x, targets.to(dev), softcap=cap, return_entropy=True, backend=backend)
    (grad,) = torch.autograd.grad(logp.sum(), x)
    xd = z.double().requires_grad_(True)
    want_logp, want_entropy = reference.token_logprobs(xd, targets, softcap=cap)
    (want_grad,) = torch.autograd.grad(want_logp.sum(), xd)
    torch.testing.assert_close(logp.cpu().double(), want_logp, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(entropy.cpu().double(), want_entropy, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-5, atol=1e-6)
