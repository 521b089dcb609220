"""Per-element math of one row of logits, shared by the Triton kernels.

A row of logits ``z`` at temperature τ is streamed in tiles (fp32, lanes past V set to -inf). The
running state is the max ``m`` of the raw logits, ``s = Σ e^d`` and, for the entropy,
``t = Σ e^d·d``, with ``d = (z − m)/τ``. τ scales differences only, never a logit: ``z/τ``
overflows fp32 near 3e38 at τ < 1. Accumulating ``d`` rather than ``z/τ`` keeps the entropy
``H = log s − t/s`` free of the cancellation that ``lse − Σ p·x`` suffers for large logits, and
both of its terms are ≥ 0.

-inf logits are valid. The guards below keep ``(-inf) − (-inf)`` and ``0 · (-inf)`` from ever
being formed (they would poison the sums with NaN): while every value seen so far is -inf,
``m`` is -inf, ``s = t = 0`` and the tile is shifted by 0 instead of by ``m``. A row of only
-inf (or with a NaN or +inf) gives NaN log-probs and entropy, as log_softmax does.

A final-logit cap c (Gemma 2 and 3) replaces each logit z by ``c·tanh(z/c)`` as it is loaded
(`capped`; -inf stays -inf, as in row_math.h), and the backward multiplies by ``(1 − t)(1 + t)``.

The row is summarised by the pair ``(m, log s)``, never by ``lse = m/τ + log s``: that sum rounds
to ulp(m/τ), which for large logits costs more than every other rounding together (docs/design.md §2).
"""

import triton
import triton.language as tl
# Unqualified, for torch.compile (token_logprobs.py).
from triton.language.extra.cuda.libdevice import mul_rn, tanh

# exp(d) is exactly 0 in fp32 below about -104; a rescale by less is clamped here (as in
# csrc/include/rlkernels/row_math.h), so that δ·s stays finite where δ would be ~ -1e38.
EXP_FLOOR = tl.constexpr(-128.0)


# Compiled kernels round d on its own (below); the interpreter cannot call libdevice and
# rounds every product anyway.
ROUND_ALONE = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def scaled_diff(z, m, inv_temp):
    """d = (z − m)·(1/τ) in fp32, rounded before any use. Left to the compiler, the product is
    fused with the − log s that follows into one FMA, and log p would round differently in the
    forward, the entropy and the backward (as in row_math.h's mul_rn)."""
    if ROUND_ALONE:
        return mul_rn(z - m, inv_temp)
    else:
        return (z - m) * inv_temp


@triton.jit
def tanh_of(z, inv_cap):
    """tanh(z/c): libdevice's (2 ulp) when compiled; the interpreter cannot call libdevice and
    uses (1 − e)/(1 + e), e = e^{−2|u|}, which is as accurate away from 0 and loses up to ~1e-7
    absolutely near 0 (fp32 numpy exp)."""
    u = z * inv_cap
    if ROUND_ALONE:
        return tanh(u)
    else:
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(u < 0.0, -t, t)


@triton.jit
def capped(z, t, cap):
    """c·tanh(z/c) from t = tanh_of(z); -inf stays -inf (masked entries and the tiles' padding)."""
    return tl.where(z == float("-inf"), z, cap * t)


@triton.jit
def _finite_or_zero(m):
    # The shift to subtract: m itself, or 0 while m is still -inf.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def tile_update(m, s, z, inv_temp):
    """Fold the tile ``z`` into (m, s) for the log-sum-exp. Returns (m, s)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    shift = _finite_or_zero(m_new)
    s_new = s * tl.exp(scaled_diff(m, shift, inv_temp)) + tl.sum(tl.exp(scaled_diff(z, shift, inv_temp)), axis=0)
    return m_new, s_new


@triton.jit
def tile_update_entropy(m, s, t, z, inv_temp):
    """Fold the tile ``z`` into (m, s, t). Returns (m, s, t)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    shift = _finite_or_zero(m_new)
    # Rescale the old sums to the new max: Σ e^{d'}d' = α (t + δ s), α = e^δ, δ = (m − m')/τ.
    # While m is -inf: s = t = 0, α = 0, and δ is clamped to a finite value so 0·(-inf) never forms.
    delta = scaled_diff(m, shift, inv_temp)
    alpha = tl.exp(delta)
    t_old = alpha * (t + tl.maximum(delta, EXP_FLOOR) * s)
    d = scaled_diff(z, shift, inv_temp)
    e = tl.exp(d)
    # e = 0 exactly where z = -inf (or underflows); those lanes add nothing to t.
    t_new = t_old + tl.sum(e * tl.where(e > 0.0, d, 0.0), axis=0)
    s_new = s * alpha + tl.sum(e, axis=0)
    return m_new, s_new, t_new


@triton.jit
def log_prob(z, m, log_s, inv_temp):
    """log p = (z − m)/τ − log s."""
    return scaled_diff(z, m, inv_temp) - log_s


@triton.jit
def row_entropy(log_s, s, t):
    """H = lse − Σ p·x = log s − t/s from the final (s, t)."""
    return log_s - t / s


@triton.jit
def dlogits(z, is_target, m, log_s, entropy, g, h, inv_temp, cap, inv_cap, HAS_H: tl.constexpr,
            HAS_CAP: tl.constexpr):
    """∂L/∂z = (1/τ)[g(1[v=y] − p) − h p (log p + H)] for a tile of logits ``z`` (fp32); under a cap,
    of y = c·tanh(z/c) and times dy/dz."""
    t = 0.0
    if HAS_CAP:
        t = tanh_of(z, inv_cap)
        z = capped(z, t, cap)
    logp = log_prob(z, m, log_s, inv_temp)
    p = tl.exp(logp)
    grad = g * (is_target.to(tl.float32) - p)
    if HAS_H:
        # p·log p → 0 as p → 0; at z = -inf (and past V) it would be 0·(-inf).
        grad -= h * p * tl.where(p > 0.0, logp + entropy, 0.0)
    grad = grad * inv_temp
    if HAS_CAP:
        grad = grad * ((1.0 - t) * (1.0 + t))
    return grad
