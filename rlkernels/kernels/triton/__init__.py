"""The `triton` backend: Triton kernels on CUDA tensors (CPU tensors under TRITON_INTERPRET=1)."""

from .covariance_choice import covariance_choice
from .policy_token import policy_token_fwd, policy_token_loss
from .token_logprobs import available, launch_config, token_logprobs_bwd, token_logprobs_fwd

__all__ = ["available", "launch_config", "token_logprobs_fwd", "token_logprobs_bwd",
           "policy_token_fwd", "policy_token_loss", "covariance_choice"]
