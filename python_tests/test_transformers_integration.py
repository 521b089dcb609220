"""`causal_lm_token_logprobs` equals log_softmax(model(input_ids).logits) on tiny models built from
configs (nothing downloaded), in value and in the gradients of every parameter."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlkernels.integrations.transformers import causal_lm_token_logprobs  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _model(kind, **overrides):
    cfg = getattr(transformers, f"{kind}Config")(**dict(SMALL, **overrides))
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).float()
    with torch.no_grad():  # a random head large enough that the log-probs are far from uniform
        model.get_output_embeddings().weight.mul_(30)
    return model


def _batch(B=3, T=9, V=97):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as RL rollouts have
    return ids, mask


def _eager(model, ids, mask, temperature, keep):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1] / temperature
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp[:, -keep:] if keep else logp


@pytest.mark.parametrize("kind,overrides", [
    ("Llama", dict(tie_word_embeddings=False)),
    ("Llama", dict(tie_word_embeddings=True)),
    ("Qwen2", dict(tie_word_embeddings=True)),
    ("Cohere", dict(logit_scale=0.5, tie_word_embeddings=True)),  # logits · 0.5, folded into τ
    ("Granite", dict(logits_scaling=4.0)),  # logits / 4, folded into τ
    ("Gemma2", dict(head_dim=4, final_logit_softcapping=5.0)),  # 5·tanh(z/5): the kernels' softcap; it binds here
])
@pytest.mark.parametrize("keep", [None, 3])
def test_matches_the_model_logits(kind, overrides, keep):
    model = _model(kind, **overrides)
    ids, mask = _batch()
    weights = torch.randn(3, 8 if keep is None else keep)

    ours = causal_lm_token_logprobs(model, ids, mask, logits_to_keep=keep, temperature=0.9, chunk_size=5)
    (ours * weights).sum().backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    eager = _eager(model, ids, mask, 0.9, keep)
    (eager * weights).sum().backward()

    assert ours.shape == eager.shape
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours_grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_entropy():
    model = _model("Llama")
    ids, mask = _batch()
    _, ent = causal_lm_token_logprobs(model, ids, mask, return_entropy=True)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    ref = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(ent, ref, rtol=1e-5, atol=1e-5)


def test_the_cap_matters_and_a_cap_with_a_scale_is_refused():
    model = _model("Gemma2", head_dim=4, final_logit_softcapping=5.0)
    ids, mask = _batch()
    capped = causal_lm_token_logprobs(model, ids, mask)
    model.config.final_logit_softcapping = None
    assert (causal_lm_token_logprobs(model, ids, mask) - capped).abs().max() > 1.0
    model.config.final_logit_softcapping, model.config.logit_scale = 5.0, 2.0  # which comes first is not said
    with pytest.raises(ValueError, match="logit_scale with a final-logit cap"):
        causal_lm_token_logprobs(model, ids, mask)


def test_bad_arguments():
    model = _model("Llama")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        causal_lm_token_logprobs(model, ids, mask, logits_to_keep=9)
    with pytest.raises(ValueError, match="input_ids"):
        causal_lm_token_logprobs(model, ids[:, :1], mask[:, :1])


class _TransformedLlama(transformers.LlamaForCausalLM):
    """A head that changes its logits in `forward` with no config attribute saying so (as BERT-style
    prediction-head transforms or an unannounced cap do)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 20 * torch.tanh(out.logits / 20)
        return out


def test_an_unannounced_logit_transform_is_refused_naming_the_model():
    model = _TransformedLlama(transformers.LlamaConfig(**SMALL))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    model.train()
    with pytest.raises(ValueError, match="_TransformedLlama.*'llama'.*nats away"):
        causal_lm_token_logprobs(model, *_batch())
    assert model.training  # the check's eval mode is undone


def test_the_head_check_runs_once_per_model_class():
    model = _model("Qwen2")
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))  # model(...) is only called by the check
    ids, mask = _batch()
    causal_lm_token_logprobs(model, ids, mask)
    causal_lm_token_logprobs(_model("Qwen2"), ids, mask)
    assert len(calls) <= 1
