"""docs/integrations.md's snippets for plain PyTorch and `transformers`, run as written, against the plain
composition: `model(...).logits` → log_softmax → gather → `policy_loss`. (The TRL and verl snippets are run by
test_integration_trl.py and test_integration_verl.py; the README's quick starts by test_readme_quickstart.py.)"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from doc_blocks import block  # noqa: E402
from rlkernels import presets  # noqa: E402


def _setup(B=4, P=3, C=6, V=89):
    """A tiny untied Llama, left-padded prompts of P tokens, C completion tokens with ragged masks."""
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # far from uniform
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, (B, P + C), generator=g)
    attention_mask = torch.ones(B, P + C, dtype=torch.long)
    attention_mask[0, :2] = 0
    completion_mask = torch.arange(C)[None] < torch.tensor([6, 4, 1, 5])[:, None]
    old_logp = _eager_logp(model, input_ids, attention_mask, C, 0.7).detach() + 0.3 * torch.randn(B, C, generator=g)
    ref_logp = old_logp + 0.1 * torch.randn(B, C, generator=g)
    advantages = torch.randn(B, generator=g)
    return dict(model=model, input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
                completion_len=C, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages)


def _eager_logp(model, ids, am, C, temperature, entropy=False):
    logits = model(input_ids=ids, attention_mask=am).logits[:, -C - 1 : -1] / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, -C:, None]).squeeze(-1)
    return (logp, -(logp_all.exp() * logp_all).sum(-1)) if entropy else logp


def _run(name, ns):
    exec(block(name, "docs/integrations.md"), ns)
    return ns["out"], {n: p.grad.clone() for n, p in ns["model"].named_parameters() if p.grad is not None}


def _check(ours, grads, ref, model):
    assert ref.loss.abs() > 1e-4
    torch.testing.assert_close(ours.loss, ref.loss, rtol=1e-5, atol=1e-6)
    model.zero_grad()
    ref.loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_plain_pytorch_block():
    ns = _setup()
    ours, grads = _run("torch", ns)
    logp = _eager_logp(ns["model"], ns["input_ids"], ns["attention_mask"], ns["completion_len"], 0.7)
    ref = rlkernels.policy_loss(logp, ns["advantages"], ns["completion_mask"], presets.dapo(), old_logp=ns["old_logp"])
    assert ref.metrics["clip_frac"] > 0
    _check(ours, grads, ref, ns["model"])


def test_transformers_block():
    ns = _setup()
    ours, grads = _run("transformers", ns)
    logp, ent = _eager_logp(ns["model"], ns["input_ids"], ns["attention_mask"], ns["completion_len"], 0.7, entropy=True)
    ref = rlkernels.policy_loss(logp, ns["advantages"], ns["completion_mask"], presets.grpo(),
                                old_logp=ns["old_logp"], ref_logp=ns["ref_logp"], entropy=ent)
    _check(ours, grads, ref, ns["model"])
