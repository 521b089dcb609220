"""`fused_policy_loss(..., backend="triton")` equals `policy_loss(token_logprobs(..., backend="torch"))`.

Without CUDA the kernels run in the Triton interpreter (slow: tiny shapes). The `gpu` tests in
test_kernel_contract.py cover real sizes of the kernels themselves.
"""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import presets

from loss_inputs import preset, random_loss_inputs

pytestmark = pytest.mark.skipif(not rlkernels.backend_info()["triton"]["available"],
                                reason=rlkernels.backend_info()["triton"]["reason"])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The gradient is stored in the logits' dtype, compared with a composition on the same values
# upcast to fp32: bf16 rounding to nearest costs up to half an ulp (2⁻⁸) on top of the 2e-3 of
# docs/design.md §9; the interpreter truncates fp32 → bf16 instead, up to one ulp (2⁻⁷). Entries
# far below the largest (tail tokens) are held to the same tolerance times the largest.
BF16_ROUNDING = 2.0**-8 if torch.cuda.is_available() else 2.0**-7
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3 + BF16_ROUNDING}
# V: 7 (one partial tile), 1000 (two interpreter tiles, the last partial).
VOCABS = [7, 1000]


def _case(name, V, dtype, B=3, T=4):
    seed = sum(map(ord, name)) + V
    inputs = random_loss_inputs(B, T, dtype=torch.float32, noise=0.2, per_token_adv=name in ("ppo", "dapo", "cispo"),
                                seed=seed, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype).to(DEVICE)
    targets = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    config = preset(name, entropy_coef=0.01)
    kw = dict(old_logp=inputs["old_logp"], ref_logp=inputs["ref_logp"], rewards=inputs["rewards"])
    if config.ratio in ("group_expectation", "snis"):
        kw["group_ids"] = inputs["group_ids"]
    return logits, targets, inputs["advantages"], inputs["mask"], config, kw


def _composed(logits, targets, adv, mask, config, kw):
    """Loss, metrics and ∂(2.5·loss)/∂logits of the composition, on the logits upcast to fp32."""
    y = logits.float().requires_grad_(True)
    logp, ent = rlkernels.token_logprobs(y, targets, temperature=0.8, return_entropy=True, backend="torch")
    out = rlkernels.policy_loss(logp, adv, mask, config, entropy=ent, **kw)
    (2.5 * out.loss).backward()
    return out, y.grad


CASES = [(name, V, dtype) for name in presets.NAMES for V in VOCABS for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("name,V,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_every_preset_equals_the_composition(name, V, dtype):
    logits, targets, adv, mask, config, kw = _case(name, V, dtype)
    x = logits.clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov's random choice of tokens: the same draw on both paths
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.8, backend="triton", **kw)
    (2.5 * fused.loss).backward()
    torch.manual_seed(0)
    composed, grad = _composed(logits, targets, adv, mask, config, kw)

    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-5, atol=1e-7)
    assert x.grad.dtype == dtype
    tol = GRAD_RTOL[dtype]
    torch.testing.assert_close(x.grad.float(), grad, rtol=tol, atol=tol * grad.abs().max().item())
    assert set(fused.metrics) == set(composed.metrics)
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_overwrites_logits_with_the_gradient(dtype):
    logits, targets, adv, mask, config, kw = _case("grpo", 1000, dtype, B=2, T=3)
    y = logits.clone().requires_grad_(True)
    expected = rlkernels.fused_policy_loss(y, targets, adv, mask, config, backend="triton", **kw)
    expected.loss.backward()

    buffer = logits.clone()
    x = buffer.view_as(buffer).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, config, inplace=True, backend="triton", **kw)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)  # same kernel, same values
    assert x.grad.data_ptr() == buffer.data_ptr()  # no second N × V buffer


@pytest.mark.parametrize("name", ["grpo", "cispo", "dro"])
def test_importance_weights_in_the_forward_kernel(name):
    """ω in the Triton forward kernel: the surrogate times ω, its clip flags where ω > 0 (a fifth are 0)."""
    logits, targets, adv, mask, config, kw = _case(name, 33, torch.float32)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) * 1.5
    kw = dict(kw, is_weights=w.masked_fill(w < 0.3, 0.0).to(DEVICE))
    x = logits.clone().requires_grad_(True)
    fused = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.8, backend="triton", **kw)
    (2.5 * fused.loss).backward()
    composed, grad = _composed(logits, targets, adv, mask, config, kw)
    # a clone: for fp32 logits `_composed`'s leaf is the logits themselves, whose .grad would accumulate
    unweighted, _ = _composed(logits.detach().clone(), targets, adv, mask, config,
                              {k: v for k, v in kw.items() if k != "is_weights"})
    assert not torch.allclose(unweighted.loss, composed.loss), "the weights change the loss"
    torch.testing.assert_close(fused.loss, composed.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())
    for key in composed.metrics:
        torch.testing.assert_close(fused.metrics[key], composed.metrics[key], rtol=1e-5, atol=1e-7, msg=key)
