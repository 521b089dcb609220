// Per-row math of token log-probs and entropy (docs/design.md §2), written once for every
// compiled backend: CPU (T = float, double, or at::vec::Vectorized<float/double> for the
// per-lane accumulators) and, later, the CUDA kernels (T = float). No torch includes.
//
// A row is summarised by the online-softmax state (m, s, u), all relative to a running max m:
//     s = Σ_v e^{x_v − m},        u = Σ_v e^{x_v − m} (x_v − m)
// We keep Σ e^{x−m}(x−m) rather than Σ e^{x−m}·x: then H = log s − u/s has no cancellation
// between two large numbers (lse and Σ p x), and shifting every logit by c changes nothing.
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RLK_HOST_DEVICE __host__ __device__
#else
#define RLK_HOST_DEVICE
#endif

namespace rlk {

// a·b rounded on its own. nvcc contracts a product and the add or subtract that follows into one
// FMA by default, and where two values must cancel exactly (x − m at the row max; the target term
// against A at p = 1) that leaves the product's rounding error instead of 0. The CPU build is
// compiled with -ffp-contract=off, so there a plain product is already rounded.
template <typename T>
RLK_HOST_DEVICE inline T mul_rn(const T& a, const T& b) {
  return a * b;
}
RLK_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

RLK_HOST_DEVICE inline float exp_(float x) { return ::expf(x); }
RLK_HOST_DEVICE inline double exp_(double x) { return ::exp(x); }
RLK_HOST_DEVICE inline float log_(float x) { return ::logf(x); }
RLK_HOST_DEVICE inline double log_(double x) { return ::log(x); }

// HUGE_VAL(F) rather than std::numeric_limits, which is host-only under nvcc.
template <typename T> RLK_HOST_DEVICE inline T neg_inf();
template <> RLK_HOST_DEVICE inline float neg_inf<float>() { return -HUGE_VALF; }
template <> RLK_HOST_DEVICE inline double neg_inf<double>() { return -HUGE_VAL; }

// exp(x) is exactly 0 for every x below this (fp32 underflows below −103.97, fp64 below
// −745.1). Differences x − m are clamped to it, so a −inf logit (a masked vocabulary entry)
// gives e = 0 and e·(x − m) = 0 instead of 0·(−inf) = NaN, and no value changes. Small enough in
// magnitude that h·log p stays finite in the gradient for any sane h.
template <typename T> RLK_HOST_DEVICE inline T exp_floor();
template <> RLK_HOST_DEVICE inline float exp_floor<float>() { return -128.0f; }
template <> RLK_HOST_DEVICE inline double exp_floor<double>() { return -1024.0; }

template <typename T>
struct SoftmaxState {
  T m;  // running max (−inf while every element seen so far is −inf)
  T s;  // Σ e^{x − m}
  T u;  // Σ e^{x − m} (x − m)
};

template <typename T>
RLK_HOST_DEVICE inline SoftmaxState<T> softmax_init() {
  return SoftmaxState<T>{neg_inf<T>(), T(0), T(0)};
}

// Accumulate one element: d = max(x − m, exp_floor) with m ≥ x, e = exp(d). Only +, * so that
// T may also be a SIMD vector type (the CPU backend calls it per lane).
template <typename T, bool kEntropy = true>
RLK_HOST_DEVICE inline void softmax_accumulate(T& s, T& u, const T& e, const T& d) {
  s = s + e;
  if (kEntropy) u = u + e * d;
}

// Moving the reference point of (s, u) from m_old to m_new ≥ m_old:
//     s' = α s,   u' = α (u + δ s),   α = e^{δ},  δ = m_old − m_new.
// `rescale_factors` gives (α, δ); when m_old = −inf the sums are empty and α = δ = 0. δ is
// clamped to exp_floor, as the elements' x − m are: α is then exactly 0 all the same, and δ·s
// stays finite (for logits near ±3e38, δ·s would overflow and 0·inf make u NaN).
template <typename T>
RLK_HOST_DEVICE inline void rescale_factors(T m_old, T m_new, T& alpha, T& delta) {
  if (m_old == neg_inf<T>()) {
    alpha = T(0);
    delta = T(0);
  } else {
    delta = m_old - m_new;
    delta = delta < exp_floor<T>() ? exp_floor<T>() : delta;
    alpha = exp_(delta);
  }
}

template <typename T, typename S, bool kEntropy = true>
RLK_HOST_DEVICE inline void softmax_rescale(T& s, T& u, const S& alpha, const S& delta) {
  if (kEntropy) u = alpha * (u + delta * s);
  s = alpha * s;
}

// Merge two states (different rows' chunks, lanes, threads or warps).
template <typename T>
RLK_HOST_DEVICE inline SoftmaxState<T> softmax_merge(const SoftmaxState<T>& a, const SoftmaxState<T>& b) {
  const T m = a.m > b.m ? a.m : b.m;
  T alpha_a, delta_a, alpha_b, delta_b;
  rescale_factors(a.m, m, alpha_a, delta_a);
  rescale_factors(b.m, m, alpha_b, delta_b);
  SoftmaxState<T> out{m, a.s, a.u};
  softmax_rescale(out.s, out.u, alpha_a, delta_a);
  T sb = b.s, ub = b.u;
  softmax_rescale(sb, ub, alpha_b, delta_b);
  out.s += sb;
  out.u += ub;
  return out;
}

// log p = (x − m) − log s, never x − lse: lse = m + log s rounds to ulp(m), which for large
// logits (|m| ≳ 1e3) costs more than every other rounding together, and at |m| ~ 1e38 all of
// log s. The row is therefore summarised by the pair (m, log s), never by lse.
template <typename T>
RLK_HOST_DEVICE inline T log_prob(const T& x, const T& m, const T& log_s) {
  return (x - m) - log_s;
}

// Finalisation: log s, logp = (x_y − m) − log s, H = log s − u/s (= lse − Σ p x). A row of
// −inf logits (m = −inf, s = 0) gives NaN logp and H, as log_softmax would.
template <typename T>
struct RowResult {
  T m;
  T log_s;
  T logp;
  T entropy;
};

template <typename T>
RLK_HOST_DEVICE inline RowResult<T> softmax_finalize(const SoftmaxState<T>& st, T x_target) {
  RowResult<T> r;
  r.m = st.m;
  r.log_s = log_(st.s);
  r.logp = log_prob(x_target, st.m, r.log_s);
  r.entropy = r.log_s - st.u / st.s;
  return r;
}

// Gradient w.r.t. the logits z (x = z/τ), with g = ∂L/∂logp, h = ∂L/∂H, p = softmax(x):
//     ∂L/∂z_v = (1/τ) [ g (1[v=y] − p_v) − h p_v (log p_v + H) ]
//             = (1/τ) g 1[v=y] + p_v (A + B log p_v),   A = −(g + h H)/τ,  B = −h/τ.
// log p_v = log_prob(x_v, m, log s) is clamped to exp_floor (p_v is then exactly 0 and so is its term).
template <typename T>
struct GradCoeffs {
  T A;
  T B;
  T target;  // (1/τ) g, added at v = y
};

template <typename T>
RLK_HOST_DEVICE inline GradCoeffs<T> grad_coeffs(T g, T h, T entropy, T inv_tau) {
  GradCoeffs<T> c;
  // Rounded alone: at p = 1 (one finite logit) target + A must be exactly 0.
  c.A = -mul_rn(g + h * entropy, inv_tau);
  c.B = -h * inv_tau;
  c.target = mul_rn(g, inv_tau);
  return c;
}

// Non-target element, given p = exp(logp) and the clamped logp (T may be a SIMD vector).
template <typename T>
RLK_HOST_DEVICE inline T grad_element(const T& p, const T& logp, const T& A, const T& B) {
  return p * (A + B * logp);
}

// Any element, scalar: the direct formula above.
template <typename T>
RLK_HOST_DEVICE inline T grad_logit(T x, T m, T log_s, bool is_target, const GradCoeffs<T>& c) {
  T logp = log_prob(x, m, log_s);
  logp = logp < exp_floor<T>() ? exp_floor<T>() : logp;  // NaN stays NaN
  const T p = exp_(logp);
  const T g = grad_element(p, logp, c.A, c.B);
  return is_target ? c.target + g : g;
}

}  // namespace rlk
