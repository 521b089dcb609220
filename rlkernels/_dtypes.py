"""The accumulation dtype, shared by every layer: fp64 inputs accumulate in fp64, all others in fp32."""
import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype sums over `t` (logits, hidden states, log-probs, rewards) are kept in."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
