"""Clip-Cov and KL-Cov at given log-probs: the call's choice of tokens, then one pass of `policy_token_loss`.

Both objectives couple every token of the call: the covariance of A and ℓ takes batch means, and
k tokens are chosen by it (docs/math.md §5), so the fused forward kernel cannot evaluate them
while it reads a row. Once it has given every ℓ, the backend's `covariance_choice` chooses the
tokens in one launch, and the loss is per token again (objectives CLIP_COV and KL_COV of
`policy_token_loss`, which read the choice):

* Clip-Cov: PPO's clip with A = 0 on the chosen tokens (loss 0, no gradient), which count as
  clipped on A's side.
* KL-Cov: −A·w (the clip objective without bounds), plus kl_cov_coef·|ℓ − ℓ_old| on the chosen tokens.

Importance weights ω multiply the surrogate in the kernel, as for the other token-level losses (the penalty
is part of it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..losses import PolicyLossConfig
from ..losses.spec import LossInputs, aggregation_weights, clip_cov_tokens
from ._token_stats import loss_from_stats
from .kernel_params import covariance_choice_params, covariance_params


def covariance_step(kernels, logp: Tensor, entropy: Tensor, inputs: LossInputs, config: PolicyLossConfig):
    """(the loss and metrics, ∂loss/∂ℓ flat, ∂loss/∂H flat or None) at flat `(N,)` log-probs and entropies."""
    mask, adv = inputs.mask.reshape(-1), inputs.flat("adv")
    chosen = _chosen(kernels, logp, mask, adv, inputs, config)
    weights = aggregation_weights(inputs.mask, config.agg, num_items=inputs.num_items, num_seqs=inputs.num_seqs,
                                  norm_length=config.norm_length, dtype=logp.dtype)
    grad, grad_h, stats = kernels.policy_token_loss(
        logp, entropy, mask, weights.view(-1), adv, inputs.flat("old_logp"), inputs.flat("ref_logp"),
        covariance_params(config), chosen=chosen, is_weights=inputs.flat("is_weights"))
    return loss_from_stats(stats, inputs), grad, grad_h if config.entropy_coef != 0 else None


def _chosen(kernels, logp, mask, adv, inputs: LossInputs, config: PolicyLossConfig):
    """The chosen tokens' values of `covariance_choice` (N,), or None where no token's loss changes."""
    old = inputs.flat("old_logp")
    if config.objective == "kl_cov" and (old is None or config.kl_cov_coef == 0):
        return None  # the penalty |ℓ − ℓ_old| is 0 on-policy
    if config.objective == "clip_cov" and config.clip_cov_draw == "verl":  # verl's draw needs n on the host
        B, T = inputs.mask.shape
        w = torch.ones_like(logp) if old is None else torch.exp((logp - old).clamp(-config.log_ratio_clamp,
                                                                                   config.log_ratio_clamp))
        flags = clip_cov_tokens(w.view(B, T), inputs.adv, logp.view(B, T), inputs.mask, config).reshape(-1)
        return flags.to(logp.dtype)
    draws = torch.rand(mask.shape, dtype=torch.float32, device=mask.device) if config.objective == "clip_cov" else None
    return kernels.covariance_choice(logp, adv, old, mask, draws, covariance_choice_params(config))
