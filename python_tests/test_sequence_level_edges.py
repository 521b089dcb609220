"""Sequence-level losses at the edges of what they accept (`ops/_sequence_step.py` and the kernel parameters it
builds): one row, a clip bound past the range of exp, a sampled token of probability 0. On every backend,
`fused_policy_loss` equals its definition `policy_loss(token_logprobs(...))` (torch backend) in loss, ∂logits
and metrics, as `test_fused_policy_loss.py` checks on ordinary inputs.
"""
import pytest
import torch

import rlkernels
from rlkernels import _backend, reference

from loss_inputs import check_fused_against_the_composition, preset

BACKENDS = ["torch", "cpu"] + (["triton"] if _backend.backend_info()["triton"]["available"]
                               and _backend._device_ok("triton", torch.device("cpu")) else [])
V = 11


def _inputs(B, T, seed):
    """Logits (B, T, V), targets, a ragged mask with every row non-empty, and the loss arguments."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    logp = rlkernels.token_logprobs(logits, targets, backend="torch")
    noise = torch.randn(2, B, T, generator=g)
    kw = dict(old_logp=logp + 0.05 * noise[0], ref_logp=logp + 0.3 * noise[1],
              rewards=torch.randint(0, 2, (B,), generator=g).float())
    return logits, targets, torch.randn(B, generator=g), mask, kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_gspo_token_with_one_row(backend):
    """B = 1: the row's sequence log-ratio broadcast over its tokens is a stride-0 expand; the kernels take it
    contiguous (the cpu backend once raised "logp: expected a contiguous tensor")."""
    logits, targets, adv, mask, kw = _inputs(1, 6, seed=0)
    check_fused_against_the_composition(preset("gspo_token"), logits, targets, adv, mask, kw, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip_high", [710.0, 1e6])
def test_gmpo_with_a_clip_bound_past_the_range_of_exp(backend, clip_high):
    """ε_high ≥ 710: e^ε_high overflows a double (the cpu and triton backends once raised OverflowError); the
    bound then never binds, as in the definition."""
    logits, targets, adv, mask, kw = _inputs(4, 5, seed=1)
    out, _ = check_fused_against_the_composition(preset("gmpo", clip_high=clip_high), logits, targets, adv, mask,
                                                 kw, backend)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gspo", "gmpo", "luspo", "fspo", "gepo", "vespo"])
def test_a_sampled_token_of_probability_0(backend, name):
    """A sampled token whose logit is −inf (ℓ = −inf, within the mask): the definition's loss is a number
    (VESPO's is −∞, from its REINFORCE surrogate −φ·A·ℓ); the cpu and triton backends once gave NaN, from
    0·(−∞) in the KL and entropy terms' call."""
    logits, targets, adv, mask, kw = _inputs(4, 5, seed=2)
    logits[1, 0, targets[1, 0]] = float("-inf")
    config = preset(name, group_size=2) if name == "gepo" else preset(name)
    out, _ = check_fused_against_the_composition(config, logits, targets, adv, mask, kw, backend)
    assert not torch.isnan(out.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gspo_token_with_a_sampled_token_of_probability_0(backend):
    """GSPO-token's ratio is e^(sg(log s_i) + ℓ − sg(ℓ)): at ℓ = −inf, ℓ − ℓ is NaN, so the definition
    (rlkernels/reference.py) and autograd's composition give a NaN loss and gradient, with or without a KL term;
    the cpu and triton backends once gave a number (the clamp of log s_i hid the −inf)."""
    logits, targets, adv, mask, kw = _inputs(4, 5, seed=2)
    logits[1, 0, targets[1, 0]] = float("-inf")
    for config in (preset("gspo_token"), preset("gspo_token", kl_coef=0.1, kl_estimator="k3")):
        x = logits.clone().requires_grad_(True)
        fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, backend=backend, **kw)
        fused.loss.backward()
        y = logits.clone().requires_grad_(True)
        composed = rlkernels.policy_loss(rlkernels.token_logprobs(y, targets, backend="torch"), adv, mask, config, **kw)
        composed.loss.backward()
        definition = reference.policy_loss(reference.token_logprobs(logits.double(), targets)[0], adv.double(),
                                           mask, config, **{k: v.double() for k, v in kw.items()})[0]
        assert torch.isnan(definition) and torch.isnan(fused.loss)
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6, equal_nan=True)
