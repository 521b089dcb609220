"""The loss around the kernels, one interface for both fused ops: `run_step` evaluates the step `plan`
chose over a `LogitsPass`, the op's pass over the logits (one tensor in one launch per kernel, or the
hidden-state head's chunk loop). The ops differ only in that pass.

* FORWARD (`TokenForward`): the pass runs `policy_token_fwd`, which gives each token's loss, its
  derivatives and statistics while it reads the row; the loss and metrics are the statistics' sums.
* Any other step (`row_grads`): the pass gives ℓ and H of every row; the loss and its derivatives
  come from `_sequence_step`, `_covariance_step` or the autograd of `losses/` on `(B, T)`; the pass
  then owes the gradient from those per-row derivatives.

An entropy bonus aggregated apart from the loss (`entropy_agg="token_mean"`) is added here, outside
the kernels, on every step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from ..losses import LossOutput, PolicyLossConfig, policy_loss
from ..losses.spec import LossInputs, aggregation_weights, evaluate, high_entropy_tokens, separate_entropy_bonus
from ._covariance_step import covariance_step
from ._plan import Step
from ._sequence_step import sequence_step
from ._token_stats import loss_from_stats
from ..kernels.token_loss_params import TokenLossParams
from .kernel_params import token_loss_params


@dataclasses.dataclass(frozen=True)
class TokenForward:
    """What `policy_token_fwd` takes besides the logits: the flat `(N,)` per-token inputs
    `[mask, weight, adv, old_logp, ref_logp, is_weights]` and the packed parameters; and
    `bonus_grad`, ∂/∂H of a bonus apart from the loss (known before the pass), or None."""

    per_row: List[Optional[Tensor]]
    params: TokenLossParams
    bonus_grad: Optional[Tensor]
    need_entropy_grad: bool

    @staticmethod
    def of(inputs: LossInputs, config: PolicyLossConfig) -> "TokenForward":
        weights = aggregation_weights(inputs.mask, config.agg, num_items=inputs.num_items, num_seqs=inputs.num_seqs,
                                      norm_length=config.norm_length, dtype=inputs.dtype).view(-1)
        per_row = [inputs.mask.reshape(-1), weights, inputs.flat("adv"), inputs.flat("old_logp"),
                   inputs.flat("ref_logp"), inputs.flat("is_weights")]
        return TokenForward(per_row, token_loss_params(config), entropy_bonus_grad(inputs, config, inputs.dtype),
                            config.entropy_coef != 0)

    @property
    def dtype(self) -> torch.dtype:
        """The accumulation dtype (the aggregation weights')."""
        return self.per_row[1].dtype

    def entropy_grad(self, kernel_grad: Tensor, s: int = 0, e: Optional[int] = None) -> Optional[Tensor]:
        """∂loss/∂H of rows s:e for the backward kernel: the kernel's, the bonus's, or None (no entropy term)."""
        if not self.need_entropy_grad:
            return None
        return kernel_grad if self.bonus_grad is None else self.bonus_grad[s:e]

    def loss(self, stats: Tensor, entropy: Tensor, inputs: LossInputs) -> LossOutput:
        out = loss_from_stats(stats, inputs)
        return out if self.bonus_grad is None else add_entropy_bonus(out, self.bonus_grad, entropy, inputs)


class LogitsPass(Protocol):
    """A fused op's pass over its logits, with the backend's kernels (`kernels`)."""

    kernels: object

    def fused(self, forward: TokenForward) -> Tuple[Tensor, Tensor, Tensor]:
        """(ℓ, H, statistics) of every row by `policy_token_fwd`; the pass owes the gradient it gives."""

    def logprobs(self) -> Tuple[Tensor, Tensor]:
        """(ℓ, H) of every row, flat `(N,)`."""

    def backward(self, grad_logp: Tensor, grad_entropy: Optional[Tensor]) -> None:
        """The gradient from per-row derivatives ∂loss/∂ℓ and ∂loss/∂H (or None), flat `(N,)`."""


def run_step(logits_pass: LogitsPass, step: Step, inputs: LossInputs, config: PolicyLossConfig):
    """(the detached loss and metrics, ℓ, H) of `config` by `step` over `logits_pass`, which then holds the gradient."""
    if step is Step.FORWARD:
        forward = TokenForward.of(inputs, config)
        logp, entropy, stats = logits_pass.fused(forward)
        return forward.loss(stats, entropy, inputs), logp, entropy
    logp, entropy = logits_pass.logprobs()
    out, grad_logp, grad_entropy = row_grads(step, logits_pass.kernels, logp, entropy, inputs, config)
    logits_pass.backward(grad_logp, grad_entropy)
    return out, logp, entropy


def composed(logprobs: Callable[[], Tuple[Tensor, Tensor]], advantages, mask, config: PolicyLossConfig,
             loss_args) -> LossOutput:
    """The definition, `policy_loss` at `logprobs()` = (ℓ, H): what a fused op computes where its step would
    pay for a gradient nobody asks for, and under `torch.compile` (the custom ops trace)."""
    logp, entropy = logprobs()
    out = policy_loss(logp, advantages, mask, config, entropy=entropy, **loss_args)
    return LossOutput(out.loss, out.metrics, logp.detach(), entropy.detach())


def entropy_bonus_grad(inputs: LossInputs, config: PolicyLossConfig, dtype,
                       high_entropy: Optional[Tensor] = None) -> Optional[Tensor]:
    """∂/∂H flat `(N,)` of an entropy bonus aggregated apart from the loss (`entropy_agg="token_mean"`: −c_H
    over the count of the tokens it acts on: the call's masked tokens, or with `top_entropy_quantile` the
    `high_entropy` ones (`high_entropy_tokens`; the forward kernel never takes that option)), or None when
    the bonus is in each token's loss (the kernels' term)."""
    if not separate_entropy_bonus(config):
        return None
    mask = (inputs.mask if high_entropy is None else high_entropy).reshape(-1)
    return torch.where(mask, -config.entropy_coef / mask.sum().clamp(min=1).to(dtype), 0.0)


def add_entropy_bonus(out: LossOutput, bonus_grad: Tensor, entropy: Tensor, inputs: LossInputs) -> LossOutput:
    """`out` with the value Σ (∂/∂H)·H of an entropy bonus aggregated apart from the loss added."""
    value = (bonus_grad * torch.where(inputs.mask.reshape(-1), entropy, 0.0)).sum()  # padding may hold NaN
    return LossOutput(out.loss + value, out.metrics)


def _with_entropy_bonus(out: LossOutput, grad_h, entropy: Tensor, inputs: LossInputs, config: PolicyLossConfig,
                        high_entropy: Optional[Tensor] = None):
    """(out, ∂loss/∂H) with an entropy bonus aggregated apart from the loss added, which the kernels left out."""
    bonus_grad = entropy_bonus_grad(inputs, config, entropy.dtype, high_entropy)
    if bonus_grad is None:
        return out, grad_h
    return add_entropy_bonus(out, bonus_grad, entropy, inputs), bonus_grad


def row_grads(step: Step, kernels, logp: Tensor, entropy: Tensor, inputs: LossInputs, config: PolicyLossConfig):
    """(the detached loss and metrics, ∂loss/∂ℓ flat, ∂loss/∂H flat or None) at flat `(N,)` values by `step`:
    `_sequence_step`, `_covariance_step`, or the autograd of `losses/`."""
    if step is Step.SEQUENCE:
        # once (a sort, and a gather over a process group): the surrogate's weights and the bonus act on them
        high = high_entropy_tokens(entropy.view(inputs.mask.shape), inputs.mask, config, inputs.entropy_quantile_group)
        out, grad, grad_h = sequence_step(kernels, logp, entropy, inputs, config, high)
        out, grad_h = _with_entropy_bonus(out, grad_h, entropy, inputs, config, high)
        return out, grad, grad_h
    if step is Step.COVARIANCE:  # never with top_entropy_quantile (`_plan`)
        out, grad, grad_h = covariance_step(kernels, logp, entropy, inputs, config)
        out, grad_h = _with_entropy_bonus(out, grad_h, entropy, inputs, config)
        return out, grad, grad_h
    need_h = config.entropy_coef != 0
    with torch.enable_grad():
        logp_leaf = logp.detach().view(inputs.mask.shape).requires_grad_(True)
        entropy_leaf = entropy.detach().view(inputs.mask.shape).requires_grad_(need_h)
        out = evaluate(logp_leaf, entropy_leaf, inputs, config)
        leaves = (logp_leaf, entropy_leaf) if need_h else (logp_leaf,)
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True, materialize_grads=True)
    return LossOutput(out.loss.detach(), out.metrics), grads[0].reshape(-1), grads[1].reshape(-1) if need_h else None
