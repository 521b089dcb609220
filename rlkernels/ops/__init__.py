"""Autograd-aware `torch.library` ops over the kernels, with backend dispatch (docs/design.md §4-§6)."""
from .fused_linear_policy_loss import fused_linear_policy_loss
from .fused_policy_loss import fused_policy_loss
from .linear_token_logprobs import linear_token_logprobs
from .token_logprobs import token_logprobs

__all__ = ["token_logprobs", "fused_policy_loss", "linear_token_logprobs", "fused_linear_policy_loss"]
