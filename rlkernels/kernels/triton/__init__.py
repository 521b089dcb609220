"""The `triton` backend: Triton kernels on CUDA tensors (CPU tensors under TRITON_INTERPRET=1)."""

from .. import supports_all_but
from .covariance_choice import covariance_choice
from .launch import available, launch_config
from .logprobs import token_logprobs_bwd, token_logprobs_fwd
from .policy_token import policy_token_fwd, policy_token_loss

supports = supports_all_but({"policy_token_fwd_grad": "Triton has no distributed shared memory to hold a large row "
                                                       "between its two sweeps: 3 passes (docs/design.md §7)"})

__all__ = ["available", "supports", "launch_config", "token_logprobs_fwd", "token_logprobs_bwd",
           "policy_token_fwd", "policy_token_loss", "covariance_choice"]
