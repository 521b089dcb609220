"""`rlkernels.integrations.verl_fused`: verl's fused-kernel log-prob/entropy path through rlkernels.
Compared with verl's own `FusedLinearForPPO` (its torch implementation; the Triton one needs CUDA)
on fresh random inputs, and through verl's patched model forward on a tiny model. Skipped only
when verl cannot be imported."""
from __future__ import annotations

import pytest
import torch

torch_functional = pytest.importorskip("verl.utils.experimental.torch_functional")
import verl.utils.kernel.linear_cross_entropy as verl_kernel  # noqa: E402

from rlkernels.integrations import verl as rk_verl  # noqa: E402
from rlkernels.integrations import verl_fused  # noqa: E402


def _grads(fn, hidden, weight, labels, temperature, g, h):
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    logp, entropy = fn(hidden, weight, labels, temperature)
    (logp.float() * g + entropy.float() * h).sum().backward()
    return logp.detach().float(), entropy.detach().float(), hidden.grad, weight.grad


@pytest.mark.parametrize("shape", [(2, 9), (1, 33)], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_verl_fused_linear_for_ppo(shape, temperature):
    H, V = 24, 301
    hidden = torch.randn(*shape, H)
    weight = torch.randn(V, H) / H ** 0.5 * 3
    labels = torch.randint(0, V, shape)
    g, h = torch.randn(shape), torch.randn(shape)
    ref = _grads(torch_functional.FusedLinearForPPO(chunk_size=4).forward, hidden, weight, labels, temperature, g, h)
    for fn in (verl_fused.FusedLinearForPPO(chunk_size=4).forward, verl_fused.linear_cross_entropy):
        got = _grads(fn, hidden, weight, labels, temperature, g, h)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)  # both fp32, summed in different orders


def test_reduction_other_than_none_is_refused():
    with pytest.raises(ValueError, match="reduction"):
        verl_fused.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.randint(0, 5, (3,)), 1.0, "mean")


def test_patched_model_forward_uses_rlkernels(restore_verl):
    """verl's torch-backend fused forward of a tiny Qwen2 gives the same log-probs and entropies
    before and after `register(fused_kernels=True)` patches it, and after it rlkernels' op is the one called."""
    transformers = pytest.importorskip("transformers")
    dense_common = pytest.importorskip("verl.models.transformers.dense_common")
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 97, (2, 11))

    def forward():
        out = dense_common.forward_with_torch_backend(model, input_ids=input_ids, return_dict=True, temperature=0.8)
        return out.log_probs, out.entropy

    assert torch_functional.FusedLinearForPPO is not verl_fused.FusedLinearForPPO, "verl left patched by a test"
    before = forward()
    rk_verl.register()  # the losses only: verl's kernels stay
    assert torch_functional.FusedLinearForPPO is not verl_fused.FusedLinearForPPO
    rk_verl.register(fused_kernels=True)
    assert torch_functional.FusedLinearForPPO is verl_fused.FusedLinearForPPO
    assert verl_kernel.linear_cross_entropy is verl_fused.linear_cross_entropy
    calls = []
    original = verl_fused.linear_token_logprobs
    verl_fused.linear_token_logprobs = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        after = forward()
    finally:
        verl_fused.linear_token_logprobs = original
    assert calls, "verl's forward did not reach rlkernels"
    for a, b in zip(after, before):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-5, atol=2e-6)
