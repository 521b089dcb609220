"""Triton kernels for per-token log-probs and entropy (docs/design.md §2).

Forward: one program per row streams the row once in BLOCK_V tiles (`row_forward`, also the
pass of policy_token.py), each lane of a tile keeping its own online max of the raw logits, rescaled
Σ e^d and (for the entropy) Σ e^d·d in fp32, d = (z − m)/τ, merged once at the end of the row; the
target logit is one scalar load, masked to the row (a target outside [0, V) gives NaN). Backward:
one program per row reads the row once and writes ∂logits once, from the saved (m, log s) (and
entropy). The math per tile lives in ``row_math.py``.

Tiles are aligned to 16 bytes, whatever V and the row stride: the first starts at the row's start
rounded down to 16 bytes, and it and the last are loaded with a mask (to the row); every tile
between them is whole, loaded without a mask in 16-byte vectors (`row_span`).

Logits (N, V) or (B, T, V) with unit stride over V: row n = b·T + t lies at b·(batch stride) +
t·(row stride) (`row_start`), a program per row on a 2-D grid (t, b), so a view such as ``logits[:, :-1]``
is read in one launch; ``out`` has its own strides.

I/O per row (b = bytes per logit): forward reads V·b, backward reads V·b and writes V·b.
"""

import torch
import triton
import triton.language as tl

from .launch import cap_args, check_logits, launch_config, on_device, plain, row_grids, row_layout, row_vector

# Imported by name: torch.compile re-emits a user kernel with the jit functions it calls, found
# by their global names (a module attribute such as row_math.f is not followed).
from .row_math import (
    LN2, LOG2E, cap_tile, dlogits, lane_update, log_prob, mul_rounded, row_entropy, row_state,
)


@triton.jit
def tile_offsets(BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """Offsets of a tile as [BLOCK_V // VEC, VEC]: each lane holds VEC consecutive logits."""
    return tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def align_down(ptr):
    """(ptr rounded down to 16 bytes, the elements between them)."""
    lead = ((ptr.to(tl.int64) % 16) * 8 // ptr.dtype.element_ty.primitive_bitwidth).to(tl.int32)
    return tl.multiple_of(ptr - lead, 16), lead


@triton.jit
def row_span(row_ptr, V, BLOCK_V: tl.constexpr):
    """(base, lead, end, full_end): the row lies at [lead, end) past ``base``, its start rounded down to
    16 bytes; the tiles that start below ``full_end`` past it are whole."""
    base, lead = align_down(row_ptr)
    end = lead + V
    return base, lead, end, end - end % BLOCK_V


@triton.jit
def load_tile(ptr, offs, lo, hi, MASKED: tl.constexpr):
    """The tile at ``ptr`` in fp32; MASKED: only offsets in [lo, hi), the others -inf."""
    if MASKED:
        z = tl.load(ptr + offs, mask=(offs >= lo) & (offs < hi), other=float("-inf"))
    else:
        z = tl.load(ptr + offs)
    return z.to(tl.float32)


@triton.jit
def program_row(seq_len, first_batch):
    """(row, b, t) of this program (launch.row_grids): t along the grid's x, b = first_batch + its y, row
    = b·T + t (int64: row * stride may exceed 2^31). No division: with one (row // T on a 1-D grid) the
    backward spilled at its 32 registers (`python -m benchmarks.gpu_static`)."""
    t = tl.program_id(0)
    b = tl.program_id(1) + first_batch
    return b.to(tl.int64) * seq_len + t, b, t


@triton.jit
def row_start(ptr, b, t, stride_batch, stride_row):
    """Where row t of sequence b starts in logits (B, T, V) of these strides (launch.row_layout)."""
    return ptr + b.to(tl.int64) * stride_batch + t.to(tl.int64) * stride_row


@triton.jit
def row_forward(row_ptr, target, V, inv_temp, cap, inv_cap, NEED_ENTROPY: tl.constexpr, HAS_CAP: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """(logp, entropy, m, log s) of the row at ``row_ptr``, streamed once; entropy is 0 unless
    NEED_ENTROPY; HAS_CAP: the logits are capped as loaded. The one pass over the logits that every
    forward kernel makes."""
    VEC: tl.constexpr = 128 // row_ptr.dtype.element_ty.primitive_bitwidth
    # Half the launch's tile at a time (the backward streams whole ones): a cap's tanh holds registers until the
    # lane's max, and without the entropy Triton 3.6's ptxas kept a whole tile's loads and math in flight (61
    # registers at 16 bits, 1024 threads per SM; gpu_static). One tile for every flag: the same lanes, so logp and
    # (m, log s) are the same bits with or without the entropy, the cap aside.
    TILE: tl.constexpr = BLOCK_V // 2
    offs = tile_offsets(TILE, VEC)
    c = inv_temp * LOG2E
    base, lead, end, full_end = row_span(row_ptr, V, TILE)
    m, s, u = span_state(base, offs, lead, end, full_end, 0, end, c, cap, inv_cap, NEED_ENTROPY, HAS_CAP, TILE)
    logp, entropy, log_s = row_result(target_logit(row_ptr, target, V), m, s, u, inv_temp, cap, inv_cap,
                                      NEED_ENTROPY, HAS_CAP)
    return logp, entropy, m, log_s


@triton.jit
def span_state(base, offs, lead, end, full_end, lo, hi, c, cap, inv_cap, NEED_ENTROPY: tl.constexpr,
               HAS_CAP: tl.constexpr, TILE: tl.constexpr):
    """(m, s, u) of the logits at [lo, hi) ∩ [lead, end) past ``base`` (`row_span`'s terms; ``lo`` a multiple of
    TILE), merged over the lanes: the whole row (0, end) in `row_forward`, a chunk of it in split_row.py."""
    LANES: tl.constexpr = TILE * base.dtype.element_ty.primitive_bitwidth // 128
    m = tl.full([LANES], float("-inf"), tl.float32)
    s = tl.zeros([LANES], tl.float32)
    u = tl.zeros([LANES], tl.float32)
    z = load_tile(base + lo, offs, lead - lo, end - lo, True)
    m, s, u = lane_update(m, s, u, cap_tile(z, cap, inv_cap, HAS_CAP), c, NEED_ENTROPY)
    for start in range(lo + TILE, tl.minimum(hi, full_end), TILE):
        z = load_tile(base + start, offs, 0, 0, False)
        m, s, u = lane_update(m, s, u, cap_tile(z, cap, inv_cap, HAS_CAP), c, NEED_ENTROPY)
    if (full_end > lo) & (full_end < hi) & (full_end < end):
        z = load_tile(base + full_end, offs, 0, end - full_end, True)
        m, s, u = lane_update(m, s, u, cap_tile(z, cap, inv_cap, HAS_CAP), c, NEED_ENTROPY)
    return row_state(m, s, u, c, NEED_ENTROPY)


@triton.jit
def target_logit(row_ptr, target, V):
    """The target's raw logit (fp32) of the row at ``row_ptr``; NaN for a target outside [0, V), which would read
    another row's logit: nothing is loaded then."""
    in_row = (target >= 0) & (target < V)
    return tl.load(row_ptr + target, mask=in_row, other=float("nan")).to(tl.float32)


@triton.jit
def row_result(z_y, m, s, u, inv_temp, cap, inv_cap, NEED_ENTROPY: tl.constexpr, HAS_CAP: tl.constexpr):
    """(logp, entropy, log s) of a row from its (m, s, u) and target logit; entropy 0 unless NEED_ENTROPY."""
    log_s = tl.log(s)
    entropy = 0.0
    if NEED_ENTROPY:
        entropy = row_entropy(log_s, s, u)
    # The same fp32 d as in the loop, so z_y ≤ m, 0 ≤ log s and logp ≤ 0 exactly.
    return log_prob(cap_tile(z_y, cap, inv_cap, HAS_CAP), m, log_s, inv_temp), entropy, log_s


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_parts_ptr,
    V, seq_len, first_batch, stride_batch, stride_row, inv_temp, cap, inv_cap,
    NEED_ENTROPY: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row, b, t = program_row(seq_len, first_batch)
    target = tl.load(targets_ptr + row)
    logp, entropy, m, log_s = row_forward(row_start(logits_ptr, b, t, stride_batch, stride_row), target, V,
                                          inv_temp, cap, inv_cap, NEED_ENTROPY, HAS_CAP, BLOCK_V)
    tl.store(logp_ptr + row, logp)
    tl.store(lse_parts_ptr + 2 * row, m)
    tl.store(lse_parts_ptr + 2 * row + 1, log_s)
    if NEED_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


@triton.jit
def grad_coefs(g, h, entropy, inv_temp):
    """(g/τ, A, B₂) of `dlogits` from the row's g = ∂/∂ℓ, h = ∂/∂H and entropy."""
    # Rounded alone: at p = 1 (one finite logit) coef_target + coef_a must be exactly 0.
    coef_target = mul_rounded(g, inv_temp)
    coef_a = -mul_rounded(g + h * entropy, inv_temp)
    coef_b = -h * inv_temp * LN2
    return coef_target, coef_a, coef_b


@triton.jit
def _grad_tile(z_ptr, out_ptr, offs, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H: tl.constexpr,
               HAS_CAP: tl.constexpr):
    """∂logits but the target's term of the whole tile at z_ptr (16-byte aligned) into out_ptr (alike). Each
    element is read before it is written, so `out` may be the logits themselves."""
    z = tl.load(z_ptr + offs).to(tl.float32)
    grad = dlogits(z, m, log2_s, c, coef_a, coef_b, 0.0, cap, inv_cap, HAS_H, HAS_CAP)
    tl.store(out_ptr + offs, grad.to(out_ptr.dtype.element_ty))


@triton.jit
def _grad_span(z_ptr, out_ptr, lo, hi, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H: tl.constexpr,
               HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """∂logits but the target's term of the elements [lo, hi) past z_ptr into the same places past out_ptr,
    at any alignment: a few per thread and step, loaded and stored alike. (A masked tile of 16-byte
    vectors would be stored from another layout, through shared memory, whose registers and bytes
    would count against every launch.)"""
    cols = tl.arange(0, BLOCK_V // 8)
    for start in range(lo, hi, BLOCK_V // 8):
        offs = start + cols
        z = tl.load(z_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        grad = dlogits(z, m, log2_s, c, coef_a, coef_b, 0.0, cap, inv_cap, HAS_H, HAS_CAP)
        tl.store(out_ptr + offs, grad.to(out_ptr.dtype.element_ty), mask=offs < hi)


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr, targets_ptr, lse_parts_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, out_ptr,
    V, seq_len, first_batch, stride_batch, stride_row, stride_out_batch, stride_out_row, inv_temp, cap, inv_cap,
    HAS_H: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row, b, t = program_row(seq_len, first_batch)
    row_ptr = row_start(logits_ptr, b, t, stride_batch, stride_row)
    base, lead, end, full_end = row_span(row_ptr, V, BLOCK_V)
    out_row_ptr = row_start(out_ptr, b, t, stride_out_batch, stride_out_row)
    out_base, out_lead = align_down(out_row_ptr)

    target = tl.load(targets_ptr + row)
    m = tl.load(lse_parts_ptr + 2 * row)
    log_s = tl.load(lse_parts_ptr + 2 * row + 1)
    g = tl.load(grad_logp_ptr + row)
    if HAS_H:
        entropy = tl.load(entropy_ptr + row)
        h = tl.load(grad_entropy_ptr + row)
    else:
        entropy = 0.0
        h = 0.0
    coef_target, coef_a, coef_b = grad_coefs(g, h, entropy, inv_temp)
    log2_s = log_s * LOG2E
    c = inv_temp * LOG2E
    # The target's term is added once, after the row (a select per logit would cost two instructions
    # and, hoisted by ptxas, ~25 registers): its logit is read first, before any thread writes `out`,
    # which may be the logits; the row's stores all land before the target's own.
    in_row = (target >= 0) & (target < V)
    z_y = tl.load(row_ptr + target, mask=in_row, other=0.0).to(tl.float32)
    tl.debug_barrier()
    if out_lead == lead:  # empty_like(logits), or the logits themselves: whole tiles in 16-byte vectors
        offs = tile_offsets(BLOCK_V, 128 // logits_ptr.dtype.element_ty.primitive_bitwidth)
        for start in range(BLOCK_V, full_end, BLOCK_V):
            _grad_tile(base + start, out_base + start, offs, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H,
                       HAS_CAP)
        hi = tl.minimum(end, BLOCK_V)  # the first tile, from the row's start, and the last, partial one
        lo = tl.maximum(full_end, BLOCK_V)
    else:  # the whole row element by element
        hi = end
        lo = end
    _grad_span(base, out_row_ptr - lead, lead, hi, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H, HAS_CAP,
               BLOCK_V)
    _grad_span(base, out_row_ptr - lead, lo, end, m, log2_s, c, coef_a, coef_b, cap, inv_cap, HAS_H, HAS_CAP,
               BLOCK_V)
    tl.debug_barrier()
    grad_y = dlogits(z_y, m, log2_s, c, coef_a, coef_b, coef_target, cap, inv_cap, HAS_H, HAS_CAP)
    tl.store(out_row_ptr + target, grad_y.to(out_ptr.dtype.element_ty), mask=in_row)


def token_logprobs_fwd(logits, targets, temperature, need_entropy, softcap=0.0, *, wrap=plain):
    """(logp, entropy, lse_parts): fp32, (N,), (N,) and (N, 2) = [m, log s]; entropy is empty
    unless ``need_entropy``; logp is NaN where a target is outside [0, V).

    ``wrap``: applied to the kernel before launch; ``torch.library.wrap_triton`` inside a
    ``triton_op`` lets torch.compile see the launch (the default launches it directly).
    """
    check_logits(logits, targets)
    (n, seq_len, *strides), vocab = row_layout(logits), logits.shape[-1]
    targets = targets.to(torch.int64).contiguous()
    dev = logits.device
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    lse_parts = torch.empty(n, 2, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if need_entropy else 0, dtype=torch.float32, device=dev)
    if n == 0:
        return logp, entropy, lse_parts
    block, warps = launch_config(vocab, logits.dtype)
    cap, has_cap = cap_args(softcap)
    with on_device(dev):
        for grid, first_batch in row_grids(n, seq_len):
            wrap(_token_logprobs_fwd_kernel)[grid](
                logits, targets, logp, entropy if need_entropy else logp, lse_parts,
                vocab, seq_len, first_batch, *strides, 1.0 / float(temperature), *cap,
                NEED_ENTROPY=bool(need_entropy), HAS_CAP=has_cap, BLOCK_V=block, num_warps=warps,
            )
    return logp, entropy, lse_parts


def token_logprobs_bwd(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature,
                       out=None, softcap=0.0, *, wrap=plain):
    """∂L/∂logits, the shape of the logits ((N, V) or (B, T, V)) in their dtype.

    ``grad_entropy=None`` means 0 (``entropy`` is then not read). ``out`` (optional): a float
    tensor of the logits' shape with unit stride over V (any other strides) to write into, of any float dtype; it may be
    ``logits`` itself (each tile is read before it is overwritten). ``wrap``: as in
    ``token_logprobs_fwd``.
    """
    check_logits(logits, targets)
    (n, seq_len, *strides), vocab = row_layout(logits), logits.shape[-1]
    dev = logits.device
    if out is None:
        out = torch.empty_like(logits)
    elif out.shape != logits.shape or out.stride(-1) != 1 or out.device != dev:
        raise ValueError(f"out: expected shape {tuple(logits.shape)} (that of logits) on {dev} with unit stride over V")
    if n == 0:
        return out
    targets = targets.to(torch.int64).contiguous()
    lse_parts = row_vector(lse_parts, n, dev, "lse_parts", (2,))
    if grad_logp is None:
        grad_logp = torch.zeros(n, dtype=torch.float32, device=dev)
    grad_logp = row_vector(grad_logp, n, dev, "grad_logp")
    has_h = grad_entropy is not None
    if has_h:
        entropy = row_vector(entropy, n, dev, "entropy")
        grad_entropy = row_vector(grad_entropy, n, dev, "grad_entropy")
    else:
        entropy = grad_entropy = grad_logp  # never read
    block, warps = launch_config(vocab, logits.dtype)
    cap, has_cap = cap_args(softcap)
    with on_device(dev):
        for grid, first_batch in row_grids(n, seq_len):
            wrap(_token_logprobs_bwd_kernel)[grid](
                logits, targets, lse_parts, entropy, grad_logp, grad_entropy, out,
                vocab, seq_len, first_batch, *strides, *row_layout(out)[2:], 1.0 / float(temperature), *cap,
                HAS_H=has_h, HAS_CAP=has_cap, BLOCK_V=block, num_warps=warps,
            )
    return out
