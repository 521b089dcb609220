"""Which design the hidden-state head runs, chosen by the extra memory each takes (docs/design.md §4).

* Row chunks (`LinearHead`): the logits of r rows at a time, 3 GEMMs (logits, ∂hidden, ∂W). Extra: the
  chunk, and for half-precision parameters split over several chunks the fp32 ∂W accumulator (V·H·4
  bytes, as large as the bf16 logits at N = 2H); one chunk writes ∂W in the parameters' dtype.
* Vocabulary blocks (`_vocab_blocks.VocabBlockedHead`): the row statistics over blocks of columns, then
  per block its logits again, its ∂W rows written once by one GEMM, ∂hidden summed in fp32. 4 GEMMs;
  extra: one block of all rows and, for half precision, the fp32 ∂hidden (N·H·4 bytes, 2H/V of the bf16
  logits).

`choose` takes the row chunks where their extra fits the budget (a fraction of the logits the path
avoids), else vocabulary blocks as wide as fit; `memory_budget=None` takes the row chunks' speed rule
whatever their memory.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

# A CPU chunk: ≤ 56 MiB of logits with their fp32 image: the extra peak (one chunk) at N = 2048,
# V = 152k in fp32 is 4.6% of the logits avoided; each chunk re-reads W and the ∂W accumulator,
# so smaller chunks cost time (half as many rows: +10% there).
CPU_CHUNK_BYTES = 56 << 20
# On a GPU each chunk's ∂W product reads and writes the whole (V, H) fp32 accumulator, 8 bytes per
# entry for 2r FLOP with r rows: r/4 FLOP per byte, where an H100/H200 needs ~200 to stay
# compute-bound (110-row chunks at V = 152k, H = 4096 spent ~85% of the backward there). So a GPU
# chunk holds as many bytes of logits as the accumulator has (one chunk when all fit: its product
# then writes ∂W once, in the parameters' dtype), and at least this many rows; fewer rows than that
# within the budget, and the vocabulary blocks are faster.
GPU_MIN_CHUNK_ROWS = 4096
LANE = 16  # buffer rows are a multiple of 16 elements: every row 32- or 64-byte aligned (kernels' loads, cuBLAS)
MEMORY_BUDGET = 0.1  # default extra memory, as a fraction of the (N, V) logits the path avoids
# An extra this small is allowed whatever the budget: below it, smaller pieces only add launches.
FLOOR_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Design:
    kind: str  # "rows" (row chunks) or "vocab" (vocabulary blocks)
    size: int  # rows per chunk, or vocabulary columns per block


def buffer_width(vocab: int, sharded: bool) -> int:
    """Columns of a chunk buffer of `vocab` logits: a multiple of `LANE`, the columns past the logits −inf;
    sharded (or a vocabulary block) one −inf column at least, the target of rows whose token lies elsewhere.
    The kernels read contiguous rows, so the width is their row stride and cuBLAS's leading dimension."""
    return -(-(vocab + int(sharded)) // LANE) * LANE


def default_rows(n: int, width: int, hidden_size: int, dtype: torch.dtype, gpu: bool, upcast: bool) -> int:
    """Rows per chunk by the speed rule, for n rows of `width` logits in `dtype` and a (V, H =
    hidden_size) ∂W accumulator; `upcast`: the ∂W GEMM takes an fp32 image of each chunk. The
    fewest chunks under the cap (GPU: the accumulator's bytes, at least `GPU_MIN_CHUNK_ROWS` rows;
    CPU: `CPU_CHUNK_BYTES`), evened out (as many accumulator passes, a smaller buffer)."""
    acc_size = _acc_size(dtype)
    per_logit = dtype.itemsize + (acc_size if upcast else 0)
    if gpu:
        cap = max(GPU_MIN_CHUNK_ROWS, hidden_size * acc_size // per_logit)
    else:
        cap = CPU_CHUNK_BYTES // (width * per_logit)
    return _evened(n, cap)


def row_chunk_extra(n: int, rows: int, vocab: int, hidden_size: int, dtype: torch.dtype, sharded: bool,
                    upcast: bool) -> int:
    """Extra bytes of row chunks of `rows`: the chunk (with its fp32 image where the ∂W GEMM upcasts) and,
    for half precision over several chunks, the fp32 ∂W accumulator, converted at the end."""
    several = n > rows
    return min(rows, max(n, 1)) * _row_bytes(vocab, dtype, sharded, upcast and several) + (
        _dw_accumulator(vocab, hidden_size, dtype) if several else 0)


def vocab_block_extra(n: int, cols: int, hidden_size: int, dtype: torch.dtype, upcast: bool) -> int:
    """Extra bytes of vocabulary blocks of `cols` columns: the block of all rows (and, where the ∂hidden GEMM
    upcasts, fp32 images of its gradient and of its rows of W) beside the fp32 ∂hidden accumulator of half
    precision, which stands in for the ∂hidden of the parameters' dtype until the blocks are done (then
    both exist, for the conversion)."""
    b, acc = dtype.itemsize, _acc_size(dtype)
    block = n * buffer_width(cols, True) * b + ((n + hidden_size) * cols * acc if upcast else 0)
    if b == acc:  # the accumulator is the gradient
        return block
    return max(block + n * hidden_size * (acc - b), n * hidden_size * acc)


def choose(n: int, vocab: int, hidden_size: int, dtype: torch.dtype, *, sharded: bool, gpu: bool, fp32_out: bool,
           memory_budget: Optional[float], chunk_size: Optional[int] = None) -> Design:
    """The design of the head for n rows of hidden states (`chunk_size` given: row chunks of that many rows).
    `fp32_out`: the device's GEMM takes half-precision operands with an fp32 result (else they are upcast)."""
    upcast = dtype.itemsize < 4 and not fp32_out
    if chunk_size is not None:
        return Design("rows", chunk_size)
    rows = default_rows(n, buffer_width(vocab, sharded), hidden_size, dtype, gpu, upcast)
    if memory_budget is None:
        return Design("rows", rows)
    allowed = max(memory_budget * n * vocab * dtype.itemsize, FLOOR_BYTES)
    if row_chunk_extra(n, rows, vocab, hidden_size, dtype, sharded, upcast) > allowed:
        # as many rows as fit beside the accumulator of several chunks
        room = allowed - _dw_accumulator(vocab, hidden_size, dtype)
        rows = _evened(n, int(room // _row_bytes(vocab, dtype, sharded, upcast)))
    if (row_chunk_extra(n, rows, vocab, hidden_size, dtype, sharded, upcast) <= allowed
            and rows >= min(GPU_MIN_CHUNK_ROWS if gpu else 1, n)):
        return Design("rows", rows)
    return Design("vocab", vocab_columns(n, vocab, hidden_size, dtype, upcast, allowed))


def vocab_columns(n: int, vocab: int, hidden_size: int, dtype: torch.dtype, upcast: bool, allowed: float) -> int:
    """The widest vocabulary blocks whose extra is within `allowed` bytes (at least `LANE` − 1 columns: one
    lane with its −inf column), evened out over as few blocks, each a whole number of lanes less one column."""
    b, acc = dtype.itemsize, _acc_size(dtype)
    room = allowed - (n * hidden_size * (acc - b) if b < acc else 0)
    per_column = n * b + ((n + hidden_size) * acc if upcast else 0)
    cols = max(LANE - 1, int(room // max(1, per_column)) // LANE * LANE - 1)
    while cols > LANE - 1 and vocab_block_extra(n, cols, hidden_size, dtype, upcast) > allowed:
        cols -= LANE
    blocks = -(-vocab // min(cols, buffer_width(vocab, True) - 1))
    return buffer_width(-(-vocab // blocks), True) - 1


def _evened(n: int, cap: int) -> int:
    """The fewest pieces of at most `cap` (≥ 1) rows over n, evened out."""
    chunks = -(-n // max(1, cap))
    return max(1, -(-n // max(1, chunks)))


def _row_bytes(vocab: int, dtype: torch.dtype, sharded: bool, upcast: bool) -> int:
    """Bytes of one row of a chunk: its logits, and their fp32 image where the ∂W GEMM upcasts."""
    return buffer_width(vocab, sharded) * (dtype.itemsize + (_acc_size(dtype) if upcast else 0))


def _dw_accumulator(vocab: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The fp32 ∂W that half-precision parameters take over several chunks (fp32 and fp64: the gradient)."""
    return vocab * hidden_size * _acc_size(dtype) if dtype.itemsize < _acc_size(dtype) else 0


def _acc_size(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4
