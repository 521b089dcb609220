"""Triton ``policy_token_fwd_grad`` (kernels/__init__.py): the two-pass row, split over several programs.

One program cannot hold a 152k-logit row between its read and its write, and Triton has no distributed
shared memory to spread it over a cluster (the CUDA kernel's way). So a row is cut into K chunks of at most
CHUNK_BYTES, each a work item (row, rank) of its own, and the K programs of a row meet in global memory:

1. a program takes its item from a ticket counter (atomic; tickets in row order), streams its chunk once
   (`span_state`), stores the chunk's (m, s, u) (rank 0 also the target's logit) in `partials`, and adds 1 to
   the row's arrival counter with release semantics;
2. it waits, acquiring that counter, until all K have arrived, merges the K partials in rank order
   (`row_state`: every program of the row gets the same bits, whatever order they arrived in), evaluates the
   row's ℓ, H and token loss (rank 0 stores them), and re-reads its chunk, from L2 on a GPU, to write ∂logits.

Why tickets and not program ids: a program that waits holds a ticket, and only a running program holds one.
Tickets go out in order, so while some item of the earliest unfinished row is still untaken, every waiting
program waits on that row (at most K − 1 of them), and any other running program takes the next ticket, which
is that row's. So the launch finishes whenever K programs can be resident at once, whatever the grid and
whatever order the hardware starts programs in; with items by program id a program of a later row could sit
resident, waiting, while a peer it needs is never started. The launcher checks K against the SM count (a
launchable program fits at least once per SM), and otherwise runs the two phases as two launches (below).
The grid is one program per item; the hardware starts each as another exits, so L2 holds about the resident
programs' chunks (docs/design.md §7). (A persistent grid looping over tickets cost 100 registers on sm_90: ptxas
hoisted the loss's parameters out of the loop.)

Every logit still is read from memory once and written once, and the target logit is read before its row's
arrival count is complete, so no program of the row has written ∂logits yet: ``out`` may be the logits.

Under TRITON_INTERPRET=1 programs run one after another and a spin wait would never end: the same kernel runs
as two launches there (STATS, then GRAD), the kernel boundary ordering the phases; the wait is compiled out.
python_tests/split_row_protocol.py models the protocol on the host under adversarial schedules.
"""

import math

import torch
import triton
import triton.language as tl

from .. import token_loss_params as P
from .launch import (
    INTERPRET, cap_args, check_logits, launch_config, on_device, plain, row_layout, row_vector,
)
# by name, as logprobs.py says
from .logprobs import (
    _grad_span, _grad_tile, align_down, grad_coefs, row_result, row_span, row_start, span_state, target_logit,
    tile_offsets,
)
from .policy_token import row_loss, store_stats
from .row_math import LOG2E, dlogits, row_state

CHUNK_BYTES = 40 * 1024  # a chunk's logits at most: 2 tiles of 16 KB on a GPU
# ptxas keeps both phases' values live across the wait: 63 registers on sm_90 with 16-bit logits (1024 threads per
# SM, below the 1536 of docs/design.md §7); each phase alone takes 32. Capped at 40 every variant without the soft
# cap compiles without spills on sm_80 and sm_90, Triton 3.6 and 3.9; the soft cap's tanh would spill there (CISPO,
# fp16, sm_90), so that variant keeps ptxas's own count (benchmarks/gpu_static.py compiles with the same option).
MAX_REGISTERS = 40


def register_cap(has_cap):
    """The `maxnreg` launch option of a variant (None: ptxas's choice)."""
    return None if has_cap else MAX_REGISTERS
PARTIALS = tl.constexpr(4)  # per chunk: m, s, u, and (rank 0) the target's logit
# The interpreter's tile: small, so that the tests' short rows (V = 203) take several chunks, one a partial one.
_INTERPRET_BLOCK_V = 128


def split_plan(vocab, dtype, interpret=INTERPRET):
    """(BLOCK_V, num_warps, chunk, chunks): a chunk is a whole number of BLOCK_V tiles (16-byte aligned, as the
    row's tiles of `row_span`), ``chunks`` of them cover a row of ``vocab`` logits at any alignment."""
    if interpret:
        block, warps, tiles = _INTERPRET_BLOCK_V, 1, 1
    else:
        block, warps = launch_config(vocab, dtype)
        tiles = max(1, CHUNK_BYTES // (block * dtype.itemsize))
    chunk = block * tiles
    lead = 16 // dtype.itemsize - 1  # the most elements between a row's start and its 16-byte-aligned base
    return block, warps, chunk, triton.cdiv(vocab + lead, chunk)


@triton.jit
def _split_row_kernel(
    logits_ptr, targets_ptr, mask_ptr, weight_ptr, adv_ptr, old_logp_ptr, ref_logp_ptr, is_weights_ptr, bonus_ptr,
    logp_ptr, entropy_ptr, stats_ptr, out_ptr, partials_ptr, sync_ptr,
    V, seq_len, stride_batch, stride_row, stride_out_batch, stride_out_row, chunk, chunks,
    inv_temp, cap, inv_cap, scale, loss_params,
    OBJECTIVE: tl.constexpr, KL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr, BIAS_CORRECTION: tl.constexpr, NUM_STATS: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_H: tl.constexpr, HAS_BONUS: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr,
    CHUNKS_P2: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # sync: [the tickets of a launch with STATS, those of one with GRAD only, then each row's arrivals]
    tickets = sync_ptr
    if not STATS:
        tickets = sync_ptr + 1
    TILE: tl.constexpr = BLOCK_V // 2  # the stats stream half tiles, as `row_forward`
    VEC: tl.constexpr = 128 // logits_ptr.dtype.element_ty.primitive_bitwidth
    c = inv_temp * LOG2E
    # one item per program, by ticket, not by program id (the module's docstring)
    row, rank, b, t, lo, hi = _item(tl.atomic_add(tickets, 1), seq_len, chunk, chunks)
    row_ptr = row_start(logits_ptr, b, t, stride_batch, stride_row)
    target = tl.load(targets_ptr + row)
    arrived = sync_ptr + 2 + row
    if STATS:
        base, lead, end, full_end = row_span(row_ptr, V, TILE)
        m, s, u = span_state(base, tile_offsets(TILE, VEC), lead, end, full_end, lo, hi, c, cap, inv_cap, True,
                             HAS_CAP, TILE)
        part = partials_ptr + (row * chunks + rank) * PARTIALS
        tl.store(part, m)
        tl.store(part + 1, s)
        tl.store(part + 2, u)
        if rank == 0:
            tl.store(part + 3, target_logit(row_ptr, target, V))
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(arrived, 1, sem="release", scope="gpu")
    if GRAD:
        if STATS:  # one launch: wait for the row's peers (the interpreter's two launches never wait)
            while tl.atomic_add(arrived, 0, sem="acquire", scope="gpu") < chunks:
                pass
            tl.debug_barrier()
        ranks = tl.arange(0, CHUNKS_P2)
        peers = partials_ptr + (row * chunks + ranks) * PARTIALS
        there = ranks < chunks
        # .cg: from L2, where the peers' stores are, never a line this SM's L1 kept
        m, s, u = row_state(tl.load(peers, mask=there, other=float("-inf"), cache_modifier=".cg"),
                            tl.load(peers + 1, mask=there, other=0.0, cache_modifier=".cg"),
                            tl.load(peers + 2, mask=there, other=0.0, cache_modifier=".cg"), c, True)
        z_y = tl.load(partials_ptr + row * chunks * PARTIALS + 3, cache_modifier=".cg")
        logp, entropy, log_s = row_result(z_y, m, s, u, inv_temp, cap, inv_cap, True, HAS_CAP)
        grad_logp, grad_entropy, loss, clip_low, clip_high, ratio, approx_kl, kl, h_stat = row_loss(
            row, logp, entropy, mask_ptr, weight_ptr, adv_ptr, old_logp_ptr, ref_logp_ptr, is_weights_ptr,
            loss_params, OBJECTIVE, KL, HAS_OLD, HAS_REF, HAS_IS_WEIGHTS, BIAS_CORRECTION)
        if rank == 0:
            tl.store(logp_ptr + row, logp)
            tl.store(entropy_ptr + row, entropy)
            store_stats(stats_ptr + row * NUM_STATS, loss, clip_low, clip_high, ratio, approx_kl, kl, h_stat)
        h = 0.0
        row_entropy = 0.0
        if HAS_H:
            row_entropy = entropy
            if HAS_BONUS:
                h = tl.load(bonus_ptr + row) * scale
            else:
                h = grad_entropy * scale
        coef_target, coef_a, coef_b = grad_coefs(grad_logp * scale, h, row_entropy, inv_temp)
        _grad_chunk(row_ptr, row_start(out_ptr, b, t, stride_out_batch, stride_out_row), V, lo, hi, target,
                    z_y, m, log_s * LOG2E, c, coef_target, coef_a, coef_b, cap, inv_cap, HAS_H, HAS_CAP, BLOCK_V)


@triton.jit
def _item(ticket, seq_len, chunk, chunks):
    """(row, rank, b, t, lo, hi) of a ticket: the row n = b·T + t and its chunk [lo, hi) past the row's aligned
    base."""
    row = ticket // chunks
    rank = ticket - row * chunks
    b = row // seq_len
    lo = rank.to(tl.int64) * chunk
    return row, rank, b, row - b * seq_len, lo, lo + chunk


@triton.jit
def _grad_chunk(row_ptr, out_row_ptr, V, lo, hi, target, z_y, m, log2_s, c, coef_target, coef_a, coef_b, cap,
                inv_cap, HAS_H: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """∂logits of the row's elements at [lo, hi) past its 16-byte-aligned base (a chunk), as the backward kernel
    writes a whole row: whole tiles in 16-byte vectors where ``out`` has the logits' alignment, the first and last
    element by element, the target's term (its logit ``z_y``, read before any program wrote) after the chunk."""
    base, lead, end, full_end = row_span(row_ptr, V, BLOCK_V)
    out_base, out_lead = align_down(out_row_ptr)
    out_span = out_row_ptr - lead
    if out_lead == lead:
        offs = tile_offsets(BLOCK_V, 128 // row_ptr.dtype.element_ty.primitive_bitwidth)
        for start in range(tl.maximum(lo, BLOCK_V), tl.minimum(hi, full_end), BLOCK_V):
            _grad_tile(base + start, out_base + start, offs, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H,
                       HAS_CAP)
        head_hi = tl.minimum(tl.minimum(end, BLOCK_V), hi)  # the row's first tile, from its start
        tail_lo = tl.maximum(tl.maximum(full_end, BLOCK_V), lo)  # and its last, partial one
    else:  # the chunk element by element
        head_hi = tl.minimum(end, hi)
        tail_lo = head_hi
    _grad_span(base, out_span, tl.maximum(lead, lo), head_hi, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H,
               HAS_CAP, BLOCK_V)
    _grad_span(base, out_span, tail_lo, tl.minimum(end, hi), m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H,
               HAS_CAP, BLOCK_V)
    at = lead + target
    if (target >= 0) & (target < V) & (at >= lo) & (at < hi):
        tl.debug_barrier()  # the chunk's stores land before the target's own
        grad_y = dlogits(z_y, m, log2_s, c, coef_a, coef_b, coef_target, cap, inv_cap, HAS_H, HAS_CAP)
        tl.store(out_row_ptr + target, grad_y.to(out_row_ptr.dtype.element_ty))


def resident_floor(device):
    """Programs of any launchable kernel that are resident at once on `device` at the least: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def policy_token_fwd_grad(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, entropy_grad,
                          temperature, params, scale, out=None, softcap=0.0, *, wrap=plain):
    """(logp, entropy, stats, grad_logits): fp32 (N,), (N,), (N, 7), and ∂logits in the logits' shape and dtype
    (into ``out`` when given; it may be ``logits``). The arguments as in ``policy_token_fwd``, plus
    ``entropy_grad`` (N,) or None and ``scale`` (finite, nonzero) of kernels/__init__.py."""
    check_logits(logits, targets)
    (n, seq_len, *strides), vocab = row_layout(logits), logits.shape[-1]
    dev = logits.device
    if mask.shape != (n,):
        raise ValueError(f"mask: expected shape ({n},), got {tuple(mask.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale == 0:
        raise ValueError(f"scale: expected a finite nonzero number, got {scale!r}")
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=dev)
    elif out.shape != logits.shape or out.stride(-1) != 1 or out.device != dev or out.dtype != logits.dtype:
        raise ValueError(f"out: expected shape {tuple(logits.shape)} and dtype {logits.dtype} (those of logits) on "
                         f"{dev} with unit stride over V, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    mask = mask.to(device=dev, dtype=torch.bool).contiguous()
    weight, adv = row_vector(weight, n, dev, "weight"), row_vector(adv, n, dev, "adv")
    given = {name: None if x is None else row_vector(x, n, dev, name)
             for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("is_weights", is_weights),
                             ("entropy_grad", entropy_grad))}
    logp, entropy = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
    stats = torch.empty(n, P.NUM_STATS, dtype=torch.float32, device=dev)
    if n == 0:
        return logp, entropy, stats, out
    block, warps, chunk, chunks = split_plan(vocab, logits.dtype)
    if n * chunks >= 2 ** 31:
        raise ValueError(f"logits: {n} rows of {chunks} chunks are more work items than an int32 ticket counts")
    p = params
    kl = p.kl_estimator if p.kl_coef > 0 else P.KL_NONE
    has_bonus = given["entropy_grad"] is not None
    cap, has_cap = cap_args(softcap)
    # One launch where K programs are surely resident together (the module's docstring), else two.
    one_launch = not INTERPRET and chunks <= resident_floor(dev)
    partials = torch.empty(n * chunks, PARTIALS.value, dtype=torch.float32, device=dev)
    sync = torch.zeros(2 + n, dtype=torch.int32, device=dev)  # fresh counters each call
    args = (logits, targets.to(torch.int64).contiguous(), mask, weight, adv,
            *(adv if x is None else x for x in given.values()),  # absent: never read
            logp, entropy, stats, out, partials, sync,
            vocab, seq_len, *strides, *row_layout(out)[2:], chunk, chunks,
            1.0 / float(temperature), *cap, float(scale), p.packed())
    flags = dict(OBJECTIVE=int(p.objective), KL=int(kl), HAS_OLD=given["old_logp"] is not None,
                 HAS_REF=given["ref_logp"] is not None, HAS_IS_WEIGHTS=given["is_weights"] is not None,
                 BIAS_CORRECTION=bool(p.kl_bias_correction), NUM_STATS=P.NUM_STATS, HAS_CAP=has_cap,
                 HAS_H=has_bonus or p.entropy_coef != 0, HAS_BONUS=has_bonus,
                 CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK_V=block, num_warps=warps)
    maxnreg = register_cap(has_cap)
    if maxnreg is not None:
        flags["maxnreg"] = maxnreg
    with on_device(dev):
        for phases in ((True, True),) if one_launch else ((True, False), (False, True)):
            wrap(_split_row_kernel)[(n * chunks,)](*args, STATS=phases[0], GRAD=phases[1], **flags)
    return logp, entropy, stats, out

