"""Per-element math of one row of logits, shared by the Triton kernels.

A row of logits ``z`` at temperature τ is streamed in tiles of ``[LANES, VEC]`` logits, VEC of them
(16 bytes) per lane, fp32, lanes past the row set to -inf. Each lane keeps its own online-softmax state
over the logits it has seen: the max ``m`` of the raw logits, ``s = Σ e^d`` and, for the entropy,
``u = Σ e^d·d₂``, with ``d = (z − m)/τ`` and ``d₂ = d·log₂e``. A tile costs one rescale per lane and,
per logit, its share of the lane's max, one exponential and one or two adds; the lanes are merged once
per row (`row_state`), not reduced across the block at every tile. τ scales differences only, never a
logit: ``z/τ`` overflows fp32 near 3e38 at τ < 1. Accumulating ``d`` rather than ``z/τ`` keeps the
entropy ``H = log s − u·ln2/s`` free of the cancellation that ``lse − Σ p·x`` suffers for large logits,
and both of its terms are ≥ 0.

Exponentials are base 2: e^d = 2^{(z − m)·c} with c = log₂e/τ, one product per logit (rounded on its own,
as d is in the other backends) and ex2.approx.ftz when compiled (results below 2^-126 are flushed to 0,
below 1e-38 of the sum's largest term, 1).

-inf logits are valid. The state keeps ``(-inf) − (-inf)`` and ``0 · (-inf)`` from ever being formed
(they would poison the sums with NaN): while every value a lane has seen is -inf, its ``m`` is -inf,
``s = u = 0`` and its logits are shifted by 0 instead of by ``m``; and every d₂ that multiplies an
exponential is first clamped to EXP2_FLOOR, where 2^d₂ is 0 exactly. The clamp lets NaN through: a row
of only -inf (or with a NaN or +inf) gives NaN log-probs and entropy, as log_softmax does.

A final-logit cap c (Gemma 2 and 3) replaces each logit z by ``c·tanh(z/c)`` as it is loaded
(`capped`; -inf stays -inf, as in row_math.h), and the backward multiplies by ``(1 − t)(1 + t)``.

The row is summarised by the pair ``(m, log s)``, never by ``lse = m/τ + log s``: that sum rounds
to ulp(m/τ), which for large logits costs more than every other rounding together (docs/design.md §2).
"""

import triton
import triton.language as tl
# Unqualified, for torch.compile (logprobs.py).
from triton.language.extra.cuda.libdevice import mul_rn, tanh

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# 2^x is exactly 0 in fp32 below -150 (-126 flushed). A clamped d₂ keeps e·d₂ and δ·s finite (0 and
# small) where d₂ would be -inf or ~ -1e38; as -128 in natural units in csrc/include/rlkernels/row_math.h.
EXP2_FLOOR = tl.constexpr(-192.0)

# Compiled kernels round d on its own and take the fast exponential (below); the interpreter cannot
# call libdevice or inline PTX, and rounds every product anyway.
COMPILED = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def mul_rounded(a, b):
    """a·b in fp32, rounded before any use. Left to the compiler, a product is fused with the add or
    subtract that follows into one FMA, and values that must cancel exactly would not (as in
    row_math.h's mul_rn)."""
    if COMPILED:
        return mul_rn(a, b)
    else:
        return a * b


@triton.jit
def scaled_diff(z, m, scale):
    """(z − m)·scale, rounded alone: fused with the − log s that follows, log p would round differently
    in the forward, the entropy and the backward."""
    return mul_rounded(z - m, scale)


@triton.jit
def exp2(x):
    """2^x: one MUFU.EX2 when compiled (Triton's own exp2 adds a scaling around it for subnormal results)."""
    if COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def clamp_floor(d2):
    """max(d₂, EXP2_FLOOR), NaN kept: one instruction, where a `where` on the exponential takes two."""
    return tl.maximum(d2, EXP2_FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tanh_of(z, inv_cap):
    """tanh(z/c): libdevice's (2 ulp) when compiled; the interpreter cannot call libdevice and
    uses (1 − e)/(1 + e), e = e^{−2|u|}, in fp64 (numpy). That cancels as |u| → 0, where a large cap
    puts every logit, so below 1e-3 it takes u − u³/3 (relative error < 1e-12 on either side)."""
    u = z * inv_cap
    if COMPILED:
        return tanh(u)
    else:
        a = tl.abs(u).to(tl.float64)
        e = tl.exp(-2.0 * a)
        t = tl.where(a < 1e-3, a - a * a * a / 3.0, (1.0 - e) / (1.0 + e))
        return tl.where(u < 0.0, -t, t).to(u.dtype)


@triton.jit
def capped(z, t, cap):
    """c·tanh(z/c) from t = tanh_of(z); -inf stays -inf (masked entries and the tiles' padding). The
    product is rounded alone (as SoftCap::capped in row_math.h): the max is of the rounded values, and
    contracted into the y − m that follows, the max logit would not give d = 0 exactly."""
    return tl.where(z == float("-inf"), z, mul_rounded(cap, t))


@triton.jit
def cap_tile(z, cap, inv_cap, HAS_CAP: tl.constexpr):
    """The logits the softmax sees: z, or c·tanh(z/c) under a cap."""
    if HAS_CAP:
        z = capped(z, tanh_of(z, inv_cap), cap)
    return z


@triton.jit
def _finite_or_zero(m):
    # The shift to subtract: m itself, or 0 while m is still -inf.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def lane_update(m, s, u, z, c, NEED_ENTROPY: tl.constexpr):
    """Fold the tile ``z [LANES, VEC]`` into the lanes' states ``(m, s, u)`` (each ``[LANES]``), c = log₂e/τ."""
    m_new = tl.maximum(m, tl.max(z, axis=1))  # the max ignores NaN; z − m below does not
    shift = _finite_or_zero(m_new)
    # Rescale the old sums to the new max: Σ e^{d'}d₂' = α (u + δ s), α = 2^δ, δ = (m − m')·c.
    # While m is -inf: s = u = 0 and α = 0, δ clamped to a finite value so that 0·(-inf) never forms.
    delta = scaled_diff(m, shift, c)
    d = scaled_diff(z, shift[:, None], c)
    if NEED_ENTROPY:
        delta = clamp_floor(delta)
        d = clamp_floor(d)
    alpha = exp2(delta)
    e = exp2(d)
    if NEED_ENTROPY:
        u = alpha * (u + delta * s) + tl.sum(e * d, axis=1)
    return m_new, alpha * s + tl.sum(e, axis=1), u


@triton.jit
def row_state(m, s, u, c, NEED_ENTROPY: tl.constexpr):
    """The row's (m, s, u) from its lanes' states: the lanes rescaled to the row's max and summed."""
    m_row = tl.max(m, axis=0)
    delta = clamp_floor(scaled_diff(m, _finite_or_zero(m_row), c))
    alpha = exp2(delta)
    u_row = 0.0
    if NEED_ENTROPY:
        u_row = tl.sum(alpha * (u + delta * s), axis=0)
    return m_row, tl.sum(alpha * s, axis=0), u_row


@triton.jit
def log_prob(z, m, log_s, inv_temp):
    """log p = (z − m)/τ − log s."""
    return scaled_diff(z, m, inv_temp) - log_s


@triton.jit
def row_entropy(log_s, s, u):
    """H = lse − Σ p·x = log s − u·ln2/s from the row's (s, u)."""
    return log_s - (u * LN2) / s


@triton.jit
def dlogits(z, m, log2_s, c, coef_a, coef_b, target_term, cap, inv_cap, HAS_H: tl.constexpr, HAS_CAP: tl.constexpr):
    """∂L/∂z = (1/τ)[g(1[v=y] − p) − h p (log p + H)] = p(A + B₂·log₂p) + 1[v=y]·g/τ for a tile of logits
    ``z`` (fp32), with log₂p = (z − m)·c − log₂s, c = log₂e/τ, A = −(g + hH)/τ, B₂ = −h·ln2/τ (row_math.h's
    grad_element in base 2) and target_term the last term (0, or g/τ at the target); under a cap, of
    y = c·tanh(z/c) and times dy/dz."""
    t = 0.0
    if HAS_CAP:
        t = tanh_of(z, inv_cap)
        z = capped(z, t, cap)
    l2 = scaled_diff(z, m, c) - log2_s
    q = coef_a
    if HAS_H:
        # p·log p → 0 as p → 0; at z = -inf (and outside the row) it would be 0·(-inf).
        l2 = clamp_floor(l2)
        q = coef_a + coef_b * l2
    grad = exp2(l2) * q + target_term
    if HAS_CAP:
        grad = grad * ((1.0 - t) * (1.0 + t))
    return grad
