"""The hidden-state head, shared by `linear_token_logprobs` and `fused_linear_policy_loss`
(docs/design.md §4): `head_spec` validates the inputs and chooses the design (`_head_design`),
`_heads.make_head` builds it: `LinearHead` runs the row-chunk loop over logits = hidden @ weightᵀ (+ bias)
with the backend's kernels, forward and backward, and merges the per-row results of vocabulary
shards (`merge_slices`, which also merges vocabulary blocks: `_vocab_blocks`); `HeadGrads` carries
∂hidden, ∂weight and ∂bias. A GPU's choices are taken where `_gpu_like.gpu_like` says.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .. import _backend
from .._checks import (
    FLOAT_DTYPES, INT_DTYPES, check_int, check_softcap, check_targets, check_temperature, check_tensor,
)
from .._dtypes import acc_dtype
from ..kernels.softcap import with_softcap
from . import _head_design
from ._gpu_like import gpu_like
from ._head_design import Design, buffer_width
from .token_logprobs import _resolve

_FP32_OUT_GEMM: Dict[Tuple[torch.device, torch.dtype], bool] = {}


def fp32_out_gemm(t: Tensor) -> bool:
    """Whether `torch.mm`/`torch.addmm` take operands of t's half-precision dtype with an fp32
    result (`out_dtype`) on t's device, and give the right values: CUDA has it from torch 2.9, on some GPUs and
    versions it raises, CPUs lack it. Tried once per device and dtype as `accumulate` calls it (a transposed
    operand, the accumulator both input and output) on 3 × 2 operands whose products fp32 holds exactly and the
    operands' dtype does not, the values compared with the exact product (one sync), cached. A refusal means the
    upcast (`head_gemm` says which ran); a wrong value raises, naming both. Fake tensors are not tried: they have
    it where they stand for a GPU (`gpu_like`)."""
    if is_fake(t):
        return gpu_like(t)
    key = (t.device, t.dtype)
    if key not in _FP32_OUT_GEMM:
        _FP32_OUT_GEMM[key] = _probe_fp32_out_gemm(t.device, t.dtype)
    return _FP32_OUT_GEMM[key]


def _probe_fp32_out_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    # 1 + 2^-7 and 1 - 2^-8 are exact in bf16 and fp16; their products and sums need 19 bits: a result rounded to
    # the operands' dtype, or an addmm that reads its aliased `out` after writing it, differs from the exact one.
    a = torch.tensor([[1 + 2 ** -7, 1.0], [1.0, 1 - 2 ** -8], [2.0, 1 + 2 ** -7]], dtype=dtype)
    want = (a.double().t() @ a.double()).float()
    a = a.to(device)
    acc = torch.empty(2, 2, dtype=torch.float32, device=device)
    try:
        torch.mm(a.t(), a, out_dtype=torch.float32, out=acc)
        first = acc.clone()
        torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):  # unknown argument (torch < 2.9), no kernel, refused
        return False
    got = (first.cpu(), acc.cpu())
    if not (torch.equal(got[0], want) and torch.equal(got[1], 2 * want)):
        raise RuntimeError(
            f"fp32_out_gemm: torch {torch.__version__}'s mm / addmm(..., out_dtype=torch.float32, out=acc) of "
            f"{dtype} operands on {device} gave {got[0].tolist()} then {got[1].tolist()}, expected "
            f"{want.tolist()} then {(2 * want).tolist()} (the fp32 products): its fp32-output GEMM is wrong here")
    return True


def head_gemm(t: Tensor) -> str:
    """Which GEMM `accumulate` runs for operands like t into an fp32 accumulator (gpu_check's probe prints it)."""
    if t.dtype == torch.float32:
        return "mm in fp32 (fp32 operands)"
    if fp32_out_gemm(t):
        return f"mm / addmm(out_dtype=float32) of the {str(t.dtype).replace('torch.', '')} operands"
    return f"upcast: the {str(t.dtype).replace('torch.', '')} operands copied to fp32, then mm in fp32"


def accumulate(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc = a @ b (`first`: β = 0, acc is neither zeroed nor read) or acc += a @ b, products and
    sums in acc's dtype. Half-precision operands go in as they are where the GEMM writes fp32
    (`fp32_out_gemm`), else upcast: either way every product is exact in fp32 and summed in fp32."""
    if a.dtype != acc.dtype and not fp32_out_gemm(a):
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    kw = {} if a.dtype == acc.dtype else {"out_dtype": acc.dtype}
    if first:
        torch.mm(a, b, out=acc, **kw)
    else:
        torch.addmm(acc, a, b, out=acc, **kw)


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What the forward and the backward agree on, besides the tensors."""

    temperature: float
    softcap: float  # the final-logit cap c, 0.0 for none
    backend: str
    design: Design  # row chunks of `design.size` rows, or vocabulary blocks of `design.size` columns
    group: Optional[object] = None  # torch.distributed process group (vocabulary parallel), or None
    vocab_start: object = 0  # first global vocabulary id of this rank's slice of `weight` (a 0-d tensor when sharded)


class LinearHead:
    """hidden `(N, H)` × weight `(V, H)`ᵀ (+ bias) in row chunks through one reused logits buffer."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, spec: HeadSpec):
        self.hidden = hidden.detach().reshape(-1, hidden.shape[-1]).contiguous()
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.spec = spec
        self.kernels = with_softcap(_backend.kernels(spec.backend), spec.softcap)
        self.n, self.vocab = self.hidden.shape[0], self.weight.shape[0]
        targets = targets.reshape(-1).to(torch.int64)
        self.sharded = spec.group is not None
        if self.sharded:  # local ids; rows whose token is on another rank aim at the −inf column
            local = targets - spec.vocab_start
            self.owned = (local >= 0) & (local < self.vocab)
            targets = torch.where(self.owned, local, torch.full_like(local, self.vocab))
        self.targets = targets.contiguous()
        self.buffer: Optional[Tensor] = None  # flat, allocated at first use, dropped by `drop_buffer`
        self.held = None  # which piece's logits the buffer holds, unchanged (the backward starts with it)
        self.padded = None  # (row width, logits per row) of the −inf padding the buffer holds, if any

    def piece_buffer(self, rows: int, width: int) -> Tensor:
        """A contiguous `(rows, width)` view of the buffer, whose size is the largest piece's."""
        if self.buffer is None:
            self.buffer = self.hidden.new_empty(self.buffer_numel())
        return self.buffer[: rows * width].view(rows, width)

    def buffer_numel(self) -> int:
        return min(self.spec.design.size, self.n) * buffer_width(self.vocab, self.sharded)

    def drop_buffer(self) -> None:
        self.buffer = self.held = self.padded = None

    def pad(self, buf: Tensor, columns: int) -> None:
        """−inf in the columns of `buf` past its first `columns`, unless they hold it already (a forward's
        pieces of one width fill them once; a backward kernel writes over them)."""
        if buf.shape[1] > columns and self.padded != (buf.shape[1], columns):
            buf[:, columns:] = float("-inf")
            self.padded = (buf.shape[1], columns)

    def overwritten(self) -> None:
        """The buffer's logits, padding included, were overwritten (by a backward kernel)."""
        self.held = self.padded = None

    def chunks(self):
        rows = self.spec.design.size
        return [(start, min(start + rows, self.n)) for start in range(0, self.n, rows)]

    def logits(self, s: int, e: int) -> Tensor:
        """The logits of rows s:e in the buffer (a contiguous `(e − s, width)` view of it), computed unless it
        holds them already (the forward's last chunk, at the start of the backward)."""
        width = buffer_width(self.vocab, self.sharded)
        buf = self.piece_buffer(e - s, width)
        if self.held == (s, e):
            return buf
        logits_into(buf[:, : self.vocab], self.hidden[s:e], self.weight, self.bias)
        self.pad(buf, self.vocab)
        self.held = (s, e)
        return buf

    def policy_chunk(self, buf: Tensor, s: int, e: int, per_row, params):
        """The fused forward (log-probs and the token-level loss) of rows s:e; `per_row` are the
        kernel's flat per-token inputs (mask, weight, adv, old_logp, ref_logp), sliced here."""
        sliced = [None if x is None else x[s:e] for x in per_row]
        return self.kernels.policy_token_fwd(buf, self.targets[s:e], *sliced, self.spec.temperature, params)

    def forward_chunk(self, buf: Tensor, s: int, e: int, need_entropy: bool):
        """(logp, entropy, lse_parts) of rows s:e; this rank's slice only when sharded (see `merge_shards`)."""
        return self.kernels.token_logprobs_fwd(buf, self.targets[s:e], self.spec.temperature, need_entropy)

    def forward(self, need_entropy: bool):
        """(logp, entropy, lse_parts) of all rows, over the whole vocabulary (merged across ranks)."""
        # one concatenation per output after the loop, not a copy per chunk (a launch each on a GPU)
        chunks = self.chunks() or [(0, 0)]  # no rows: one empty chunk
        parts = [self.forward_chunk(self.logits(s, e), s, e, need_entropy) for s, e in chunks]
        logp, entropy, lse_parts = (torch.cat(x) if len(x) > 1 else x[0] for x in zip(*parts))
        return self.merge_shards(logp, entropy, lse_parts, need_entropy)

    def merge_shards(self, logp, entropy, lse_parts, need_entropy):
        """Per-rank (logp, H, [m, log s]) of the local slices → those of the whole vocabulary (unsharded: as
        they are), by `merge_slices` with all-reduces over the ranks."""
        if not self.sharded:
            return logp, entropy, lse_parts
        group = self.spec.group

        def top(m):
            m = m.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            return m

        def total(sums):
            dist.all_reduce(sums, group=group)
            return sums

        return merge_slices(logp, entropy, lse_parts, self.owned, self.spec.temperature, need_entropy, top, total)

    def new_grads(self, need_hidden: bool, need_weight: bool, need_bias: bool) -> "HeadGrads":
        """Uninitialised: the first chunk writes them (zeros when there is no row, hence no chunk). ∂W is an
        accumulator over several chunks (fp32 for half precision); one chunk writes it in the weight's dtype."""
        acc, new = acc_dtype(self.hidden), torch.empty if self.n else torch.zeros
        weight_dtype = self.weight.dtype if len(self.chunks()) == 1 else acc
        return HeadGrads(
            hidden=torch.empty_like(self.hidden) if need_hidden else None,
            weight=new(self.weight.shape, dtype=weight_dtype, device=self.weight.device) if need_weight else None,
            bias=new(self.vocab, dtype=acc, device=self.weight.device) if need_bias else None,
        )

    def backward_chunk(self, buf, s, e, lse_parts, entropy, grad_logp, grad_entropy, grads: "HeadGrads",
                       first: bool):
        """∂logits of rows s:e from the (global) lse_parts/H and the incoming gradients, written over
        the chunk's logits in `buf`, then added to `grads` (`first`: written into them)."""
        g = self.kernels.token_logprobs_bwd(buf, self.targets[s:e], lse_parts, entropy, grad_logp.contiguous(),
                                            None if grad_entropy is None else grad_entropy.contiguous(),
                                            self.spec.temperature, out=buf)
        self.overwritten()
        g = g[:, : self.vocab]  # the −inf columns (sharded) hold the target term of other ranks' tokens
        if grads.hidden is not None:
            torch.mm(g, self.weight, out=grads.hidden[s:e])
        if grads.weight is not None:  # fp32 accumulation over chunks; one chunk: the GEMM writes ∂W
            accumulate(grads.weight, g.t(), self.hidden[s:e], first)
        if grads.bias is not None:
            if first:
                torch.sum(g, 0, dtype=grads.bias.dtype, out=grads.bias)
            else:
                grads.bias += g.sum(0, dtype=grads.bias.dtype)

    def backward(self, lse_parts, entropy, grad_logp, grad_entropy, grads: "HeadGrads") -> None:
        """The second pass: each chunk's logits again (last first: the forward may have left them in the
        buffer), then `backward_chunk` (then `finish`)."""
        for i, (s, e) in enumerate(reversed(self.chunks())):
            h = None if grad_entropy is None else grad_entropy[s:e]
            self.backward_chunk(self.logits(s, e), s, e, lse_parts[s:e], entropy[s:e] if h is not None else entropy,
                                grad_logp[s:e], h, grads, first=i == 0)

    def finish(self, grads: "HeadGrads") -> "HeadGrads":
        """∂hidden summed over ranks (each rank saw its slice of the vocabulary)."""
        if self.sharded and grads.hidden is not None:
            dist.all_reduce(grads.hidden, group=self.spec.group)
        return grads


def logits_into(out: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    """out = hidden @ weightᵀ (+ bias) in one GEMM that writes `out`, a view of a padded buffer (strided: BLAS
    writes into it directly); under torch.compile, which refuses a strided `out=`, computed then copied."""
    if torch.compiler.is_compiling() and not out.is_contiguous():
        out.copy_(torch.nn.functional.linear(hidden, weight, bias))
    elif bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), out=out)


def merge_slices(logp, entropy, lse_parts, owned, temperature: float, need_entropy: bool, top, total):
    """(logp, H, [m, log s]) of slices of the vocabulary (ranks, or blocks) → those of the whole row.

    `top(m)`: the max over slices of the raw row maxima; `total(x)`: x summed over the slices, for x
    stacked on a new first dimension; `owned`: where a slice holds the row's target (its logp counts).
    Slice r has raw max m_r and, with d = (z − m_r)/τ, s_r = Σ e^d, Σ e^d·d = s_r (log s_r − H_r), and
    where it holds y, d_y = logp_r + log s_r. Relative to M = max_r m_r (δ_r = (m_r − M)/τ): s = Σ_r
    e^{δ_r + log s_r}, Σ e^{d'}d' = Σ_r e^{δ_r + log s_r}(log s_r − H_r + δ_r) and d'_y = logp_r +
    log s_r + δ_r. Every term is relative to a max, so no large m_r/τ + log s_r is ever rounded."""
    m, log_s = lse_parts.unbind(-1)
    peak = top(m)
    shift = (m - peak) / temperature
    scale = torch.exp(shift + log_s)
    zero = torch.zeros_like(scale)
    parts = [torch.where(owned, (logp + log_s) + shift, zero), scale]
    if need_entropy:  # a slice of only −inf (scale 0, H_r NaN) adds nothing
        parts.append(torch.where(scale > 0, scale * ((log_s - entropy) + shift), zero))
    sums = total(torch.stack(parts))
    log_s_all = torch.log(sums[1])
    entropy_all = log_s_all - sums[2] / sums[1] if need_entropy else entropy
    return sums[0] - log_s_all, entropy_all, torch.stack((peak, log_s_all), -1)


@dataclasses.dataclass
class HeadGrads:
    hidden: Optional[Tensor]  # (N, H): dtype of hidden, or its accumulation dtype (vocabulary blocks)
    weight: Optional[Tensor]  # (V, H), in the accumulation dtype (fp32; fp64 for fp64 inputs) or weight's
    bias: Optional[Tensor]  # (V,), in the accumulation dtype

    def to(self, dtype: torch.dtype) -> "HeadGrads":
        """All three in `dtype` (the parameters'): one conversion pass each, none when an accumulator
        already is the gradient (dropping `self` then frees the accumulator)."""
        return HeadGrads(*(None if g is None else g.to(dtype) for g in (self.hidden, self.weight, self.bias)))


def head_spec(hidden, weight, bias, targets, temperature, softcap, backend, chunk_size, process_group,
              memory_budget) -> HeadSpec:
    """Validate the inputs of the hidden-state path; the spec both passes share."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden: expected shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(f"weight: expected shape (V, {hidden.shape[-1]}) (V >= 1, H of hidden), got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, shape=(weight.shape[0],), dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("targets", targets, shape=tuple(hidden.shape[:-1]), dtypes=INT_DTYPES, device=hidden.device)
    temperature, softcap = check_temperature(temperature), check_softcap(softcap)
    vocab, start = weight.shape[0], 0
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group: expected a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
        # The slices' sizes stay on the device: the start and the total are 0-d tensors (no sync).
        sizes = torch.zeros(dist.get_world_size(process_group), dtype=torch.int64, device=hidden.device)
        sizes[dist.get_rank(process_group)] = vocab
        dist.all_reduce(sizes, group=process_group)
        start, vocab = sizes[: dist.get_rank(process_group)].sum(), sizes.sum()
    name = _resolve(backend, hidden.device)  # its ops defined, with their fakes (for fake tensors)
    # Checked here on every backend: the kernels see the logits of a block padded to a multiple of 16
    # columns (−inf beyond V), which would pass a check against the buffer's width; sharded, local ids only.
    check_targets(targets, vocab, "V = rows of weight" + (", summed over ranks" if process_group is not None else ""))
    if chunk_size is not None:
        chunk_size = check_int("chunk_size", chunk_size, 1)
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget >= 0):
        raise ValueError(f"memory_budget: expected a number >= 0 (a fraction of the logits) or None, "
                         f"got {memory_budget!r}")
    n = hidden.numel() // hidden.shape[-1]
    design = _head_design.choose(n, weight.shape[0], hidden.shape[-1], hidden.dtype, sharded=process_group is not None,
                                 gpu=gpu_like(hidden), fp32_out=hidden.element_size() >= 4 or fp32_out_gemm(hidden),
                                 memory_budget=memory_budget, chunk_size=chunk_size)
    return HeadSpec(temperature, softcap, name, design, process_group, start)
