"""Precision for large logits, and the same NaN for non-finite rows, on every backend that runs here.

Each backend's log-prob, entropy and ∂logits for fp32 logits shifted by c are compared with fp64
`log_softmax` autograd on the same fp32 values. A row's normaliser must stay the pair (m, log s):
folded into lse = m + log s it rounds to ulp(m), which costs 3e-5 at c = 1e3 and all of log s near
±3e38 (kernels/__init__.py). The tolerances are fp32's own: an absolute 2e-6 (5e-6 on a GPU,
whose fast exp is good to 2e-6 relative) plus one ulp of the value.

Under the Triton interpreter the kernels run in numpy: RuntimeWarnings are errors in the finite
tests, so an overflow inside the kernels (δ·s near ±3e38) fails even where a later step hides it.
"""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import presets, reference

_DEVICE = {"cpu": "cpu", "torch": "cpu", "cuda": "cuda", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
BACKENDS = [b for b in ("cpu", "torch", "triton", "cuda") if rlkernels.backend_info()[b]["available"]]
SHIFTS = [0.0, 1e3, 1e4, 1e5, 1e7]
ULP = 2.0**-23


def _atol(backend):
    return 5e-6 if _DEVICE[backend] == "cuda" else 2e-6


def _fp64(x, targets, temperature=1.0):
    """(logp, entropy) by fp64 log_softmax of x (finite logits: p·log p needs no guard)."""
    log_p = torch.log_softmax(x.double() / temperature, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _reference(z, targets, temperature, g, h):
    """(logp, entropy, ∂logits) in fp64 by log_softmax autograd, on the values of z."""
    x = z.detach().double().requires_grad_(True)
    logp, entropy = _fp64(x, targets, temperature)
    (grad,) = torch.autograd.grad((logp * g.double()).sum() + (entropy * h.double()).sum(), x)
    return logp, entropy, grad


def _backend_result(backend, z, targets, temperature, g, h):
    dev = _DEVICE[backend]
    x = z.clone().to(dev).requires_grad_(True)
    logp, entropy = rlkernels.token_logprobs(x, targets.to(dev), temperature=temperature, return_entropy=True,
                                             backend=backend)
    (grad,) = torch.autograd.grad((logp * g.to(dev)).sum() + (entropy * h.to(dev)).sum(), x)
    return logp.cpu(), entropy.cpu(), grad.cpu()


def _check(backend, z, targets, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    g, h = torch.randn(z.shape[0], generator=gen), torch.randn(z.shape[0], generator=gen)
    got = _backend_result(backend, z, targets, temperature, g, h)
    want = _reference(z, targets, temperature, g, h)
    for name, a, b in zip(("logp", "entropy", "grad"), got, want):
        err = (a.double() - b).abs()
        bound = _atol(backend) + ULP * b.abs()
        assert bool((err <= bound).all()), f"{name}: max error {err.max().item():.2e} (bound {bound.max().item():.2e})"


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shifted_logits_match_fp64(backend, shift):
    gen = torch.Generator().manual_seed(int(shift) % 9973)
    N, V = 8, 777  # two interpreter tiles, the last partial
    z = (torch.randn(N, V, generator=gen, dtype=torch.float64) * 3 + shift).float()
    targets = torch.randint(0, V, (N,), generator=gen)
    _check(backend, z, targets, 1.0, seed=1)


def _rows_near_float_max(sign, N=4, V=4099, seed=0):
    """Rows whose max is ±3e38, tied 1 to 4 times, mostly in the row's last elements, after
    many smaller values: a late larger max rescales sums of ~V terms by e^{δ}, δ ≈ −1e38. Every
    other p is 0 in exact arithmetic too (neighbouring floats there are 2e31 apart)."""
    gen = torch.Generator().manual_seed(seed)
    top = torch.tensor(3e38 * sign, dtype=torch.float32)
    below = torch.nextafter(top, torch.tensor(-float("inf")))
    low = 2e38 if sign > 0 else -3.4e38
    z = torch.full((N, V), low, dtype=torch.float32)
    z[:, V // 2:] = below
    for n in range(N):
        ties = torch.randperm(V - V // 2, generator=gen)[: n + 1] + V // 2
        z[n, ties] = top
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::2] = z[::2].argmax(1)  # at the max: logp = −log(ties), all of which m + log s rounds away
    return z, targets


@pytest.mark.filterwarnings("error::RuntimeWarning")
# Powers of 2: z/τ is exact, so the reference sees the same x. At τ = 0.5, z/τ overflows fp32: the
# kernels must scale differences z − m only.
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("sign", [1, -1], ids=["+3e38", "-3e38"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_near_float_max_match_fp64(backend, sign, temperature):
    z, targets = _rows_near_float_max(sign)
    _check(backend, z, targets, temperature, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_policy_loss_with_shifted_logits(backend):
    """The fused forward kernels save the same (m, log s) for the backward."""
    gen = torch.Generator().manual_seed(5)
    B, T, V = 3, 4, 301
    z = (torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3 + 1e5).float()
    targets = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    logp_fp64 = _fp64(z, targets)[0]
    old_logp, ref_logp = ((logp_fp64 + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
                          for _ in range(2))
    config = presets.get("grpo", entropy_coef=0.01)
    dev = _DEVICE[backend]
    x = z.clone().to(dev).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets.to(dev), adv.to(dev), mask.to(dev), config, old_logp=old_logp.to(dev),
                                      ref_logp=ref_logp.to(dev), backend=backend)
    out.loss.backward()

    ref_x = z.double().requires_grad_(True)
    logp, entropy = _fp64(ref_x, targets)
    ref_loss, _ = reference.policy_loss(logp, adv.double(), mask, config, entropy=entropy, old_logp=old_logp.double(),
                                        ref_logp=ref_logp.double())
    ref_loss.backward()
    torch.testing.assert_close(out.loss.cpu().double(), ref_loss, rtol=1e-5, atol=1e-7)
    # ∂loss/∂logp is ~1/(B·T): the gradient's scale, where 1e5 cost 1e-4 of it
    torch.testing.assert_close(x.grad.cpu().double(), ref_x.grad, rtol=0, atol=_atol(backend) / (B * T))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, under the Triton interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_rows_give_nan(backend):
    """A row that is all NaN or all −inf (or holds one NaN or +inf) has NaN log-prob and entropy on
    every backend, as log_softmax's; its neighbours are unaffected."""
    gen = torch.Generator().manual_seed(7)
    V = 37
    z = torch.randn(6, V, generator=gen)
    z[1] = float("nan")
    z[2] = float("-inf")
    z[3, 5] = float("nan")
    z[4, 9] = float("inf")
    targets = torch.randint(0, V, (6,), generator=gen)
    dev = _DEVICE[backend]
    logp, entropy = rlkernels.token_logprobs(z.to(dev), targets.to(dev), return_entropy=True, backend=backend)
    want_logp, want_entropy = _fp64(z[[0, 5]], targets[[0, 5]])
    for got, want in ((logp.cpu(), want_logp), (entropy.cpu(), want_entropy)):
        assert got[1:5].isnan().all(), got
        torch.testing.assert_close(got[[0, 5]].double(), want, rtol=1e-5, atol=1e-5)
