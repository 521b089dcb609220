"""The token-level policy loss of one token (kernels/__init__.py, ``policy_token_fwd``), in fp32.

The only Triton formula of the loss; the PyTorch spec is `losses/` (surrogates.token,
policy_loss.per_token_loss, kl.kl_estimate). Each function returns the value and ∂/∂ℓ that
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

# The table's constants, named as in it (token_loss_params.triton_constants): the objectives' ids (CLIP, GPPO, ...),
# the KL estimators' (KL_NONE, KL_K1, ...) and the offsets into ``params`` of the real parameters (CLIP_LOW,
# DUAL_CLIP, ...). Globals read inside @triton.jit must be constexpr.
globals().update({name: tl.constexpr(value) for name, value in P.triton_constants().items()})
LOW_VAR_KL_BOUND = tl.constexpr(P.LOW_VAR_KL_BOUND)


@triton.jit
def clamp(x, lo, hi):
    """torch.clamp: NaN stays NaN, so a NaN ℓ (a target outside [0, V)) shows in the loss."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                      propagate_nan=tl.PropagateNan.ALL)


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
def clip_family(w, r_passes, adv, params, PRESERVE: tl.constexpr):
    """(s, ∂s/∂ℓ, clip_low, clip_high) of the clip family (docs/math.md §5): PPO's clipped surrogate
    s = max(−A·min(w, δ), −A·clamp(w, 1 − ε_low, 1 + ε_high)), then for A < 0 the dual clip min(s, −c·A). CLIP,
    Clip-Cov and KL-Cov are it as it stands (KL-Cov with every bound inf). GPPO (PRESERVE, no δ): a token the clip holds
    (w below the band with A < 0, above it with A > 0) has the value −β·bound·A and the gradient of
    −β·bound·A·w/sg(w), −β·bound·A too, where PPO's has none (β₁ below, β₂ above)."""
    ratio_low = 1.0 - params[CLIP_LOW]
    ratio_high = 1.0 + params[CLIP_HIGH]
    if PRESERVE:  # GPPO's unclipped branch is −A·w
        unclipped = -adv * w
        d_unclipped = -adv  # ∂/∂w
    else:
        delta = params[DELTA]
        unclipped = -adv * tl.minimum(w, delta, propagate_nan=tl.PropagateNan.ALL)
        d_unclipped = tl.where(w <= delta, -adv, 0.0)
    w_clipped, passes = clamp_with_pass(w, ratio_low, ratio_high)
    clipped = -adv * w_clipped
    d_clipped = tl.where(passes, -adv, 0.0)
    s = tl.maximum(unclipped, clipped, propagate_nan=tl.PropagateNan.ALL)
    nan = (unclipped != unclipped) | (clipped != clipped)  # torch's max passes the gradient to both
    ds = through_w(tl.where(clipped > unclipped, d_clipped, tl.where(nan, d_unclipped + d_clipped, d_unclipped)),
                   w, r_passes)
    held_low = (w < ratio_low) & (adv < 0)
    held_high = (w > ratio_high) & (adv > 0)
    if PRESERVE:
        kept = -adv * tl.where(held_low, params[GPPO_BETA_LOW] * ratio_low, params[GPPO_BETA_HIGH] * ratio_high)
        s = tl.where(held_low | held_high, kept, s)
        ds = tl.where(held_low | held_high, tl.where(r_passes, kept, 0.0), ds)
    # Dual clip: for A < 0, s = min(s, −c·A), a constant. The A ≥ 0 lanes get a finite stand-in, as inf·0 would be
    # NaN in the unused lane.
    bound = -params[DUAL_CLIP] * tl.where(adv < 0, adv, -1.0)
    dual = (adv < 0) & (s > bound)
    s = tl.where(dual, bound, s)
    ds = tl.where(dual, 0.0, ds)
    return s, ds, tl.where(held_low, 1.0, 0.0), tl.where(held_high, 1.0, 0.0)


@triton.jit
def surrogate(logp, old_logp, adv, w, r_passes, d, params, OBJECTIVE: tl.constexpr):
    """(s, ∂s/∂ℓ, clip_low, clip_high) of the objective, given w, whether the clamp of its log passes the
    gradient and d = ℓ − ℓ_old; flags as 0/1."""
    clip_low = params[CLIP_LOW]
    clip_high = params[CLIP_HIGH]
    ratio_low = 1.0 - clip_low
    ratio_high = 1.0 + clip_high
    if (OBJECTIVE == CLIP) or (OBJECTIVE == CLIP_COV) or (OBJECTIVE == KL_COV) or (OBJECTIVE == GPPO):
        s, ds, clip_low, clip_high = clip_family(w, r_passes, adv, params, OBJECTIVE == GPPO)
    elif OBJECTIVE == CISPO:
        # s = −sg(clamp(w))·A·ℓ: the clamped weight scales a REINFORCE gradient.
        scale = -clamp(w, ratio_low, ratio_high) * adv
        s = scale * logp
        ds = scale
        clip_low = tl.where(w < ratio_low, 1.0, 0.0)
        clip_high = tl.where(w > ratio_high, 1.0, 0.0)
    elif OBJECTIVE == SAPO:
        # s = −A·σ(τ(w − 1))·4/τ, τ by the sign of A: a soft gate, differentiable everywhere.
        tau = tl.where(adv > 0, params[SAPO_TAU_POS], params[SAPO_TAU_NEG])
        sig = 1.0 / (1.0 + tl.exp(-tau * (w - 1.0)))
        s = -adv * sig * (4.0 / tau)
        ds = through_w(-adv * 4.0 * sig * (1.0 - sig), w, r_passes)
        clip_low = 0.0
        clip_high = 0.0
    elif (OBJECTIVE == DPPO_TV) or (OBJECTIVE == DPPO_KL):
        # s = −A·sg(min(w, cap))·ℓ inside the trust region of a divergence between the Bernoulli
        # distributions (p_old, 1 − p_old) and (p, 1 − p), p = e^ℓ; no gradient outside.
        prob = tl.exp(logp)
        prob_old = tl.exp(old_logp)
        if OBJECTIVE == DPPO_TV:
            inside_pos = prob - prob_old <= clip_high
            inside_neg = prob - prob_old >= -clip_low
        else:
            kl = prob_old * (old_logp - logp) + (1.0 - prob_old) * tl.log(
                (1.0 - prob_old + 1e-8) / (1.0 - prob + 1e-8))
            inside_pos = (kl <= clip_high) | (prob <= prob_old)
            inside_neg = (kl <= clip_low) | (prob >= prob_old)
        inside = tl.where(adv > 0, inside_pos, inside_neg)
        ds = -adv * clamp(w, 0.0, params[RATIO_CAP]) * tl.where(inside, 1.0, 0.0)  # the spec's 0/1 mask: NaN stays NaN
        s = ds * logp
        clip_low = tl.where(~inside & (adv < 0), 1.0, 0.0)
        clip_high = tl.where(~inside & (adv > 0), 1.0, 0.0)
    elif OBJECTIVE == TOPR:
        # s = −A·ℓ where A ≥ 0 (no ratio), −sg(clamp(w, 0, 1))·A·ℓ where A < 0 (the ratio truncated at 1).
        scale = -tl.where(adv < 0, clamp(w, 0.0, 1.0), 1.0) * adv
        s = scale * logp
        ds = scale
        clip_low = 0.0
        clip_high = tl.where((w > 1.0) & (adv < 0), 1.0, 0.0)
    elif OBJECTIVE == DRO:
        # s = −(A·ℓ − ½β(ℓ − ℓ_old)²): the log-ratio d is not exponentiated, so not clamped.
        dro_beta = params[DRO_BETA]
        s = -(adv * logp - 0.5 * dro_beta * d * d)
        ds = -adv + dro_beta * d
        clip_low = 0.0
        clip_high = 0.0
    else:  # REINFORCE
        s = -adv * logp
        ds = -adv
        clip_low = 0.0
        clip_high = 0.0
    return s, ds, clip_low, clip_high


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
    s, ds, clip_low, clip_high = surrogate(logp, old_logp, adv, w, r_passes, d, params, OBJECTIVE)
    if OBJECTIVE == CLIP_COV:  # a chosen token: loss 0, no gradient (whatever w and A), clipped on A's side
        s = tl.where(chosen != 0.0, 0.0, s)
        ds = tl.where(chosen != 0.0, 0.0, ds)
        clip_low = tl.where((chosen != 0.0) & (adv < 0), 1.0, clip_low)
        clip_high = tl.where((chosen != 0.0) & (adv > 0), 1.0, clip_high)
    if OBJECTIVE == KL_COV:  # + chosen·|d|, d unclamped; ∂|d|/∂ℓ = sign(d) (0 at 0, as torch)
        s += tl.where(chosen != 0.0, chosen * tl.abs(d), 0.0)
        ds += tl.where(chosen != 0.0, chosen * tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0)), 0.0)
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
