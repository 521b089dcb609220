"""Per-element math of one row of logits, shared by the Triton kernels.

A row is streamed in tiles of ``x = z / τ`` (fp32, lanes past V set to -inf). The running
state is the max ``m``, ``s = Σ e^{x−m}`` and, for the entropy, ``t = Σ e^{x−m}·(x−m)``.
Accumulating ``x − m`` rather than ``x`` keeps the entropy ``H = log s − t/s`` free of the
cancellation that ``lse − Σ p·x`` suffers for large logits, and both of its terms are ≥ 0.

-inf logits are valid. The guards below keep ``(-inf) − (-inf)`` and ``0 · (-inf)`` from ever
being formed (they would poison the sums with NaN): while every value seen so far is -inf,
``m`` is -inf, ``s = t = 0`` and the tile is shifted by 0 instead of by ``m``. A row of only
-inf (or with a NaN or +inf) gives NaN log-probs and entropy, as log_softmax does.

The row is summarised by the pair ``(m, log s)``, never by ``lse = m + log s``: that sum rounds
to ulp(m), which for large logits costs more than every other rounding together (docs/design.md §2).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda.libdevice import mul_rn  # unqualified, for torch.compile (token_logprobs.py)

# exp(d) is exactly 0 in fp32 below about -104; a rescale by less is clamped here (as in
# csrc/include/rlkernels/row_math.h), so that δ·s stays finite where δ would be ~ -1e38.
EXP_FLOOR = tl.constexpr(-128.0)


# Compiled kernels round x = z/τ on its own (below); the interpreter cannot call libdevice and
# rounds every product anyway.
ROUND_ALONE = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def scaled(z, inv_temp):
    """x = z·(1/τ) in fp32, rounded before any use. Left to the compiler, the product is fused with
    the x − m that follows into one FMA: at the row max x − m is then the rounding error of z/τ,
    not 0 (log p > 0 in a one-logit row, p ≠ 1; seen on an H200), and the backward's x − m differs
    from the forward's."""
    if ROUND_ALONE:
        return mul_rn(z, inv_temp)
    else:
        return z * inv_temp


@triton.jit
def _finite_or_zero(m):
    # The shift to subtract: m itself, or 0 while m is still -inf.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def tile_update(m, s, x):
    """Fold the tile ``x`` into (m, s) for the log-sum-exp. Returns (m, s)."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = _finite_or_zero(m_new)
    s_new = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
    return m_new, s_new


@triton.jit
def tile_update_entropy(m, s, t, x):
    """Fold the tile ``x`` into (m, s, t). Returns (m, s, t)."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = _finite_or_zero(m_new)
    # Rescale the old sums to the new max: Σ e^{x−m'}(x−m') = α (t + (m − m') s), α = e^{m−m'}.
    # While m is -inf: s = t = 0, α = 0, and m − m' is taken as finite so 0·(-inf) never forms.
    alpha = tl.exp(m - shift)
    t_old = alpha * (t + tl.maximum(_finite_or_zero(m) - shift, EXP_FLOOR) * s)
    d = x - shift
    e = tl.exp(d)
    # e = 0 exactly where x = -inf (or underflows); those lanes add nothing to t.
    t_new = t_old + tl.sum(e * tl.where(e > 0.0, d, 0.0), axis=0)
    s_new = s * alpha + tl.sum(e, axis=0)
    return m_new, s_new, t_new


@triton.jit
def log_prob(x, m, log_s):
    """log p = (x − m) − log s."""
    return (x - m) - log_s


@triton.jit
def row_entropy(log_s, s, t):
    """H = lse − Σ p·x = log s − t/s from the final (s, t)."""
    return log_s - t / s


@triton.jit
def dlogits(x, is_target, m, log_s, entropy, g, h, inv_temp, HAS_H: tl.constexpr):
    """∂L/∂z = (1/τ)[g(1[v=y] − p) − h p (log p + H)] for a tile of ``x = z/τ`` (fp32)."""
    logp = log_prob(x, m, log_s)
    p = tl.exp(logp)
    grad = g * (is_target.to(tl.float32) - p)
    if HAS_H:
        # p·log p → 0 as p → 0; at x = -inf (and past V) it would be 0·(-inf).
        grad -= h * p * tl.where(p > 0.0, logp + entropy, 0.0)
    return grad * inv_temp
