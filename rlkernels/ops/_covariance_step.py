"""Clip-Cov and KL-Cov at given log-probs: the call's choice of tokens, then one pass of `policy_token_loss`.

Both objectives couple every token of the call: the covariance of A and ℓ takes batch means, and
k tokens are chosen by it (docs/math.md §5), so the fused forward kernel cannot evaluate them
while it reads a row. Once it has given every ℓ, the choice is a few `(N,)`-sized ops (the
functions of `losses/surrogates.py` that the spec uses), and the loss is per token again:

* Clip-Cov: PPO's clip with A = 0 on the chosen tokens (loss 0, no gradient), evaluated with the
  KL and entropy terms by one call; the chosen tokens count as clipped on A's side.
* KL-Cov: −A·w (the clip objective without bounds) with the KL and entropy terms by one call, plus
  kl_cov_coef·|ℓ − ℓ_old| on the chosen tokens.

Importance weights ω enter as for the other token-level losses (ω·A; the penalty times ω).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..losses import PolicyLossConfig
from ..losses.aggregation import aggregation_weights
from ..losses.inputs import LossInputs
from ..losses.surrogates import clip_cov_tokens, kl_cov_tokens
from ._token_stats import loss_from_stats
from .token_loss_params import covariance_params, covariance_supports


def evaluates(kernels, config: PolicyLossConfig) -> bool:
    """Whether `covariance_step` takes this config with these kernels."""
    return hasattr(kernels, "policy_token_loss") and covariance_supports(config)


def covariance_step(kernels, logp: Tensor, entropy: Tensor, inputs: LossInputs, config: PolicyLossConfig):
    """(the loss and metrics, ∂loss/∂ℓ flat, ∂loss/∂H flat or None) at flat `(N,)` log-probs and entropies."""
    mask, adv, old = inputs.mask, inputs.adv, inputs.old_logp
    B, T = mask.shape
    x = logp.view(B, T)
    log_ratio = None if old is None else x - old  # on-policy: 0, w = 1
    omega = None if inputs.is_weights is None else torch.where(mask, inputs.is_weights, 0.0)
    if config.objective == "clip_cov":
        c = config.log_ratio_clamp
        w = torch.ones_like(x) if log_ratio is None else torch.exp(log_ratio.clamp(-c, c))
        chosen = clip_cov_tokens(w, adv, x, mask, config)
        surrogate_adv = torch.where(chosen, 0.0, adv)
    else:
        chosen = kl_cov_tokens(adv, x, mask, config)
        surrogate_adv = adv
    if omega is not None:
        surrogate_adv = surrogate_adv * omega
    weights = aggregation_weights(mask, config.agg, num_items=inputs.num_items, num_seqs=inputs.num_seqs,
                                  norm_length=config.norm_length, dtype=logp.dtype)
    grad, grad_h, stats = kernels.policy_token_loss(
        logp, entropy, mask.reshape(-1), weights.view(-1), surrogate_adv.reshape(-1).contiguous(),
        inputs.flat("old_logp"), inputs.flat("ref_logp"), covariance_params(config))

    sums = stats.sum(0)
    counted = chosen if omega is None else chosen & (omega > 0)
    if config.objective == "clip_cov":  # the chosen tokens are clipped on A's side (docs/math.md §10)
        flags = torch.stack([counted & (adv < 0), counted & (adv > 0)]).sum((1, 2)).to(sums.dtype)
        sums = torch.cat([sums[:1], sums[1:3] + flags, sums[3:]])
    elif log_ratio is not None and config.kl_cov_coef != 0:  # + coef·|ℓ − ℓ_old| on the chosen tokens
        scale = config.kl_cov_coef * (weights if omega is None else weights * omega)
        # torch.where, not a product: the padding's log-ratio may be NaN or inf
        grad = grad + torch.where(chosen, scale * torch.sign(log_ratio), 0.0).reshape(-1)
        sums = torch.cat([sums[:1] + torch.where(chosen, scale * log_ratio.abs(), 0.0).sum(), sums[1:]])
    grad_h = grad_h if config.entropy_coef != 0 else None
    return loss_from_stats(stats, inputs, sums), grad, grad_h
