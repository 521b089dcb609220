// Clip-Cov's and KL-Cov's choice of tokens (docs/math.md §5), per token: the covariance of A and ℓ,
// whether the token may be chosen and the key that orders the candidates. Written once for the CPU
// (T = float, double) and CUDA (T = float) kernels of `covariance_choice` (the contract is in
// rlkernels/kernels/__init__.py), which differ only in how they find the k smallest keys. No torch includes.
#pragma once

#include <cstdint>
#include <cstring>

#include "rlkernels/row_math.h"
#include "rlkernels/token_loss.h"

namespace rlk {

template <typename T>
struct CovarianceChoiceParams {
  int objective;      // a CovarianceChoice
  double fraction;    // k = max(⌊fraction·N⌋, 1) tokens are chosen, N the masked ones
  T cov_lb, cov_ub;   // Clip-Cov: a candidate's covariance lies in (cov_lb, cov_ub)
  T clip_low, clip_high, log_ratio_clamp;  // Clip-Cov: a token PPO's clip clips is no candidate
  T scale;            // a chosen token's output
};

template <typename T> struct OrderedBits;
template <> struct OrderedBits<float> { using type = uint32_t; };
template <> struct OrderedBits<double> { using type = uint64_t; };

// The unsigned key of x that sorts as torch.sort sorts floats: −0 = +0, NaN above +inf.
template <typename T>
RLK_HOST_DEVICE inline typename OrderedBits<T>::type ordered_key(T x) {
  using U = typename OrderedBits<T>::type;
  x = x != x ? T(NAN) : (x == T(0) ? T(0) : x);  // one NaN, one zero
  U u;
  memcpy(&u, &x, sizeof u);
  const U sign = U(1) << (8 * sizeof(U) - 1);
  return (u & sign) ? ~u : (u | sign);  // negatives reversed below the positives
}

// A token in the choice: eligible or not, and its key (the k eligible tokens of smallest key are chosen;
// ties: the first position).
template <typename T>
struct Candidate {
  bool eligible;
  typename OrderedBits<T>::type key;
};

// Masked token with advantage `adv`, log-prob `logp` (and ℓ_old when has_old; else on-policy) and uniform
// draw `draw` (Clip-Cov only), given the means of A and ℓ over the call's masked tokens.
template <typename T>
RLK_HOST_DEVICE inline Candidate<T> candidate(const CovarianceChoiceParams<T>& p, T adv, T logp, bool has_old,
                                              T old_logp, float draw, T mean_adv, T mean_logp) {
  const T cov = (adv - mean_adv) * (logp - mean_logp);
  if (p.objective == kChooseKlCov) return {true, ~ordered_key(cov)};  // the largest covariance first
  const T c = p.log_ratio_clamp;
  const T w = exp_(clamp_(logp - (has_old ? old_logp : logp), -c, c));
  const bool clipped = -adv * clamp_(w, T(1) - p.clip_low, T(1) + p.clip_high) > -adv * w;
  return {!clipped && cov > p.cov_lb && cov < p.cov_ub, ordered_key(T(draw))};
}

// k of a call with `count` masked tokens, as the spec forms it in float64.
RLK_HOST_DEVICE inline int64_t choice_size(int64_t count, double fraction) {
  const double k = floor(double(count) * fraction);
  return k < 1.0 ? 1 : int64_t(k);
}

}  // namespace rlk
