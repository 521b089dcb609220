"""rlkernels' hidden-state log-prob/entropy op in the two forms verl's fused-kernel path calls.

With `actor_rollout_ref.model.use_fused_kernels=True`, verl's patched model forwards compute the
actor's per-token log-probs and entropies from the last hidden states and `lm_head.weight`:
`fused_kernels_backend=triton` calls `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`
(its Triton kernel, CUDA only), `torch` calls `verl.utils.experimental.torch_functional.FusedLinearForPPO`.
`linear_cross_entropy` and `FusedLinearForPPO` here take the same arguments and return the same
`(log_probs, entropy)` (fp32 here, on every backend rlkernels has: CPU, CUDA, Triton);
`patch_fused_kernels()` puts them in verl's place (both backends; verl looks them up at call time).
"""
from __future__ import annotations

import sys

import torch

from ..ops import linear_token_logprobs


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group=None):
    """verl's `linear_cross_entropy`: `(log_probs, entropy)` of `labels` (already rolled) under
    softmax(hidden @ weight.T / temperature), per token. `dist_process_group`: `weight` holds this
    rank's rows of the vocabulary (in rank order) and labels are global ids, as in verl."""
    if reduction != "none":
        raise ValueError(f"reduction: rlkernels supports 'none' (what verl's model forwards pass), got {reduction!r}")
    return linear_token_logprobs(hidden, weight, labels.long(), temperature=float(temperature), return_entropy=True,
                                 process_group=dist_process_group)


class FusedLinearForPPO(torch.nn.Module):
    """verl's `FusedLinearForPPO`: `forward(hidden_states, vocab_weights, input_ids, temperature)`
    → `(log_probs, entropy)`. `chunk_size` (rows per chunk) and `impl_backend` are accepted for
    compatibility; rlkernels sizes its chunks by memory and picks its own backend."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0):
        return linear_cross_entropy(hidden_states, vocab_weights, input_ids, temperature)


def patch_fused_kernels() -> list:
    """Make verl's fused-kernel model forwards use rlkernels; returns the modules patched.

    Replaces `linear_cross_entropy` and `FusedLinearForPPO` in verl's modules that define them,
    and in any verl module already imported that holds verl's own by name (mcore's forwards import
    `linear_cross_entropy` at module level)."""
    import verl.utils.experimental.torch_functional as torch_functional
    import verl.utils.kernel.linear_cross_entropy as kernel

    originals = {"linear_cross_entropy": kernel.linear_cross_entropy,
                 "FusedLinearForPPO": torch_functional.FusedLinearForPPO}
    ours = {"linear_cross_entropy": linear_cross_entropy, "FusedLinearForPPO": FusedLinearForPPO}
    loaded = [m for name, m in list(sys.modules.items()) if name.startswith("verl.") and m is not None]
    patched = []
    for module in {id(m): m for m in [kernel, torch_functional, *loaded]}.values():
        hit = False
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                setattr(module, name, ours[name])
                hit = True
        if hit:
            patched.append(module.__name__)
    return patched


__all__ = ["linear_cross_entropy", "FusedLinearForPPO", "patch_fused_kernels"]
