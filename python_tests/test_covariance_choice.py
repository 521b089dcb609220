"""`covariance_choice` (Clip-Cov's and KL-Cov's tokens, kernels/__init__.py) on every backend that has it equals
the spec's `clip_cov_tokens` / `kl_cov_tokens` (losses/surrogates.py) token for token, on fresh random inputs:
ties of the covariance and of the draws (taken in position order), fewer candidates than k, several chunks of the
GPU kernels' loops, NaN padding, an empty mask. And the fused loss with many chosen tokens on the Triton backend."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import rlkernels
from rlkernels import presets
from rlkernels.kernels import cpu, cuda, triton as triton_kernels
from rlkernels.losses.surrogates import clip_cov_tokens, kl_cov_tokens
from rlkernels.ops.kernel_params import covariance_choice_params

from loss_inputs import random_loss_inputs

BACKENDS = [pytest.param(k, id=name) for name, k in (("cpu", cpu), ("triton", triton_kernels), ("cuda", cuda))
            if rlkernels.backend_info()[name]["available"]]
DEVICE = {"cpu": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu", "cuda": "cuda"}


def _device(kernels):
    return DEVICE[kernels.__name__.rsplit(".", 1)[-1]]


def _inputs(seed, B, T, quantized, dtype=torch.float32, fill=0.7):
    """(B, T) log-probs, per-row advantages, ℓ_old and a ragged mask; `quantized`: values on a coarse grid, so
    that many covariances are exactly equal. NaN in the padding, which no backend may read."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < fill
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    if quantized:
        logp, adv = (logp * 2).round() / 2, adv.round()
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    pad = torch.full((B, T), float("nan"), dtype=torch.float64)
    logp, adv, old = (torch.where(mask, x, pad).to(dtype) for x in (logp, adv, old))
    return logp, adv, old, mask


def _choose(kernels, config, logp, adv, old, mask, draws=None):
    dev = _device(kernels)
    flat = [None if x is None else x.reshape(-1).to(dev) for x in (logp, adv, old, mask, draws)]
    return kernels.covariance_choice(*flat, covariance_choice_params(config)).cpu().view(mask.shape)


CASES = [  # (seed, B, T, quantized, fraction)
    (1, 4, 50, False, 0.1),
    (2, 4, 50, True, 0.3),   # ties of the covariance: the first positions win
    (3, 3, 1100, True, 0.05),  # > 1024 tokens: the GPU kernels' loops take several steps
    (4, 2, 7, False, 1.0),   # k = every token
    (5, 1, 3, False, 1e-6),  # k = max(⌊N·fraction⌋, 1) = 1
]


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("seed,B,T,quantized,fraction", CASES)
def test_kl_cov_tokens_match_the_spec(kernels, seed, B, T, quantized, fraction):
    logp, adv, old, mask = _inputs(seed, B, T, quantized)
    config = presets.kl_cov(kl_cov_ratio=fraction, kl_cov_coef=0.7)
    expected = kl_cov_tokens(adv, logp, mask, config)
    got = _choose(kernels, config, logp, adv, old, mask)
    assert torch.equal(got != 0, expected), (got != 0).nonzero().tolist()
    assert torch.equal(got[expected], torch.full_like(got[expected], 0.7))
    assert int(expected.sum()) == max(int(mask.sum() * fraction), 1)


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("seed,B,T,quantized,fraction", CASES)
@pytest.mark.parametrize("on_policy", [False, True])
def test_clip_cov_tokens_match_the_spec(kernels, seed, B, T, quantized, fraction, on_policy, monkeypatch):
    logp, adv, old, mask = _inputs(seed, B, T, quantized)
    old = None if on_policy else old
    # candidates: a covariance in (−0.5, 2), unclipped by PPO's clip (ratios reach 0.5 to 2: many are clipped)
    config = presets.clip_cov(clip_cov_ratio=fraction, clip_cov_lb=-0.5, clip_cov_ub=2.0, clip_low=0.1, clip_high=0.2)
    c = config.log_ratio_clamp
    w = torch.ones_like(logp) if old is None else torch.exp((logp - old).clamp(-c, c))
    draws = torch.rand(B * T, generator=torch.Generator().manual_seed(seed))
    if quantized:  # ties of the draws too: the spec then takes the first positions, and so must the kernels
        draws = (draws * 8).floor() / 8
    with monkeypatch.context() as m:  # the spec's draw is `torch.rand(N, dtype=float32)`: these draws
        m.setattr(torch, "rand", lambda *args, **kwargs: draws.clone())
        expected = clip_cov_tokens(w, adv, logp, mask, config)
    got = _choose(kernels, config, logp, adv, old, mask, draws)
    assert torch.equal(got != 0, expected), ((got != 0) ^ expected).nonzero().tolist()
    assert 0 < int(expected.sum()) <= max(int(mask.sum() * fraction), 1)


@pytest.mark.parametrize("kernels", BACKENDS)
def test_fewer_candidates_than_k_are_all_chosen(kernels):
    logp, adv, old, mask = _inputs(6, 4, 60, False)
    config = presets.clip_cov(clip_cov_ratio=0.5, clip_cov_lb=0.2, clip_cov_ub=0.4)  # a narrow band
    w = torch.exp((logp - old).clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    torch.manual_seed(0)
    expected = clip_cov_tokens(w, adv, logp, mask, config)
    torch.manual_seed(0)
    got = _choose(kernels, config, logp, adv, old, mask, torch.rand(mask.numel(), dtype=torch.float32))
    assert 0 < int(expected.sum()) < 0.5 * int(mask.sum())
    assert torch.equal(got != 0, expected)


@pytest.mark.parametrize("kernels", BACKENDS)
def test_an_empty_mask_chooses_none(kernels):
    logp, adv, old, mask = _inputs(7, 3, 40, False)
    config = presets.kl_cov(kl_cov_ratio=0.2, kl_cov_coef=0.5)
    empty = torch.zeros_like(mask)
    assert not _choose(kernels, config, logp, adv, old, empty).any()
    assert _choose(kernels, config, logp[:0], adv[:0], old[:0], empty[:0]).numel() == 0


def test_float64_on_cpu():
    logp, adv, old, mask = _inputs(8, 4, 50, True, dtype=torch.float64)
    config = presets.kl_cov(kl_cov_ratio=0.3)
    got = _choose(cpu, config, logp, adv, old, mask)
    assert got.dtype == torch.float64
    assert torch.equal(got != 0, kl_cov_tokens(adv, logp, mask, config))


@pytest.mark.parametrize("kernels", BACKENDS)
def test_bad_arguments_name_themselves(kernels):
    logp, adv, old, mask = _inputs(9, 2, 10, False)
    dev = _device(kernels)
    flat = dict(logp=logp.reshape(-1).to(dev), adv=adv.reshape(-1).to(dev), old_logp=None,
                mask=mask.reshape(-1).to(dev), draws=None)
    kl = covariance_choice_params(presets.kl_cov())
    clip = covariance_choice_params(presets.clip_cov())
    draws = torch.rand(logp.numel()).to(dev)
    cases = [("draws", ValueError, dict(), clip), ("draws", ValueError, dict(draws=draws), kl),
             ("mask", ValueError, dict(mask=flat["mask"][:-1]), kl),
             ("fraction", ValueError, dict(), dataclasses.replace(kl, fraction=0.0))]
    if kernels is not triton_kernels:  # Triton converts its inputs; the compiled ops take them exactly
        cases += [("adv", TypeError, dict(adv=flat["adv"].double()), kl),
                  ("objective", ValueError, dict(), dataclasses.replace(kl, objective=2))]
    for name, error, change, params in cases:
        args = {**flat, **change}
        with pytest.raises(error, match=f"^{name}:"):
            kernels.covariance_choice(*args.values(), params)


@pytest.mark.skipif(not rlkernels.backend_info()["triton"]["available"], reason="no triton")
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_triton_fused_loss_with_many_chosen_tokens(name):
    """The fused loss on the Triton backend, where a third of the tokens are chosen, equals the composition."""
    dev = DEVICE["triton"]
    B, T, V = 3, 8, 33
    inputs = random_loss_inputs(B, T, dtype=torch.float32, noise=0.3, per_token_adv=True, seed=4, device=dev)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, T, V, generator=g).to(dev)
    targets = torch.randint(0, V, (B, T), generator=g).to(dev)
    config = (presets.clip_cov(clip_cov_ratio=0.3, clip_cov_lb=-1.0) if name == "clip_cov"
              else presets.kl_cov(kl_cov_ratio=0.3, kl_cov_coef=0.5))
    kw = dict(old_logp=inputs["old_logp"], ref_logp=inputs["ref_logp"])
    adv, mask = inputs["advantages"], inputs["mask"]
    x = logits.clone().requires_grad_(True)
    torch.manual_seed(0)
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, backend="triton", **kw)
    fused.loss.backward()
    y = logits.clone().requires_grad_(True)
    logp, ent = rlkernels.token_logprobs(y, targets, return_entropy=True, backend="torch")
    torch.manual_seed(0)
    composed = rlkernels.policy_loss(logp, adv, mask, config, entropy=ent, **kw)
    composed.loss.backward()
    other = config.replace(objective="clip") if name == "clip_cov" else config.replace(kl_cov_coef=0.0)
    assert not torch.allclose(rlkernels.policy_loss(logp, adv, mask, other, **kw).loss, composed.loss)
    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], rtol=1e-5, atol=1e-7, msg=key)
