"""The `triton` backend: Triton kernels on CUDA tensors (CPU tensors under TRITON_INTERPRET=1)."""

from .. import supports_all_but
from .covariance_choice import covariance_choice
from .launch import available, launch_config
from .logprobs import token_logprobs_bwd, token_logprobs_fwd
from .policy_token import policy_token_fwd, policy_token_loss
from .scale_grad import scale_grad_
from .split_row import policy_token_fwd_grad

# every op; policy_token_fwd_grad (the split row, docs/design.md §7) only when asked (two_pass=True) until a device
# run shows it faster than three passes
supports = supports_all_but({})

__all__ = ["available", "supports", "launch_config", "token_logprobs_fwd", "token_logprobs_bwd",
           "policy_token_fwd", "policy_token_fwd_grad", "scale_grad_", "policy_token_loss", "covariance_choice"]
