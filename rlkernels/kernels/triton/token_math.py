"""The functions of fp32 scalars that the Triton token loss and its generated formulas call (token_loss.py,
token_loss_surrogates.py): torch's NaN rules, as losses/ (the spec) has them."""

import triton
import triton.language as tl


@triton.jit
def minimum(a, b):
    """torch.minimum: NaN if either is."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def maximum(a, b):
    """torch.maximum: NaN if either is."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def clamp(x, lo, hi):
    """torch.clamp: NaN stays NaN, so a NaN ℓ (a target outside [0, V)) shows in the loss."""
    return minimum(maximum(x, lo), hi)


@triton.jit
def sigmoid(x):
    """torch.sigmoid, 1/(1 + e^−x): 0 for x → −inf, 1 for x → inf."""
    return 1.0 / (1.0 + tl.exp(-x))
