"""The loss around the kernels, shared by the logits path and the hidden-state path.

Token-level (`kernel_inputs`, and `loss_from_stats` of `_token_stats`): the flat per-token inputs and
parameters of `policy_token_fwd`, and the loss and metrics from its statistics. Any ratio (`row_grads`): the
loss at the kernel's log-probs and entropy and its derivatives, by `_sequence_step` where it
takes the ratio, by `_covariance_step` for Clip-Cov and KL-Cov, else by the `(B, T)` loss of
`losses/` and its autograd.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..losses import LossOutput, PolicyLossConfig
from ..losses.spec import LossInputs, aggregation_weights, evaluate, high_entropy_tokens, separate_entropy_bonus
from ._covariance_step import covariance_step
from ._plan import Step, plan
from ._sequence_step import sequence_step
from .kernel_params import token_loss_params


def kernel_inputs(inputs: LossInputs, config: PolicyLossConfig):
    """([mask, weight, adv, old_logp, ref_logp, is_weights] flat `(N,)`, `TokenLossParams`) for `policy_token_fwd`."""
    weights = aggregation_weights(inputs.mask, config.agg, num_items=inputs.num_items, num_seqs=inputs.num_seqs,
                                  norm_length=config.norm_length, dtype=inputs.dtype).view(-1)
    per_row = [inputs.mask.reshape(-1), weights, inputs.flat("adv"), inputs.flat("old_logp"), inputs.flat("ref_logp"),
               inputs.flat("is_weights")]
    return per_row, token_loss_params(config)


def entropy_bonus_grad(inputs: LossInputs, config: PolicyLossConfig, dtype,
                       high_entropy: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """∂/∂H flat `(N,)` of an entropy bonus aggregated apart from the loss (`entropy_agg="token_mean"`: −c_H
    over the count of the tokens it acts on: the call's masked tokens, or with `top_entropy_quantile` the
    `high_entropy` ones (`high_entropy_tokens`; the kernel paths never take that option)), or None when the
    bonus is in each token's loss (the kernels' term)."""
    if not separate_entropy_bonus(config):
        return None
    mask = (inputs.mask if high_entropy is None else high_entropy).reshape(-1)
    return torch.where(mask, -config.entropy_coef / mask.sum().clamp(min=1).to(dtype), 0.0)


def add_entropy_bonus(out: LossOutput, bonus_grad: torch.Tensor, entropy: torch.Tensor, inputs: LossInputs):
    """`out` with the value Σ (∂/∂H)·H of an entropy bonus aggregated apart from the loss added."""
    value = (bonus_grad * torch.where(inputs.mask.reshape(-1), entropy, 0.0)).sum()  # padding may hold NaN
    return LossOutput(out.loss + value, out.metrics)


def with_entropy_bonus(out: LossOutput, grad_h, entropy: torch.Tensor, inputs: LossInputs, config: PolicyLossConfig,
                       high_entropy: Optional[torch.Tensor] = None):
    """(out, ∂loss/∂H) with an entropy bonus aggregated apart from the loss added, which the kernels left out
    (`high_entropy`: as `entropy_bonus_grad`)."""
    bonus_grad = entropy_bonus_grad(inputs, config, entropy.dtype, high_entropy)
    if bonus_grad is None:
        return out, grad_h
    return add_entropy_bonus(out, bonus_grad, entropy, inputs), bonus_grad


def row_grads(kernels, logp: torch.Tensor, entropy: torch.Tensor, inputs: LossInputs, config: PolicyLossConfig):
    """(the detached loss and metrics, ∂loss/∂logp flat, ∂loss/∂H flat or None) at flat `(N,)` values: by the
    step `plan` gives once the log-probs are there (`_sequence_step`, `_covariance_step`, or autograd of `losses/`)."""
    step = plan(config, kernels, forward=False).step
    if step is Step.SEQUENCE:
        # once (a sort, and a gather over a process group): the surrogate's weights and the bonus act on them
        high = high_entropy_tokens(entropy.view(inputs.mask.shape), inputs.mask, config, inputs.entropy_quantile_group)
        out, grad, grad_h = sequence_step(kernels, logp, entropy, inputs, config, high)
        out, grad_h = with_entropy_bonus(out, grad_h, entropy, inputs, config, high)
        return out, grad, grad_h
    if step is Step.COVARIANCE:  # never with top_entropy_quantile (covariance_supports)
        out, grad, grad_h = covariance_step(kernels, logp, entropy, inputs, config)
        out, grad_h = with_entropy_bonus(out, grad_h, entropy, inputs, config)
        return out, grad, grad_h
    need_h = config.entropy_coef != 0
    with torch.enable_grad():
        logp_leaf = logp.detach().view(inputs.mask.shape).requires_grad_(True)
        entropy_leaf = entropy.detach().view(inputs.mask.shape).requires_grad_(need_h)
        out = evaluate(logp_leaf, entropy_leaf, inputs, config)
        leaves = (logp_leaf, entropy_leaf) if need_h else (logp_leaf,)
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True, materialize_grads=True)
    return LossOutput(out.loss.detach(), out.metrics), grads[0].reshape(-1), grads[1].reshape(-1) if need_h else None
