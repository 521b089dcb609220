// The token-level policy loss of one token (docs/math.md; the contracts are `policy_token_fwd` and
// `policy_token_loss` in rlkernels/kernels/__init__.py): its value, its derivatives with respect to the token's log-prob
// ℓ and entropy H, and the 7 statistics. Written once for the CPU (T = float, double) and CUDA
// (T = float) kernels, which call it on the row's results of the forward pass. No torch includes.
//
// The derivatives are those torch's autograd gives for rlkernels/losses/ (the specification):
//   * clamp(x, lo, hi) passes the gradient on the closed interval lo ≤ x ≤ hi;
//   * max / min pass it to the larger / smaller branch. On an exact tie torch gives each branch
//     half; in max(u, k) of the clipped surrogate both branches then have the same derivative,
//     so taking all of it from u is the same. Only the dual clip's min(s, −dual_clip·A) can tie
//     with a branch of another slope (torch: half of ∂s/∂ℓ); there we keep s, the unclipped
//     branch, as the kink's one-sided derivative.
//   * NaN as torch: min, max and clamp of a NaN are NaN (and max passes the gradient to both
//     branches); a gradient that a clamp or a select stops is 0, even where the factor it would
//     have multiplied (w, A) is NaN or inf; where torch multiplies by a 0/1 mask, so do we.
// "No bound" is +inf (1 − inf = −inf, min(w, inf) = w), so the formula has no special cases.
#pragma once

#include <cmath>
#include <cstdint>

#include "rlkernels/row_math.h"
#include "rlkernels/token_loss_table.h"  // the ids, the statistics' columns, TokenLossParams<T>

namespace rlk {

// One token's inputs. `old_logp` is read only when has_old (else on-policy: ℓ_old = ℓ, without
// gradient), `ref_logp` only when has_ref.
template <typename T>
struct TokenIn {
  T logp;
  T entropy;
  bool mask;
  T weight;  // w_agg
  T adv;     // A
  bool has_old;
  T old_logp;
  bool has_ref;
  T ref_logp;
  T chosen = T(0);     // Clip-Cov / KL-Cov: nonzero on a token of the call's choice (KL-Cov: its penalty's coefficient)
  T is_weight = T(1);  // ω ≥ 0: the surrogate's importance weight
};

template <typename T>
struct TokenOut {
  T grad_logp;     // w_agg·∂s/∂ℓ
  T grad_entropy;  // w_agg·∂s/∂H
  T stats[kNumStats];

  // Token n's outputs into per-token arrays: grad_logp[n], grad_entropy[n], stats[n·kNumStats + j].
  RLK_HOST_DEVICE void store(int64_t n, T* grad_logp_out, T* grad_entropy_out, T* stats_out) const {
    grad_logp_out[n] = grad_logp;
    grad_entropy_out[n] = grad_entropy;
#pragma unroll
    for (int j = 0; j < kNumStats; ++j) stats_out[n * kNumStats + j] = stats[j];
  }
};

// The per-token inputs of the loss besides ℓ and H, as arrays of n elements (device memory for
// CUDA). Null means absent: old_logp on-policy (ℓ_old = ℓ), ref_logp no reference, adv A = 0.
template <typename T>
struct TokenArrays {
  const bool* mask;
  const T* weight;
  const T* adv;
  const T* old_logp;
  const T* ref_logp;
  const T* chosen = nullptr;  // only Clip-Cov and KL-Cov read it (null: no token chosen)
  const T* is_weights = nullptr;  // ω (null: 1)

  // Token n's inputs with its log-prob and entropy.
  RLK_HOST_DEVICE TokenIn<T> at(int64_t n, T logp, T entropy) const {
    return TokenIn<T>{logp, entropy, mask[n], weight[n], adv != nullptr ? adv[n] : T(0),
                      old_logp != nullptr, old_logp != nullptr ? old_logp[n] : T(0),
                      ref_logp != nullptr, ref_logp != nullptr ? ref_logp[n] : T(0),
                      chosen != nullptr ? chosen[n] : T(0), is_weights != nullptr ? is_weights[n] : T(1)};
  }
};

RLK_HOST_DEVICE inline float expm1_(float x) { return ::expm1f(x); }
RLK_HOST_DEVICE inline double expm1_(double x) { return ::expm1(x); }

// k3(x) = e^x − 1 − x (≥ 0) to a few ulps, relative, for every x. Even an exact expm1(x) − x loses
// log2(2/|x|) bits to cancellation as x → 0 (17 of fp32's 24 at |x| = 1e-5), so below |x| = 1 it is the
// Taylor series of k3 itself, to x^17/17!: the rest is below 2/18! ≈ 3e-16 of the value, fp64's rounding.
template <typename T>
RLK_HOST_DEVICE inline T k3_(T x) {
  if (!(x < T(1) && x > T(-1))) return expm1_(x) - x;  // NaN too
  T q = T(2.8114572543455206e-15);  // 1/17!, then Horner down to 1/2!
  q = q * x + T(4.7794773323873853e-14);
  q = q * x + T(7.6471637318198164e-13);
  q = q * x + T(1.1470745597729725e-11);
  q = q * x + T(1.6059043836821613e-10);
  q = q * x + T(2.0876756987868100e-09);
  q = q * x + T(2.5052108385441720e-08);
  q = q * x + T(2.7557319223985890e-07);
  q = q * x + T(2.7557319223985893e-06);
  q = q * x + T(2.4801587301587302e-05);
  q = q * x + T(1.9841269841269841e-04);
  q = q * x + T(1.3888888888888889e-03);
  q = q * x + T(8.3333333333333332e-03);
  q = q * x + T(4.1666666666666664e-02);
  q = q * x + T(1.6666666666666666e-01);
  q = q * x + T(0.5);
  return x * x * q;
}

// torch.clamp's value: NaN stays NaN.
template <typename T>
RLK_HOST_DEVICE inline T clamp_(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// torch.minimum and torch.maximum: NaN if either is.
template <typename T>
RLK_HOST_DEVICE inline T min_(T a, T b) {
  return a <= b || a != a ? a : b;
}
template <typename T>
RLK_HOST_DEVICE inline T max_(T a, T b) {
  return a >= b || a != a ? a : b;
}

// Where torch.clamp passes the gradient: the closed interval (false for NaN).
template <typename T>
RLK_HOST_DEVICE inline bool passes_(T x, T lo, T hi) {
  return x >= lo && x <= hi;
}

// |x|, NaN for NaN.
template <typename T>
RLK_HOST_DEVICE inline T abs_(T x) {
  return x < T(0) ? -x : x;
}

// torch.sigmoid, 1/(1 + e^−x): 0 for x → −inf, 1 for x → inf.
template <typename T>
RLK_HOST_DEVICE inline T sigmoid_(T x) {
  return T(1) / (T(1) + exp_(-x));
}

}  // namespace rlk

// Each objective's surrogate, generated from its formula in the table (after the functions above, which it calls).
#include "rlkernels/token_loss_surrogates.h"

namespace rlk {

template <typename T>
RLK_HOST_DEVICE inline TokenOut<T> token_loss(const TokenIn<T>& in, const TokenLossParams<T>& p) {
  TokenOut<T> out;
  out.grad_logp = T(0);
  out.grad_entropy = T(0);
  for (int j = 0; j < kNumStats; ++j) out.stats[j] = T(0);
  if (!in.mask) return out;  // nothing of a masked token is read: padding may hold NaN
  const T c = p.log_ratio_clamp;
  const T adv = in.adv;

  // Importance weight w = e^r, r = clamp(ℓ − ℓ_old, −c, c). A gradient g with respect to w reaches ℓ
  // as through_w(g): torch's exp multiplies it by w, then the clamp passes it or gives 0.
  const T logp_old = in.has_old ? in.old_logp : in.logp;
  const T d = in.logp - logp_old;  // unclamped
  const T r = clamp_(d, -c, c);
  const T w = exp_(r);
  const bool r_passes = passes_(d, -c, c);
  const auto through_w = [&](T g) { return r_passes ? g * w : T(0); };

  // The surrogate s and ds = ∂s/∂ℓ (Clip-Cov and KL-Cov read the call's choice `chosen`).
  const Surrogate<T> sur = surrogate(in.logp, logp_old, adv, w, d, in.chosen, r_passes, p);
  T s = sur.s, ds = sur.ds;
  bool clip_low = sur.clip_low, clip_high = sur.clip_high;
  // ω times the surrogate (not the KL and entropy terms); a token it weighs 0 is not counted as clipped.
  s = s * in.is_weight;
  ds = ds * in.is_weight;
  clip_low = clip_low && in.is_weight > T(0);
  clip_high = clip_high && in.is_weight > T(0);

  // KL to the reference: Δ = clamp(ℓ_ref − ℓ, −c, c); kl is the statistic.
  T kl = T(0);
  if (in.has_ref) {
    const T e = in.ref_logp - in.logp;
    const T delta = clamp_(e, -c, c);
    if (p.kl_estimator == kKlNone || !(p.kl_coef > T(0))) {
      kl = k3_(delta);  // no KL in the loss: the statistic is k3
    } else {
      T k, dk;  // the estimate and ∂k/∂Δ
      bool d_passes = passes_(e, -c, c);  // whether ∂Δ/∂ℓ = −1 (verl's abs and "+" forms: Δ unclamped)
      if (p.kl_estimator == kKlK1) {
        k = -delta;
        dk = T(-1);
      } else if (p.kl_estimator == kKlK2) {
        k = T(0.5) * delta * delta;
        dk = delta;
      } else if (p.kl_estimator == kKlAbs) {  // ∂|e|/∂e = sign(e), 0 at 0 and NaN (as torch)
        k = e < T(0) ? -e : e;
        dk = T((e > T(0)) - (e < T(0)));
        d_passes = true;
      } else if (p.kl_estimator == kKlLowVarKlPlus) {  // straight-through: ∂(½e²)/∂e = e
        k = clamp_(k3_(delta), T(-kLowVarKlBound), T(kLowVarKlBound));
        dk = e;
        d_passes = true;
      } else {
        k = k3_(delta);
        dk = expm1_(delta);  // ∂k3/∂Δ = e^Δ − 1, without cancellation
      }
      // In torch's order: the clamp of k passes its gradient (·w with the bias correction) or 0, then times dk.
      const bool k_passes = passes_(k, -p.kl_clamp, p.kl_clamp);
      k = clamp_(k, -p.kl_clamp, p.kl_clamp);
      T dk_ratio = T(0);  // ∂(k·w)/∂ℓ through w
      if (p.kl_bias_correction) {  // times w, with its gradient
        dk_ratio = through_w(k);
        dk = (k_passes ? w : T(0)) * dk;
        k = k * w;
      } else {
        dk = (k_passes ? T(1) : T(0)) * dk;
      }
      kl = k;
      s = s + p.kl_coef * k;
      if (d_passes) ds = ds - p.kl_coef * dk;  // ∂Δ/∂ℓ = −1
      ds = ds + p.kl_coef * dk_ratio;
    }
  }

  if (p.entropy_coef != T(0)) {
    s = s - p.entropy_coef * in.entropy;
    out.grad_entropy = -in.weight * p.entropy_coef;
  }
  // A NaN ℓ (on a GPU, a target outside [0, V): not checked there) keeps its gradient NaN;
  // a clipped branch would give 0 and hide it.
  if (in.logp != in.logp) ds = in.logp;
  out.grad_logp = in.weight * ds;
  out.stats[kStatLoss] = in.weight * s;
  out.stats[kStatClipLow] = clip_low ? T(1) : T(0);
  out.stats[kStatClipHigh] = clip_high ? T(1) : T(0);
  out.stats[kStatRatio] = w;
  out.stats[kStatApproxKl] = k3_(-r);  // k3(clamp(ℓ_old − ℓ, −c, c)), and that clamp is −r
  out.stats[kStatKl] = kl;
  out.stats[kStatEntropy] = in.entropy;
  return out;
}

}  // namespace rlk
