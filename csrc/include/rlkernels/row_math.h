// Per-row math of token log-probs and entropy (docs/design.md §2), written once for every
// compiled backend: CPU (T = float, double, or at::vec::Vectorized<float/double> for the
// per-lane accumulators) and, later, the CUDA kernels (T = float). No torch includes.
//
// A row of logits z at temperature τ is summarised by the online-softmax state (m, s, u), with m
// the running max of the raw logits and d_v = (z_v − m)/τ the scaled distance to it:
//     s = Σ_v e^{d_v},        u = Σ_v e^{d_v} d_v
// We keep Σ e^{d}·d rather than Σ e^{d}·z/τ: then H = log s − u/s has no cancellation between
// two large numbers (lse and Σ p x), and shifting every logit by c changes nothing. The max is
// taken in raw units and τ applied to differences only, never to a logit: z/τ overflows fp32 for
// |z| near 3e38 at τ < 1, (z − m)/τ only where it is below −e^{104}, where e^d is 0 anyway.
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RLK_HOST_DEVICE __host__ __device__
#else
#define RLK_HOST_DEVICE
#endif

namespace rlk {

// a·b rounded on its own. nvcc contracts a product and the add or subtract that follows into one
// FMA by default, and where two values must cancel exactly ((z − m)/τ against log s; the target term
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
RLK_HOST_DEVICE inline float tanh_(float x) { return ::tanhf(x); }
RLK_HOST_DEVICE inline double tanh_(double x) { return ::tanh(x); }


// HUGE_VAL(F) rather than std::numeric_limits, which is host-only under nvcc.
template <typename T> RLK_HOST_DEVICE inline T neg_inf();
template <> RLK_HOST_DEVICE inline float neg_inf<float>() { return -HUGE_VALF; }
template <> RLK_HOST_DEVICE inline double neg_inf<double>() { return -HUGE_VAL; }

// Final-logit soft capping (Gemma 2 and 3): the model's logits are y = c·tanh(z/c) of the head's
// output z, for a cap c > 0 (c = 0: none). The kernels read z and use y wherever the row math
// below says z (its max, the sums, the target), and the backward multiplies ∂L/∂y by
// dy/dz = (1 − t)(1 + t), t = tanh(z/c) (the factored form keeps its relative precision where
// t² rounds to 1). A −inf logit stays −inf (a masked entry stays masked; a linear head never
// gives one), which also keeps the kernels' −inf padding out of the sums. The CPU backend
// vectorises the same formulas with at::vec's tanh.
template <typename T>
struct SoftCap {
  T c;      // 0: no cap
  T inv_c;  // 1/c (0 when c = 0)
  RLK_HOST_DEVICE bool on() const { return c > T(0); }
  RLK_HOST_DEVICE T tanh_of(T z) const { return tanh_(z * inv_c); }
  // t = tanh_of(z); c·t rounded alone, never contracted into the z − m that follows (see mul_rn): the
  // max is of the rounded values, and the max element must give d = 0 exactly.
  RLK_HOST_DEVICE T capped(T z, T t) const { return z == neg_inf<T>() ? z : mul_rn(c, t); }
  RLK_HOST_DEVICE T apply(T z) const { return on() ? capped(z, tanh_of(z)) : z; }
  RLK_HOST_DEVICE static T slope(T t) { return (T(1) - t) * (T(1) + t); }
};

template <typename T>
inline SoftCap<T> soft_cap(double c) {
  return SoftCap<T>{static_cast<T>(c), c > 0 ? static_cast<T>(1.0 / c) : T(0)};
}

// exp(x) is exactly 0 for every x below this (fp32 underflows below −103.97, fp64 below
// −745.1). Scaled differences d are clamped to it, so a −inf logit (a masked vocabulary entry)
// gives e = 0 and e·d = 0 instead of 0·(−inf) = NaN, and no value changes. Small enough in
// magnitude that h·log p stays finite in the gradient for any sane h.
template <typename T> RLK_HOST_DEVICE inline T exp_floor();
template <> RLK_HOST_DEVICE inline float exp_floor<float>() { return -128.0f; }
template <> RLK_HOST_DEVICE inline double exp_floor<double>() { return -1024.0; }

template <typename T>
struct SoftmaxState {
  T m;  // running max (−inf while every element seen so far is −inf)
  T s;  // Σ e^{d},  d = (z − m)/τ
  T u;  // Σ e^{d} d
};

template <typename T>
RLK_HOST_DEVICE inline SoftmaxState<T> softmax_init() {
  return SoftmaxState<T>{neg_inf<T>(), T(0), T(0)};
}

// d = (z − m)/τ of one element, the product rounded on its own (see mul_rn).
template <typename T>
RLK_HOST_DEVICE inline T scaled_diff(const T& z, const T& m, const T& inv_tau) {
  return mul_rn(z - m, inv_tau);
}

// Accumulate one element: d = max((z − m)/τ, exp_floor) with m ≥ z, e = exp(d). Only +, * so that
// T may also be a SIMD vector type (the CPU backend calls it per lane).
template <typename T, bool kEntropy = true>
RLK_HOST_DEVICE inline void softmax_accumulate(T& s, T& u, const T& e, const T& d) {
  s = s + e;
  if (kEntropy) u = u + e * d;
}

// Moving the reference point of (s, u) from m_old to m_new ≥ m_old:
//     s' = α s,   u' = α (u + δ s),   α = e^{δ},  δ = (m_old − m_new)/τ.
// `rescale_factors` gives (α, δ); when m_old = −inf the sums are empty and α = δ = 0. δ is
// clamped to exp_floor, as the elements' d are: α is then exactly 0 all the same, and δ·s
// stays finite (for logits near ±3e38, δ·s would overflow and 0·inf make u NaN).
template <typename T>
RLK_HOST_DEVICE inline void rescale_factors(T m_old, T m_new, T inv_tau, T& alpha, T& delta) {
  if (m_old == neg_inf<T>()) {
    alpha = T(0);
    delta = T(0);
  } else {
    delta = scaled_diff(m_old, m_new, inv_tau);
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
RLK_HOST_DEVICE inline SoftmaxState<T> softmax_merge(const SoftmaxState<T>& a, const SoftmaxState<T>& b, T inv_tau) {
  const T m = a.m > b.m ? a.m : b.m;
  T alpha_a, delta_a, alpha_b, delta_b;
  rescale_factors(a.m, m, inv_tau, alpha_a, delta_a);
  rescale_factors(b.m, m, inv_tau, alpha_b, delta_b);
  SoftmaxState<T> out{m, a.s, a.u};
  softmax_rescale(out.s, out.u, alpha_a, delta_a);
  T sb = b.s, ub = b.u;
  softmax_rescale(sb, ub, alpha_b, delta_b);
  out.s += sb;
  out.u += ub;
  return out;
}

// log p = (z − m)/τ − log s, never z/τ − lse: lse = m/τ + log s rounds to ulp(m/τ), which for
// large logits (|m| ≳ 1e3) costs more than every other rounding together, and at |m| ~ 1e38 all
// of log s. The row is therefore summarised by the pair (m, log s), never by lse.
template <typename T>
RLK_HOST_DEVICE inline T log_prob(const T& z, const T& m, const T& log_s, const T& inv_tau) {
  return scaled_diff(z, m, inv_tau) - log_s;
}

// Finalisation: log s, logp = (z_y − m)/τ − log s, H = log s − u/s (= lse − Σ p x). A row of
// −inf logits (m = −inf, s = 0) gives NaN logp and H, as log_softmax would.
template <typename T>
struct RowResult {
  T m;
  T log_s;
  T logp;
  T entropy;
};

template <typename T>
RLK_HOST_DEVICE inline RowResult<T> softmax_finalize(const SoftmaxState<T>& st, T z_target, T inv_tau) {
  RowResult<T> r;
  r.m = st.m;
  r.log_s = log_(st.s);
  r.logp = log_prob(z_target, st.m, r.log_s, inv_tau);
  r.entropy = r.log_s - st.u / st.s;
  return r;
}

// Gradient w.r.t. the logits z, with g = ∂L/∂logp, h = ∂L/∂H, p = softmax(z/τ) (under a cap: w.r.t. y, see SoftCap):
//     ∂L/∂z_v = (1/τ) [ g (1[v=y] − p_v) − h p_v (log p_v + H) ]
//             = (1/τ) g 1[v=y] + p_v (A + B log p_v),   A = −(g + h H)/τ,  B = −h/τ.
// log p_v = log_prob(z_v, m, log s, 1/τ) is clamped to exp_floor (p_v is then exactly 0 and so is its term).
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

// The two-pass row's coefficients (docs/design.md §2), for the incoming gradient `scale` it assumes: g = scale·∂s/∂ℓ
// of the token's loss, and h = scale·∂/∂H of an entropy bonus apart from the loss where there is one (`bonus`, not
// null), else of the loss's own entropy term where it has one (`entropy_in_loss`: its `grad_entropy`), else 0. Each
// product rounded alone, as the three-pass backward rounds the same derivatives times the incoming gradient. One
// definition for the CPU row and the CUDA cluster row.
template <typename T>
RLK_HOST_DEVICE inline GradCoeffs<T> two_pass_coeffs(T grad_logp, T grad_entropy, const T* bonus, bool entropy_in_loss,
                                                     T entropy, T scale, T inv_tau) {
  const T g = grad_logp * scale;
  if (bonus != nullptr) return grad_coeffs<T>(g, *bonus * scale, entropy, inv_tau);
  if (entropy_in_loss) return grad_coeffs<T>(g, grad_entropy * scale, entropy, inv_tau);
  return grad_coeffs<T>(g, T(0), T(0), inv_tau);
}

// Non-target element, given p = exp(logp) and the clamped logp (T may be a SIMD vector).
template <typename T>
RLK_HOST_DEVICE inline T grad_element(const T& p, const T& logp, const T& A, const T& B) {
  return p * (A + B * logp);
}

// Any element, scalar: the direct formula above.
template <typename T>
RLK_HOST_DEVICE inline T grad_logit(T z, T m, T log_s, T inv_tau, bool is_target, const GradCoeffs<T>& c) {
  T logp = log_prob(z, m, log_s, inv_tau);
  logp = logp < exp_floor<T>() ? exp_floor<T>() : logp;  // NaN stays NaN
  const T p = exp_(logp);
  const T g = grad_element(p, logp, c.A, c.B);
  return is_target ? c.target + g : g;
}

}  // namespace rlk
