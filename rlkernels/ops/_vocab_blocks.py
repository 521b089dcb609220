"""The hidden-state head over vocabulary blocks, the design that keeps its extra memory small (docs/design.md §4).

Forward: per block of `c` columns of W, its logits of all rows (one GEMM into the reused buffer, then −inf
columns to a multiple of 16; the first is the target of rows whose token lies in another block, as a
vocabulary shard's) and the kernels' row statistics of the block; the blocks' statistics are merged
(`merge_slices`, the same formulas as for ranks). Backward: per block, last first (the forward leaves its
logits in the buffer), the logits again, the backward kernel over them in place, then that block's rows of ∂W
written once and complete by one GEMM in the weight's dtype (no fp32 copy of ∂W), and ∂hidden added in fp32
(the N·H fp32 accumulator; fp32 products of half-precision operands as `accumulate` forms them).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._dtypes import acc_dtype
from ._head_design import buffer_width
from ._linear_head import HeadGrads, LinearHead, accumulate, logits_into, merge_slices


class VocabBlockedHead(LinearHead):
    """`LinearHead`'s interface (forward, new_grads, backward, finish) over blocks of `spec.design.size`
    vocabulary columns, all rows at once."""

    def __init__(self, *args):
        super().__init__(*args)
        cols = self.spec.design.size
        self.blocks = [(v, min(v + cols, self.vocab)) for v in range(0, self.vocab, cols)]
        # (K, N): each block's local target ids, its −inf column where the token lies elsewhere (or on another rank)
        start = torch.arange(len(self.blocks), device=self.targets.device)[:, None] * cols
        size = (self.vocab - start).clamp(max=cols)
        local = self.targets - start
        self.in_block = (local >= 0) & (local < size)
        self.block_targets = torch.where(self.in_block, local, size)

    def buffer_numel(self) -> int:
        return self.n * buffer_width(self.spec.design.size, True)

    def block_logits(self, k: int) -> Tensor:
        """Block k's logits of all rows in the buffer (a contiguous `(N, width)` view), computed unless held."""
        v0, v1 = self.blocks[k]
        buf = self.piece_buffer(self.n, buffer_width(v1 - v0, True))
        if self.held == k:
            return buf
        logits_into(buf[:, : v1 - v0], self.hidden, self.weight[v0:v1], None if self.bias is None else self.bias[v0:v1])
        self.pad(buf, v1 - v0)
        self.held = k
        return buf

    def forward(self, need_entropy: bool):
        tau = self.spec.temperature
        parts = [self.kernels.token_logprobs_fwd(self.block_logits(k), self.block_targets[k], tau, need_entropy)
                 for k in range(len(self.blocks))]
        if len(parts) == 1:
            logp, entropy, lse_parts = parts[0]
        else:
            logp, entropy, lse_parts = merge_slices(*(torch.stack(x) for x in zip(*parts)), self.in_block, tau,
                                                    need_entropy, lambda m: m.amax(0), lambda x: x.sum(1))
            entropy = entropy if need_entropy else parts[0][1]  # empty
        return self.merge_shards(logp, entropy, lse_parts, need_entropy)

    def new_grads(self, need_hidden: bool, need_weight: bool, need_bias: bool) -> HeadGrads:
        """∂hidden in the accumulation dtype, ∂W in the weight's (each block writes its rows once), ∂bias in the
        accumulation dtype (V numbers); uninitialised, as every block writes its rows and the first ∂hidden."""
        acc = acc_dtype(self.hidden)
        return HeadGrads(
            hidden=torch.empty(self.hidden.shape, dtype=acc, device=self.hidden.device) if need_hidden else None,
            weight=torch.empty_like(self.weight) if need_weight else None,
            bias=torch.empty(self.vocab, dtype=acc, device=self.weight.device) if need_bias else None,
        )

    def backward(self, lse_parts, entropy, grad_logp, grad_entropy, grads: HeadGrads) -> None:
        grad_logp = grad_logp.contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
        for i, k in enumerate(reversed(range(len(self.blocks)))):  # the forward ended on the last block
            v0, v1 = self.blocks[k]
            buf = self.block_logits(k)
            g = self.kernels.token_logprobs_bwd(buf, self.block_targets[k], lse_parts, entropy, grad_logp,
                                                grad_entropy, self.spec.temperature, out=buf)
            self.overwritten()
            g = g[:, : v1 - v0]  # the −inf columns hold the target term of other blocks' tokens
            if grads.hidden is not None:
                accumulate(grads.hidden, g, self.weight[v0:v1], first=i == 0)
            if grads.weight is not None:
                torch.mm(g.t(), self.hidden, out=grads.weight[v0:v1])
            if grads.bias is not None:
                torch.sum(g, 0, dtype=grads.bias.dtype, out=grads.bias[v0:v1])
