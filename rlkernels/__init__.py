"""rlkernels: fused kernels for the loss head of RL fine-tuning of language models.

Layers (docs/design.md §1), bottom up: the shared helpers; `kernels` (passes over logits) and
`losses` (RL objectives), which do not know each other, with `advantages` / `sampling` beside them;
`ops` (autograd-aware torch.library ops, backend dispatch) on kernels and losses; then
`integrations`, `trainer` and the command line. `reference` (the naive truth) is imported by none.
"""
from . import advantages, sampling
from ._backend import backend_info
from .losses import (LossOutput, PolicyLossConfig, policy_loss, presets, rollout_is_weights, rollout_rejection_mask,
                     value_loss)
from .ops import fused_linear_policy_loss, fused_policy_loss, linear_token_logprobs, token_logprobs

__version__ = "0.1.0"
__all__ = [
    "token_logprobs",
    "fused_policy_loss",
    "linear_token_logprobs",
    "fused_linear_policy_loss",
    "policy_loss",
    "value_loss",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "PolicyLossConfig",
    "LossOutput",
    "presets",
    "advantages",
    "sampling",
    "backend_info",
]
