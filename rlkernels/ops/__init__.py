"""Autograd-aware `torch.library` ops over the kernels, with backend dispatch (DESIGN.md §1)."""
from .fused_policy_loss import fused_policy_loss
from .token_logprobs import token_logprobs

__all__ = ["token_logprobs", "fused_policy_loss"]
