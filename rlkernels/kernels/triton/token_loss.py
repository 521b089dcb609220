"""The token-level policy loss of one token (kernels/__init__.py, ``policy_token_fwd``), in fp32.

The objectives' surrogates are generated from their formulas in the table (token_loss_surrogates.py,
rlkernels/kernels/derive_token_loss.py); the ratio, the KL term, the importance weight and the guards are here.
The PyTorch spec is `losses/` (token_formulas, surrogates, policy_loss.per_token_loss, kl.kl_estimate). Each function returns the value and ∂/∂ℓ that
torch's autograd of that code gives: clamp passes the gradient on its closed interval,
max / min pass it to the larger / smaller branch, the unclipped one on a tie (torch splits a
tie's gradient in half; the two branches' gradients agree there except at the dual clip's
bound, a single value of w). NaN as torch: min, max and clamp of a NaN are NaN (max then passes
the gradient to both branches); a gradient a clamp or a select stops is 0, even where the factor it
would have multiplied (w, A) is NaN; where torch multiplies by a 0/1 mask, so do we. "No bound" is
+inf (token_loss_params.py), so each formula is branch-free; only the objective and which KL terms
exist are compile-time choices. The scalars come packed, one tuple ``params`` read at the table's offsets.
"""

import triton
import triton.language as tl

from .. import token_loss_params as P
from .token_loss_surrogates import surrogate  # each objective's, generated from its formula in the table
from .token_math import clamp

# The table's constants, named as in it (token_loss_params.triton_constants): the objectives' ids (CLIP, GPPO, ...),
# the KL estimators' (KL_NONE, KL_K1, ...) and the offsets into ``params`` of the real parameters (CLIP_LOW,
# DUAL_CLIP, ...). Globals read inside @triton.jit must be constexpr.
globals().update({name: tl.constexpr(value) for name, value in P.triton_constants().items()})
LOW_VAR_KL_BOUND = tl.constexpr(P.LOW_VAR_KL_BOUND)


@triton.jit
def clamp_with_pass(x, lo, hi):
    """(clamp(x, lo, hi), whether torch's clamp passes the gradient: lo ≤ x ≤ hi)."""
    return clamp(x, lo, hi), (x >= lo) & (x <= hi)


@triton.jit
def through_w(g, w, r_passes):
    """∂/∂ℓ of a gradient g with respect to w = e^r: torch's exp multiplies it by w, then the clamp of r
    passes it or gives 0 (0 also where g·w is NaN)."""
    return tl.where(r_passes, g * w, 0.0)


@triton.jit
def k3(x):
    """e^x − 1 − x (≥ 0) to a few fp32 ulps, relative, for every x."""
    # Triton has no expm1. e^x − 1 − x formed from e^x loses about log2(2/x²) bits to
    # cancellation as x → 0 (all 24 below |x| ≈ 3e-4, where k3 ≈ x²/2 is still meaningful),
    # and even an exact expm1(x) − x loses log2(2/|x|). For |x| < 1 the Taylor series of k3
    # itself, to x^10/10! (the rest is below 2/11! ≈ 5e-8 of the value), has no cancellation;
    # from |x| = 1 on, e^x − 1 − x loses at most ~2 bits.
    small = tl.abs(x) < 1.0
    y = tl.where(small, x, 0.0)  # the unused series stays finite for large x
    p = 2.7557319223985893e-07  # 1/10!
    p = p * y + 2.7557319223985888e-06  # 1/9!
    p = p * y + 2.4801587301587302e-05  # 1/8!
    p = p * y + 1.9841269841269841e-04  # 1/7!
    p = p * y + 1.3888888888888889e-03  # 1/6!
    p = p * y + 8.3333333333333332e-03  # 1/5!
    p = p * y + 4.1666666666666664e-02  # 1/4!
    p = p * y + 1.6666666666666666e-01  # 1/3!
    p = p * y + 0.5
    return tl.where(small, y * y * p, tl.exp(x) - 1.0 - x)


@triton.jit
def kl_term(logp, ref_logp, w, r_passes, log_ratio_clamp, kl_clamp, KL: tl.constexpr,
            BIAS_CORRECTION: tl.constexpr):
    """(k, ∂k/∂ℓ) with Δ = clamp(ℓ_ref − ℓ, ±c): the KL term of the loss, or for KL_NONE the
    k3 statistic (∂ = 0). With the bias correction k·w, differentiated through w too (`through_w`).
    verl's abs and low_var_kl+ differentiate the unclamped e = ℓ_ref − ℓ."""
    e = ref_logp - logp
    delta, passes = clamp_with_pass(e, -log_ratio_clamp, log_ratio_clamp)
    if KL == KL_NONE:
        k = k3(delta)
        dk = 0.0
    else:
        # ∂Δ/∂ℓ = −1 where the clamp passes: k1 = −Δ → 1, k2 = Δ²/2 → −Δ, k3 → −(e^Δ − 1).
        if KL == KL_K1:
            k = -delta
            dk = 1.0
        elif KL == KL_K2:
            k = 0.5 * delta * delta
            dk = -delta
        elif KL == KL_ABS:  # |e|; ∂/∂ℓ = −sign(e), 0 at 0 and NaN (as torch)
            k = tl.abs(e)
            dk = tl.where(e > 0, -1.0, tl.where(e < 0, 1.0, 0.0))
        elif KL == KL_LOW_VAR_KL_PLUS:  # the value clamp(k3(Δ), ±10), the gradient of ½(ℓ − ℓ_ref)²: −e
            k = clamp(k3(delta), -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
            dk = -e
        else:
            k = k3(delta)
            dk = -(delta + k)  # −expm1(Δ), as accurate as k3
        # In torch's order: the clamp of k passes its gradient (·w with the bias correction) or 0, times dk,
        # then the clamp of Δ passes that or 0 (abs and low_var_kl+ differentiate e, not clamped).
        k, k_passes = clamp_with_pass(k, -kl_clamp, kl_clamp)
        if BIAS_CORRECTION:
            dk = tl.where(k_passes, w, 0.0) * dk
        else:
            dk = tl.where(k_passes, 1.0, 0.0) * dk
        if (KL != KL_ABS) and (KL != KL_LOW_VAR_KL_PLUS):
            dk = tl.where(passes, dk, 0.0)
        if BIAS_CORRECTION:
            dk += through_w(k, w, r_passes)
            k = k * w
    return k, dk


@triton.jit
def token_loss(
    logp, old_logp, ref_logp, adv, entropy, chosen, is_weight, params,
    OBJECTIVE: tl.constexpr, KL: tl.constexpr, HAS_REF: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
):
    """(s, ∂s/∂ℓ, clip_low, clip_high, ratio, approx_kl, kl) of one token, where
    s = surrogate + β·k − c_H·H; ∂s/∂H = −c_H. Masked tokens must come in as zeros (as
    `LossInputs.masked` makes them in the spec). ``KL`` is KL_NONE when β = 0; ``ref_logp`` is read only if
    HAS_REF. ``chosen``: Clip-Cov's and KL-Cov's choice (`covariance_choice`), read by those only;
    ``is_weight``: ω ≥ 0, the surrogate's importance weight (1: none)."""
    log_ratio_clamp = params[LOG_RATIO_CLAMP]
    d = logp - old_logp
    r, r_passes = clamp_with_pass(d, -log_ratio_clamp, log_ratio_clamp)
    w = tl.exp(r)
    # Clip-Cov and KL-Cov read the call's choice `chosen`
    s, ds, clip_low, clip_high = surrogate(logp, old_logp, adv, w, d, chosen, r_passes, params, OBJECTIVE)
    # ω times the surrogate (not the KL and entropy terms); a token it weighs 0 is not counted as clipped.
    s = s * is_weight
    ds = ds * is_weight
    clip_low = tl.where(is_weight > 0, clip_low, 0.0)
    clip_high = tl.where(is_weight > 0, clip_high, 0.0)
    kl = 0.0
    if HAS_REF:
        kl, dkl = kl_term(logp, ref_logp, w, r_passes, log_ratio_clamp, params[KL_CLAMP], KL, BIAS_CORRECTION)
        if KL != KL_NONE:
            s += params[KL_COEF] * kl
            ds += params[KL_COEF] * dkl
    # Without a bonus H is not read (0·NaN would be NaN), as in losses/ and token_loss.h.
    entropy_coef = params[ENTROPY_COEF]
    s -= entropy_coef * tl.where(entropy_coef != 0.0, entropy, 0.0)
    # A NaN ℓ (on a GPU, a target outside [0, V): not checked there) keeps its gradient NaN;
    # a clipped branch would give 0 and hide it.
    ds = tl.where(logp != logp, logp, ds)
    # clamp(ℓ_old − ℓ, ±c) is exactly −r.
    return s, ds, clip_low, clip_high, w, k3(-r), kl
