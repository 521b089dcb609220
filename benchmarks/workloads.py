"""What is benchmarked: the ops, their inputs, and the bytes and FLOPs each must move.

Ops (each forward-only, or forward + backward to the logits / hidden states and head weight):
  token_logprobs  log p(target) of every token from (B, T, V) logits
  grpo            GRPO's loss (presets.grpo: clip 0.2, k3 KL to a reference at β 0.04,
                  per-row token mean then batch mean) from logits; entropy computed too (TRL logs it)
  grpo_sliced     the same from `logits[:, :-1]` of (B, T + 1, V) logits, as a Hugging Face model gives
                  them (the gradient is the (B, T + 1, V) parent's)
  grpo_linear     the same loss from hidden states (B, T, H) and a head weight (V, H)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

OPS = ("token_logprobs", "grpo", "grpo_sliced", "grpo_linear")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Case:
    op: str
    n: int          # tokens, B·T
    vocab: int
    dtype: str
    mode: str
    hidden: int = 0  # H, grpo_linear only
    seq_len: int = 512

    @property
    def shape(self):
        """(B, T): rows of `seq_len` tokens (one shorter row when n is smaller)."""
        t = min(self.seq_len, self.n)
        return self.n // t, t

    def bytes_moved(self) -> int:
        """Bytes the op cannot avoid moving. Logits ops: forward reads the logits once; forward +
        backward reads them again and writes their gradient (3·N·V·s). Hidden-state op: the hidden
        states and the weight, read once forward; backward reads them again and writes both gradients."""
        s = DTYPES[self.dtype].itemsize
        passes = 1 if self.mode == "fwd" else 3
        if self.op == "grpo_linear":
            return passes * (self.n + self.vocab) * self.hidden * s
        return passes * self.n * self.vocab * s

    def flops(self) -> int:
        """Matmul FLOPs of the hidden-state op (logits forward; ∂hidden and ∂weight backward)."""
        return (2 if self.mode == "fwd" else 6) * self.n * self.hidden * self.vocab if self.op == "grpo_linear" else 0


@dataclass
class Inputs:
    targets: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    logits: Optional[torch.Tensor] = None   # (B, T, V), or (B, T + 1, V) with `extra_position` (grpo_sliced)
    hidden: Optional[torch.Tensor] = None   # (B, T, H)
    weight: Optional[torch.Tensor] = None   # (V, H)

    def leaves(self):
        """The tensors the loss is differentiated with respect to."""
        return [self.logits] if self.hidden is None else [self.hidden, self.weight]


def make_inputs(case: Case, device, *, extra_position: bool = False, seed: int = 0) -> Inputs:
    """Random inputs; old and reference log-probs within ~0.1 of the current policy's, so ratios
    sit near 1 and both sides of the clip are exercised. `extra_position` appends one logits
    position per row (Liger's Triton loss takes (B, T + 1, V) and drops the last; grpo_sliced always)."""
    import rlkernels

    B, T = case.shape
    dtype = DTYPES[case.dtype]
    g = torch.Generator(device=device).manual_seed(seed)
    targets = torch.randint(0, case.vocab, (B, T), device=device, generator=g)
    inputs = dict(targets=targets, advantages=torch.randn(B, device=device, generator=g),
                  mask=torch.ones(B, T, device=device, dtype=torch.bool))
    if case.op == "grpo_linear":
        hidden = torch.randn(B, T, case.hidden, device=device, generator=g).to(dtype)
        weight = (torch.randn(case.vocab, case.hidden, device=device, generator=g) / case.hidden ** 0.5).to(dtype)
        with torch.no_grad():
            logp = rlkernels.linear_token_logprobs(hidden, weight, targets)
        inputs.update(hidden=hidden, weight=weight)
    else:
        extra_position = extra_position or case.op == "grpo_sliced"
        logits = (2 * torch.randn(B, T + extra_position, case.vocab, device=device, generator=g)).to(dtype)
        with torch.no_grad():
            logp = rlkernels.token_logprobs(logits[:, :T], targets)
        inputs.update(logits=logits)
    noise = lambda: 0.1 * torch.randn(B, T, device=device, generator=g)  # noqa: E731
    return Inputs(old_logp=logp + noise(), ref_logp=logp + noise(), **inputs)
