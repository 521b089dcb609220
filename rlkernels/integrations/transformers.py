"""Per-token log-probs of a Hugging Face causal LM from its hidden states, without its logits.

`causal_lm_token_logprobs(model, input_ids, attention_mask)` runs the model's backbone (the
decoder, whose last hidden state is taken after the final norm), shifts by one (position t
scores token t + 1) and applies `rlkernels.linear_token_logprobs` with the output embedding's
weight and bias (tied to the input embedding or not). The `(B, T, V)` logits of
`model(input_ids).logits` are never formed.

Output transforms: a model whose head does more than `hidden @ W.T + b` needs care. A positive
scalar on the logits (Cohere's `logit_scale`, Granite's `logits_scaling`) is folded into the
temperature, which is exact; a final-logit cap c·tanh(z/c) (`final_logit_softcapping` of Gemma 2
and 3, RecurrentGemma's `logits_soft_cap`, xLSTM's `output_logit_soft_cap`) is the kernels' own
`softcap`; anything else the config announces (`lm_head_multiplier`, `output_multiplier`, a cap
together with a scale, ...) is rejected with a ValueError that names the attribute. A model that transforms its logits without a config attribute saying so
(a prediction-head transform, a cap or a multiplier in its own `forward`) is caught by
`check_head`: once per model class, on first use, a few tokens' log-probs through the hidden
states are compared with `log_softmax(model(...).logits)`, and a mismatch raises, naming the
model's type.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, Optional

import torch

from ..ops import linear_token_logprobs

_CHECK_TOKENS = 16  # the tokens of one row that `check_head` scores both ways
_checked = set()  # model classes whose hidden-state log-probs matched their logits
_check_lock = threading.Lock()

# config attribute → how it enters the logits: "mul"/"div" by a scalar (folded into τ), a cap c·tanh(z/c),
# or rejected.
_SCALES = {"logit_scale": "mul", "logits_scaling": "div"}
_CAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_REJECTED = ("lm_head_multiplier", "output_multiplier", "output_logits_scaling")


def _configs(config):
    """The config and its text config (multimodal models keep the language model's there)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (config,) if text is config else (config, text)


def output_head(config, temperature: float) -> dict:
    """`{"temperature": τ', "softcap": c or None}`: the arguments of the rlkernels ops that make
    `hidden @ W.T + b` the model's own logits / τ."""
    softcap, scaled = None, []
    for cfg in _configs(config):
        for attr in _REJECTED:
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"model.config.{attr}={getattr(cfg, attr)!r}: this model transforms its logits in a way "
                    "the hidden-state path does not reproduce; use token_logprobs on model(...).logits instead"
                )
        for attr in _CAPS:
            cap = getattr(cfg, attr, None)
            if cap is None:
                continue
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
                raise ValueError(f"model.config.{attr}={cap!r}: expected a positive number (or None)")
            softcap = float(cap)
        for attr, op in _SCALES.items():
            scale = getattr(cfg, attr, None)
            if scale is None or scale == 1:
                continue
            if not isinstance(scale, (int, float)) or scale <= 0:
                raise ValueError(f"model.config.{attr}={scale!r}: expected a positive number")
            temperature = temperature / scale if op == "mul" else temperature * scale
            scaled.append(attr)
    if softcap is not None and scaled:  # where the scale sits relative to the cap is not announced
        raise ValueError(f"model.config.{scaled[0]} with a final-logit cap: the order of the two is not known here; "
                         "use token_logprobs on model(...).logits instead")
    return {"temperature": temperature, "softcap": softcap}


def check_head(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
               hidden_state_logprobs: Callable, temperature: float = 1.0, logits: Optional[Callable] = None) -> None:
    """Once per class of `model`, on its first use: `hidden_state_logprobs(ids, mask)` (the caller's
    own hidden-state path, log-probs `(1, t − 1)` of `ids[:, 1:]`) against
    `log_softmax(logits(ids, mask) / temperature)` (default: `model(ids, mask).logits`; a wrapper's
    forward when the model is wrapped) on up to 16 real tokens of the batch's longest row, in eval
    mode without gradients. Raises ValueError naming the model's type when they differ by more than
    rounding: its head does more than the hidden-state path reproduces."""
    cls = type(model)
    if cls in _checked:
        return
    ids, mask = _check_tokens(input_ids, attention_mask)
    if ids is None:  # fewer than two real tokens: nothing to score yet
        return
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            full = logits(ids, mask) if logits is not None else model(input_ids=ids, attention_mask=mask).logits
            expected = torch.log_softmax(full[:, :-1].float() / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            got = hidden_state_logprobs(ids, mask).float()
    finally:
        model.train(training)
    # fp32 agrees to rounding; a half-precision model's logits are rounded to 2^-8 of their size first
    half = (model.get_output_embeddings().weight.dtype in (torch.float16, torch.bfloat16)
            or torch.is_autocast_enabled(ids.device.type))
    tolerance = 0.25 if half else 1e-3
    gap = float((got - expected).abs().max())
    if not gap <= tolerance:
        raise ValueError(
            f"model: {cls.__name__} (model_type {getattr(model.config, 'model_type', '?')!r}) gives log-probs "
            f"{gap:.3g} nats away from log_softmax(model(...).logits) through its hidden states and output "
            "embedding: its forward transforms the logits in a way the hidden-state path does not reproduce; "
            "use token_logprobs on model(...).logits instead")
    with _check_lock:
        _checked.add(cls)


def _check_tokens(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]):
    """(ids (1, t), mask (1, t) of ones): up to `_CHECK_TOKENS` consecutive real tokens of the longest row,
    or (None, None) when no row has two."""
    if attention_mask is None:
        ids = input_ids[:1, :_CHECK_TOKENS]
    else:
        real = attention_mask.bool()
        row = int(real.sum(-1).argmax())
        where = real[row].nonzero().flatten()
        if where.numel() < 2:
            return None, None
        start = int(where[0])
        ids = input_ids[row : row + 1, start : start + _CHECK_TOKENS]
        ids = ids[:, : int(real[row, start : start + _CHECK_TOKENS].to(torch.int64).cumprod(0).sum())]
    if ids.shape[1] < 2:
        return None, None
    return ids, torch.ones_like(ids)


def backbone_outputs(model, *args, **kwargs):
    """The outputs of a HF causal LM's backbone (its decoder, without the head)."""
    return _backbone(model)(*args, use_cache=False, **kwargs)


def _backbone(model):
    """`get_decoder()`, else `.model`: some classes answer get_decoder() with themselves (Llama 4, Mllama) or
    with their output layer (ModernBERT's decoder), neither of which is the backbone."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for decoder in (model.get_decoder() if hasattr(model, "get_decoder") else None, getattr(model, "model", None)):
        if (decoder is not None and decoder is not model and decoder is not head
                and not isinstance(decoder, torch.nn.Linear)):
            return decoder
    raise ValueError(f"model: cannot find the backbone of {type(model).__name__} (get_decoder() / .model)")


def last_hidden_state(outputs):
    """The last hidden states (after the final norm) in a backbone's outputs."""
    return outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]


def backbone_hidden_states(model, *args, **kwargs):
    """The last hidden states (after the final norm) of a HF causal LM's backbone, without its head."""
    return last_hidden_state(backbone_outputs(model, *args, **kwargs))


def moe_aux_loss_function(model) -> Optional[Callable]:
    """`(router_logits, attention_mask) -> aux_loss`: the load-balancing loss a HF mixture-of-experts causal
    LM forms in its own forward (its module's `load_balancing_loss_func` with its expert counts), or None
    when the model has none that way."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if fn is None or experts is None or top_k is None:
        return None
    return lambda router_logits, attention_mask: fn(router_logits, experts, top_k, attention_mask)


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
    output_head(model.config, temperature)  # rejects an announced transform by name, before any work
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"model.get_output_embeddings(): expected an nn.Linear head, got {type(head).__name__}")
    run = dict(temperature=temperature, backend=backend, chunk_size=chunk_size)
    check_head(model, input_ids, attention_mask, lambda ids, mask: _hidden_state_logprobs(model, ids, mask, **run),
               temperature)
    return _hidden_state_logprobs(model, input_ids, attention_mask, keep, return_entropy=return_entropy, **run)


def _hidden_state_logprobs(model, input_ids, attention_mask, keep=None, *, temperature, return_entropy=False,
                           backend=None, chunk_size=None):
    """Log-probs (and entropy) of the last `keep` tokens of `input_ids` (all but the first by default)."""
    T = input_ids.shape[1]
    keep = T - 1 if keep is None else keep
    head = model.get_output_embeddings()
    hidden = backbone_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask)
    if hidden.shape[-1] != head.weight.shape[1]:
        raise ValueError(f"model: {type(model).__name__}'s backbone gives hidden states of width {hidden.shape[-1]} but "
                         f"its output embedding takes {head.weight.shape[1]}: its head transforms the hidden states "
                         "first; use token_logprobs on model(...).logits instead")
    hidden = hidden[:, T - 1 - keep : T - 1].to(head.weight.dtype)  # position t scores token t + 1
    return linear_token_logprobs(hidden, head.weight, input_ids[:, T - keep :], bias=head.bias,
                                 **output_head(model.config, temperature), return_entropy=return_entropy,
                                 backend=backend, chunk_size=chunk_size)
