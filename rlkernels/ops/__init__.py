"""Autograd-aware `torch.library` ops over the kernels, with backend dispatch (DESIGN.md §1)."""
from .token_logprobs import token_logprobs

__all__ = ["token_logprobs"]
