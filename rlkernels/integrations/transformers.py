"""Per-token log-probs of a Hugging Face causal LM from its hidden states, without its logits.

`causal_lm_token_logprobs(model, input_ids, attention_mask)` runs the model's backbone (the
decoder, whose last hidden state is taken after the final norm), shifts by one (position t
scores token t + 1) and applies `rlkernels.linear_token_logprobs` with the output embedding's
weight and bias (tied to the input embedding or not). The `(B, T, V)` logits of
`model(input_ids).logits` are never formed.

Output transforms: a model whose head does more than `hidden @ W.T + b` needs care. A positive
scalar on the logits (Cohere's `logit_scale`, Granite's `logits_scaling`) is folded into the
temperature, which is exact; anything else the config announces (`final_logit_softcapping` of
Gemma 2/3, `lm_head_multiplier`, `output_multiplier`, ...) is rejected with a ValueError that
names the attribute. Models that transform the logits without a config attribute cannot be
detected here.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import linear_token_logprobs

# config attribute → how it enters the logits: "mul"/"div" by a scalar (folded into τ), or rejected.
_SCALES = {"logit_scale": "mul", "logits_scaling": "div"}
_REJECTED = ("final_logit_softcapping", "lm_head_multiplier", "output_multiplier", "output_logits_scaling")


def _configs(config):
    """The config and its text config (multimodal models keep the language model's there)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (config,) if text is config else (config, text)


def output_temperature(config, temperature: float) -> float:
    """The temperature to apply to `hidden @ W.T + b` so that it equals the model's own logits / τ."""
    for cfg in _configs(config):
        for attr in _REJECTED:
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"model.config.{attr}={getattr(cfg, attr)!r}: this model transforms its logits in a way "
                    "the hidden-state path does not reproduce; use token_logprobs on model(...).logits instead"
                )
        for attr, op in _SCALES.items():
            scale = getattr(cfg, attr, None)
            if scale is None or scale == 1:
                continue
            if not isinstance(scale, (int, float)) or scale <= 0:
                raise ValueError(f"model.config.{attr}={scale!r}: expected a positive number")
            temperature = temperature / scale if op == "mul" else temperature * scale
    return temperature


def backbone_hidden_states(model, *args, **kwargs):
    """The last hidden states (after the final norm) of a HF causal LM's backbone, without its head."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if decoder is None or decoder is model:
        raise ValueError(f"model: cannot find the backbone of {type(model).__name__} (get_decoder() / .model)")
    out = decoder(*args, use_cache=False, **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def causal_lm_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    logits_to_keep: Optional[int] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: Optional[str] = None,
    chunk_size: Optional[int] = None,
):
    """Log-probs `(B, T − 1)` of `input_ids[:, 1:]` under `model`, (and the entropy) from hidden states.

    Equals `log_softmax(model(input_ids, attention_mask).logits[:, :-1] / temperature)` gathered at
    `input_ids[:, 1:]`. `logits_to_keep=k`: only the last k of those positions, `(B, k)`
    (scoring `input_ids[:, -k:]`). Differentiable w.r.t. the model's parameters.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids: expected shape (B, T) with T >= 2, got {tuple(getattr(input_ids, 'shape', ()))}")
    T = input_ids.shape[1]
    keep = T - 1 if logits_to_keep is None else logits_to_keep
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= T - 1:
        raise ValueError(f"logits_to_keep: expected an int in [1, {T - 1}] (T − 1 scored positions), got {logits_to_keep!r}")
    temperature = output_temperature(model.config, temperature)
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"model.get_output_embeddings(): expected an nn.Linear head, got {type(head).__name__}")
    hidden = backbone_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask)
    hidden = hidden[:, T - 1 - keep : T - 1].to(head.weight.dtype)  # position t scores token t + 1
    return linear_token_logprobs(hidden, head.weight, input_ids[:, T - keep :], bias=head.bias, temperature=temperature,
                                 return_entropy=return_entropy, backend=backend, chunk_size=chunk_size)
