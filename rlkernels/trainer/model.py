"""The policy as the trainer reads it: the loss head (the one place the policy loss is called), the trunk's
hidden states, log-probs at the sampling temperature, PPO's critic, and LoRA adapters on the policy."""
from __future__ import annotations

import copy

import torch
from torch import nn

import rlkernels

from ..integrations.transformers import check_head, output_head


# ----------------------------------------------------------------------------------------------
# The loss head: the ONE place the policy loss is called. Switching to the hidden-state path is
# the commented line below (it takes `hidden` and the lm_head weight instead of the logits).

def loss_head(model, hidden, batch, loss_cfg, *, num_items, num_seqs, head_args, path="fused"):
    """Policy loss of `loss_cfg` on the completion positions `hidden (b, T, H)`; a LossOutput.

    Under autocast the head runs at the autocast dtype (bfloat16 hidden states and weight, or
    logits, go into the ops), and the ops themselves run outside it: they accumulate in float32.
    `head_args`: the temperature and soft cap that make `lm_head(hidden)` the model's logits (`output_head_of`)."""
    head = parts(model)[1]
    kw = dict(old_logp=batch["old_logp"], ref_logp=batch["ref_logp"], group_ids=batch["group_ids"],
              rewards=batch["rewards"], num_items=num_items, num_seqs=num_seqs)
    if path == "linear":  # from the hidden states: the (b, T, V) logits never exist (docs/design.md §4)
        h, weight, bias = _head_inputs(head, hidden)
        with _no_autocast(hidden):
            return rlkernels.fused_linear_policy_loss(h, weight, batch["targets"], batch["advantages"], batch["mask"],
                                                      loss_cfg, bias=bias, **head_args, **kw)
    logits = head(hidden)
    with _no_autocast(hidden):
        if path == "split":
            logp, entropy = rlkernels.token_logprobs(logits, batch["targets"], **head_args, return_entropy=True)
            return rlkernels.policy_loss(logp, batch["advantages"], batch["mask"], loss_cfg, entropy=entropy, **kw)
        return rlkernels.fused_policy_loss(logits, batch["targets"], batch["advantages"], batch["mask"], loss_cfg,
                                           **head_args, **kw)


def _head_inputs(head, hidden):
    """(hidden, weight, bias) for the hidden-state ops, in the one dtype they take: the head's matmul dtype here
    (autocast's when it is on, else hidden's own)."""
    on = torch.is_autocast_enabled(hidden.device.type)
    dtype = torch.get_autocast_dtype(hidden.device.type) if on else hidden.dtype
    return hidden.to(dtype), head.weight.to(dtype), head.bias.to(dtype) if head.bias is not None else None


def _no_autocast(x):
    """The rlkernels ops pick their own precision: autocast must not recast the matmuls inside them."""
    return torch.autocast(x.device.type, enabled=False)


# ----------------------------------------------------------------------------------------------
# Model plumbing

def parts(model):
    """(trunk, lm_head) of a HF causal LM, seen through a peft wrapper (adapters stay active)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def hidden_states(trunk, seq, attn):
    """Last hidden states (B, S, H); positions count only attended tokens (as `generate` does)."""
    if not len(seq):  # no rows (dynamic sampling kept no group): HF attention cannot reshape an empty batch, so
        # one padding row runs and is dropped; every layer still runs, as FSDP's per-layer collectives need on every rank
        return hidden_states(trunk, seq.new_zeros(1, seq.shape[1]), attn.new_ones(1, attn.shape[1]))[:0]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return trunk(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state


def enable_checkpointing(model) -> None:
    """`--gradient-checkpointing`: Hugging Face's, non-reentrant (torch's recommended form; the reentrant
    one needs inputs that require grad, which frozen embeddings under LoRA are not)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Critic(nn.Module):
    """PPO value model: a zero-initialised linear head on the actor's trunk (`shared`, a "hydra"
    head, gradients of the value loss reach the trunk) or on its own copy of it (`separate`)."""

    def __init__(self, trunk: nn.Module, hidden_size: int, separate: bool):
        super().__init__()
        self.trunk = copy.deepcopy(trunk) if separate else None
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, actor_hidden, seq, attn, P):
        h = actor_hidden if self.trunk is None else hidden_states(self.trunk, seq, attn)[:, P - 1:-1]
        return self.head(h).squeeze(-1).float()


def output_head_of(model, temperature: float, place) -> dict:
    """`{"temperature", "softcap"}` with which the ops make `lm_head(trunk(...))` the log-probs `generate` samples
    from at `temperature`.

    The trainer reads the trunk and the head directly while `generate` samples through the model's forward:
    a scale the config announces (Cohere's `logit_scale`, Granite's `logits_scaling`) is folded into the
    temperature, an announced final-logit cap (Gemma 2/3) is the ops' `softcap`, and anything else the forward
    does to its logits is caught by the integration's head check (a few tokens both ways) before any training.
    Draws no random numbers."""
    head_args = output_head(model.config, temperature)
    ids = (torch.arange(16, device=place.device) % model.config.vocab_size)[None]
    with place.autocast():
        check_head(model, ids, torch.ones_like(ids), lambda i, m: token_logp(model, i, m, 1, head_args)[0],
                   temperature)
    return head_args


@torch.no_grad()
def token_logp(model, seq, attn, P, head_args):
    """log π(y_t | y_<t) / τ-softmax of the completion tokens seq[:, P:], and the hidden states (`head_args`:
    `output_head_of`'s). From the hidden states, as the update's default path: the (B, T, V) logits never exist
    (at V = 152k they were the behaviour pass's peak)."""
    trunk, head = parts(model)
    h = hidden_states(trunk, seq, attn)[:, P - 1:-1]
    x, weight, bias = _head_inputs(head, h)  # as loss_head's
    with _no_autocast(h):
        return rlkernels.linear_token_logprobs(x, weight, seq[:, P:], bias=bias, **head_args), h


def add_lora(model, rank: int, alpha: float, target: str = "all-linear", **options):
    """Wrap `model` in peft LoRA adapters on `target`: "all-linear" (every linear layer but the head, for
    any architecture) or comma-separated module names; `options`: more of LoraConfig's (lora_dropout,
    target_parameters, modules_to_save, use_rslora, use_dora)."""
    from peft import LoraConfig, get_peft_model  # run_config.validate has checked that it is installed
    targets = target if target == "all-linear" else [t.strip() for t in target.split(",") if t.strip()]
    options = {k: v for k, v in options.items() if v not in ([], None)}
    try:
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, **options))
    except ValueError as e:  # e.g. no module of that name in this model
        raise ValueError(f"--lora-target: {e}") from None
