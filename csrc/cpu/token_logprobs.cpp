// CPU backend of the per-token log-prob / entropy primitive (docs/design.md §2; the contract is in
// rlkernels/kernels/__init__.py). Rows run in parallel (at::parallel_for); each row is one
// streaming pass over V, vectorised with at::vec and accumulated in fp32 (fp64 for fp64).
//
// Forward, per row: the row is cut into blocks of kBlock elements that fit in L1. A first
// sweep over a block finds its max (cheap: no exp); if it raises the running max m the lane
// sums are rescaled once; a second sweep, served from L1, adds e^d and e^d·d, d = (z − m)/τ, per
// lane. Memory traffic is one read of the logits; exp is evaluated once per element.
// Backward, per row: one read of the logits, one write of the gradient.
// Logits (N, V) or (B, T, V), each row where rlk::RowIndex says: a view such as logits[:, :-1] is read
// where it lies, all its rows in one call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <tuple>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "rlkernels/checks.h"
#include "rlkernels/dispatch.h"
#include "rlkernels/grad_out_check.h"
#include "rlkernels/op_args.h"
#include "rlkernels/row_math.h"
#include "rlkernels/token_loss.h"
#include "rlkernels/token_loss_args.h"

namespace rlk_cpu {
namespace {

using at::vec::Vectorized;

#if defined(CPU_CAPABILITY_AVX512)
constexpr const char* kIsa = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "default";
#endif

// 2048 elements: 8 KB of fp32 per block, so the second sweep reads from L1.
constexpr int64_t kBlock = 2048;

// Loads and stores two accumulator vectors (kStep elements) of logits of type scalar_t.
template <typename scalar_t>
struct Io {  // bf16, fp16: converted to and from fp32
  using acc_t = float;
  using Vec = Vectorized<float>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static void load(const scalar_t* p, Vec& a, Vec& b) { at::vec::load_to_float<scalar_t>(p, a, b); }
  static void store(scalar_t* p, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<scalar_t>(a, b).store(p);
  }
};

template <typename acc>
struct IoSame {  // fp32, fp64: no conversion
  using acc_t = acc;
  using Vec = Vectorized<acc>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static void load(const acc* p, Vec& a, Vec& b) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + Vec::size());
  }
  static void store(acc* p, const Vec& a, const Vec& b) {
    a.store(p);
    b.store(p + Vec::size());
  }
};
template <> struct Io<float> : IoSame<float> {};
template <> struct Io<double> : IoSame<double> {};

// The two-pass row's gradient (backward_row_kept) is written once and not read again by the op (2.5 GB at
// N = 4096, V = 151936, fp32): a non-temporal store goes around the cache and does not read the line before
// writing it. Measured on the row alone (N = 2048, preallocated out, 15 calls): 4-5% less time in fp32 and bf16. The
// three-pass backward, bound by its exp, gained nothing measurable and keeps plain stores; in place the row's lines
// are in cache already. `p` is aligned to the vector width (kStreamAlign); the caller ends the row with
// stream_fence. Without AVX2/AVX-512, plain stores.
#if defined(CPU_CAPABILITY_AVX512)
constexpr uintptr_t kStreamAlign = 64;
inline void stream_vec(float* p, __m512 v) { _mm512_stream_ps(p, v); }
inline void stream_vec(double* p, __m512d v) { _mm512_stream_pd(p, v); }
template <typename T> void stream_vec(T* p, __m512i v) { _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v); }
#elif defined(CPU_CAPABILITY_AVX2)
constexpr uintptr_t kStreamAlign = 32;
inline void stream_vec(float* p, __m256 v) { _mm256_stream_ps(p, v); }
inline void stream_vec(double* p, __m256d v) { _mm256_stream_pd(p, v); }
template <typename T> void stream_vec(T* p, __m256i v) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v); }
#endif

template <typename scalar_t>
bool can_stream(const scalar_t* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<uintptr_t>(p) % kStreamAlign == 0;
#else
  (void)p;
  return false;
#endif
}

// IO::store, non-temporal where can_stream(p) said so for the row's start (p: a whole step past it).
template <typename scalar_t>
void stream_store(scalar_t* p, const typename Io<scalar_t>::Vec& a, const typename Io<scalar_t>::Vec& b) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    stream_vec(p, a);
    stream_vec(p + Io<scalar_t>::Vec::size(), b);
  } else {
    stream_vec(p, at::vec::convert_from_float<scalar_t>(a, b));
  }
#else
  Io<scalar_t>::store(p, a, b);
#endif
}

inline void stream_fence() {  // orders the row's non-temporal stores before anything written after
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// The last partial step of a row: padded with −inf, which contributes nothing to any sum.
template <typename scalar_t>
void load_tail(const scalar_t* p, int64_t count, typename Io<scalar_t>::Vec& a, typename Io<scalar_t>::Vec& b) {
  scalar_t buf[Io<scalar_t>::kStep];
  std::fill(buf, buf + Io<scalar_t>::kStep, scalar_t(-std::numeric_limits<float>::infinity()));
  std::memcpy(buf, p, count * sizeof(scalar_t));
  Io<scalar_t>::load(buf, a, b);
}

template <typename scalar_t>
void store_tail(scalar_t* p, int64_t count, const typename Io<scalar_t>::Vec& a, const typename Io<scalar_t>::Vec& b) {
  scalar_t buf[Io<scalar_t>::kStep];
  Io<scalar_t>::store(buf, a, b);
  std::memcpy(p, buf, count * sizeof(scalar_t));
}

// exp on a vector. fp32 under AVX2/AVX-512: at::vec's inline polynomial (≤ 20 ulp, i.e. 2.4e-6
// relative, exactly 1 at 0, exactly 0 below ln(FLT_MIN)); measured 1.5-2x faster than Sleef's 1-ulp
// exp (a library call) on the forward, and its error stays well inside the 1e-5 budget.
// Elsewhere (fp64, the generic ISA) exp_u20 is exp.
template <typename Vec>
Vec vexp(const Vec& x) {
  return x.exp_u20();
}

template <typename Vec>
typename Vec::value_type reduce_max(const Vec& v) {
  __at_align__ typename Vec::value_type buf[Vec::size()];
  v.store(buf);
  auto r = buf[0];
  for (int i = 1; i < Vec::size(); ++i) {
    if (buf[i] > r || std::isnan(buf[i])) r = buf[i];  // NaN wins
  }
  return r;
}

template <typename Vec>
typename Vec::value_type reduce_sum(const Vec& v) {
  __at_align__ typename Vec::value_type buf[Vec::size()];
  v.store(buf);
  auto r = buf[0];
  for (int i = 1; i < Vec::size(); ++i) r += buf[i];
  return r;
}

// The soft cap (rlk::SoftCap) on vectors: tanh is at::vec's (Sleef, 1 ulp). A scalar goes through
// the same vector code (lane 0), so that the row max and the target round exactly as their lanes do.
template <typename Vec>
struct VecCap {
  Vec c, inv_c, neg_inf;
  template <typename acc_t>
  explicit VecCap(const rlk::SoftCap<acc_t>& cap) : c(cap.c), inv_c(cap.inv_c), neg_inf(rlk::neg_inf<acc_t>()) {}
  Vec tanh_of(const Vec& z) const { return (z * inv_c).tanh(); }
  Vec capped(const Vec& z, const Vec& t) const { return Vec::blendv(t * c, z, z == neg_inf); }  // −inf stays
  Vec apply(const Vec& z) const { return capped(z, tanh_of(z)); }
  typename Vec::value_type lane0(const Vec& v) const {
    __at_align__ typename Vec::value_type buf[Vec::size()];
    v.store(buf);
    return buf[0];
  }
};

// e^d of a step of elements into the two-pass row's scratch (kStep elements; past V into its padding).
template <typename Vec>
void keep_pair(typename Vec::value_type* p, const Vec& a, const Vec& b) {
  a.store(p);
  b.store(p + Vec::size());
}

// `keep` (V + kStep elements) and `block_m` (a block's entry each), for the two-pass row: e^d of every element
// and the running max m each block's d was taken at (−inf for a block skipped, as every element so far was −inf).
template <typename scalar_t, bool kEntropy, bool kCap>
rlk::RowResult<typename Io<scalar_t>::acc_t> forward_row(
    const scalar_t* z, int64_t V, int64_t target, typename Io<scalar_t>::acc_t inv_tau,
    const rlk::SoftCap<typename Io<scalar_t>::acc_t>& soft_cap, typename Io<scalar_t>::acc_t* keep = nullptr,
    typename Io<scalar_t>::acc_t* block_m = nullptr) {
  using IO = Io<scalar_t>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t kStep = IO::kStep;
  const Vec v_inv_tau(inv_tau), v_floor(rlk::exp_floor<acc_t>()), v_neg_inf(rlk::neg_inf<acc_t>());
  const VecCap<Vec> cap(soft_cap);

  acc_t m = rlk::neg_inf<acc_t>();
  Vec s0(0), s1(0), u0(0), u1(0);  // two independent chains of per-lane sums
  Vec a, b;
  for (int64_t start = 0; start < V; start += kBlock) {
    const scalar_t* zb = z + start;
    const int64_t len = std::min(kBlock, V - start);
    const int64_t full = len - len % kStep;

    // Sweep 1: the block's max, on the raw logits (τ is applied to differences only; the cap is
    // monotone, so it is applied to the max alone).
    Vec mx0 = v_neg_inf, mx1 = v_neg_inf;
    for (int64_t i = 0; i < full; i += kStep) {
      IO::load(zb + i, a, b);
      mx0 = at::vec::maximum(mx0, a);
      mx1 = at::vec::maximum(mx1, b);
    }
    if (full < len) {
      load_tail(zb + full, len - full, a, b);
      mx0 = at::vec::maximum(mx0, a);
      mx1 = at::vec::maximum(mx1, b);
    }
    acc_t block_max = reduce_max(at::vec::maximum(mx0, mx1));
    if (kCap) block_max = cap.lane0(cap.apply(Vec(block_max)));
    if (!(block_max < std::numeric_limits<acc_t>::infinity())) {
      // A NaN or +inf logit: the row's results are NaN, as log_softmax's would be. (Without
      // this, exp_u20, which clamps its argument, would turn NaN into finite garbage.)
      const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
      return {nan, nan, nan, nan};
    }
    if (block_max > m) {
      acc_t alpha, delta;
      rlk::rescale_factors(m, block_max, inv_tau, alpha, delta);
      rlk::softmax_rescale<Vec, Vec, kEntropy>(s0, u0, Vec(alpha), Vec(delta));
      rlk::softmax_rescale<Vec, Vec, kEntropy>(s1, u1, Vec(alpha), Vec(delta));
      m = block_max;
    }
    if (keep != nullptr) block_m[start / kBlock] = m;
    if (m == rlk::neg_inf<acc_t>()) continue;  // every element so far is −inf

    // Sweep 2 (from L1): d = max((z − m)/τ, floor), e = e^d, summed into block-local sums that are
    // then added to the running ones: fp32 chains of ~V/2048 + 128 additions, not V/16.
    const Vec v_m(m);
    Vec bs0(0), bs1(0), bu0(0), bu1(0);
    // The next block's line at the same offset, fetched while this sweep computes: its max sweep then reads from
    // cache instead of waiting on memory with the exps idle (the hardware prefetcher does not run ahead here, as
    // this sweep re-reads a block it has seen).
    const int64_t ahead = std::min(kBlock, V - start - len);
    for (int64_t i = 0; i < full; i += kStep) {
      if (i < ahead) __builtin_prefetch(zb + kBlock + i);
      IO::load(zb + i, a, b);
      if (kCap) {
        a = cap.apply(a);
        b = cap.apply(b);
      }
      const Vec da = at::vec::maximum(rlk::scaled_diff(a, v_m, v_inv_tau), v_floor);
      const Vec db = at::vec::maximum(rlk::scaled_diff(b, v_m, v_inv_tau), v_floor);
      const Vec ea = vexp(da), eb = vexp(db);
      if (keep != nullptr) keep_pair(keep + start + i, ea, eb);
      rlk::softmax_accumulate<Vec, kEntropy>(bs0, bu0, ea, da);
      rlk::softmax_accumulate<Vec, kEntropy>(bs1, bu1, eb, db);
    }
    if (full < len) {
      load_tail(zb + full, len - full, a, b);
      if (kCap) {  // the −inf padding stays −inf
        a = cap.apply(a);
        b = cap.apply(b);
      }
      const Vec da = at::vec::maximum(rlk::scaled_diff(a, v_m, v_inv_tau), v_floor);
      const Vec db = at::vec::maximum(rlk::scaled_diff(b, v_m, v_inv_tau), v_floor);
      const Vec ea = vexp(da), eb = vexp(db);
      if (keep != nullptr) keep_pair(keep + start + full, ea, eb);
      rlk::softmax_accumulate<Vec, kEntropy>(bs0, bu0, ea, da);
      rlk::softmax_accumulate<Vec, kEntropy>(bs1, bu1, eb, db);
    }
    s0 = s0 + bs0;
    s1 = s1 + bs1;
    if (kEntropy) {
      u0 = u0 + bu0;
      u1 = u1 + bu1;
    }
  }
  rlk::SoftmaxState<acc_t> st{m, reduce_sum(s0 + s1), kEntropy ? reduce_sum(u0 + u1) : acc_t(0)};
  const acc_t z_target = static_cast<acc_t>(z[target]);
  return rlk::softmax_finalize(st, kCap ? cap.lane0(cap.apply(Vec(z_target))) : z_target, inv_tau);
}

template <typename scalar_t, bool kCap>
void backward_row(const scalar_t* z, scalar_t* grad, int64_t V, int64_t target,
                  typename Io<scalar_t>::acc_t m, typename Io<scalar_t>::acc_t log_s,
                  const rlk::GradCoeffs<typename Io<scalar_t>::acc_t>& c, typename Io<scalar_t>::acc_t inv_tau,
                  const rlk::SoftCap<typename Io<scalar_t>::acc_t>& soft_cap) {
  using IO = Io<scalar_t>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t kStep = IO::kStep;
  const Vec v_inv_tau(inv_tau), v_floor(rlk::exp_floor<acc_t>()), v_m(m), v_log_s(log_s), v_A(c.A), v_B(c.B);
  const VecCap<Vec> cap(soft_cap);
  const int64_t full = V - V % kStep;
  // Read before the loop: `grad` may be `z` itself (in place), and the loop overwrites z[target].
  const acc_t z_target = static_cast<acc_t>(z[target]);
  Vec a, b;
  auto grad1 = [&](Vec& x) {  // a logit in, its gradient out
    Vec t;
    if (kCap) {
      t = cap.tanh_of(x);
      x = cap.capped(x, t);
    }
    const Vec l = at::vec::maximum(rlk::log_prob(x, v_m, v_log_s, v_inv_tau), v_floor);  // log p, clamped
    x = rlk::grad_element(vexp(l), l, v_A, v_B);
    if (kCap) x = x * ((Vec(1) - t) * (Vec(1) + t));
  };
  auto grad2 = [&](Vec& lo, Vec& hi) {
    grad1(lo);
    grad1(hi);
  };
  for (int64_t i = 0; i < full; i += kStep) {
    IO::load(z + i, a, b);
    grad2(a, b);
    IO::store(grad + i, a, b);
  }
  if (full < V) {
    load_tail(z + full, V - full, a, b);
    grad2(a, b);
    store_tail(grad + full, V - full, a, b);
  }
  // The target element again, with its 1[v=y] term, so that it is rounded once. Each step
  // above loads its elements before it stores the same elements, so in place is safe there too.
  if (kCap) {
    const Vec t = cap.tanh_of(Vec(z_target));
    grad[target] = static_cast<scalar_t>(rlk::grad_logit(cap.lane0(cap.capped(Vec(z_target), t)), m, log_s, inv_tau,
                                                         true, c) *
                                         rlk::SoftCap<acc_t>::slope(cap.lane0(t)));
  } else {
    grad[target] = static_cast<scalar_t>(rlk::grad_logit(z_target, m, log_s, inv_tau, true, c));
  }
}

// backward_row from the forward's kept e^d (forward_row's `keep`, `block_m`) rather than from the logits: p_v =
// e_v·e^{(m_b − m)/τ − log s} with one exp per block, not one per element, the exp being most of the work of a
// pass on a CPU. log p_v, for the entropy term alone (B ≠ 0), from the logit as in backward_row. The same
// formula; p rounds differently (a few ulp of fp32). For rows without a skipped block and without a cap.
template <typename scalar_t>
void backward_row_kept(const scalar_t* z, scalar_t* grad, int64_t V, int64_t target,
                       typename Io<scalar_t>::acc_t m, typename Io<scalar_t>::acc_t log_s,
                       const rlk::GradCoeffs<typename Io<scalar_t>::acc_t>& c, typename Io<scalar_t>::acc_t inv_tau,
                       const typename Io<scalar_t>::acc_t* keep, const typename Io<scalar_t>::acc_t* block_m) {
  using IO = Io<scalar_t>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t kStep = IO::kStep;
  const Vec v_inv_tau(inv_tau), v_floor(rlk::exp_floor<acc_t>()), v_m(m), v_log_s(log_s), v_A(c.A), v_B(c.B);
  const bool entropy_term = c.B != acc_t(0);
  const acc_t z_target = static_cast<acc_t>(z[target]);  // `grad` may be `z` itself
  const bool stream = static_cast<const void*>(grad) != static_cast<const void*>(z) && can_stream(grad);
  Vec a, b;
  for (int64_t start = 0; start < V; start += kBlock) {
    const int64_t len = std::min(kBlock, V - start);
    const Vec f(std::exp(rlk::scaled_diff(block_m[start / kBlock], m, inv_tau) - log_s));
    auto grad2 = [&](int64_t i, Vec& lo, Vec& hi) {  // the logits in (read only for the entropy term), ∂ out
      const Vec p0 = Vec::loadu(keep + start + i) * f, p1 = Vec::loadu(keep + start + i + Vec::size()) * f;
      if (!entropy_term) {
        lo = p0 * v_A;
        hi = p1 * v_A;
        return;
      }
      lo = rlk::grad_element(p0, at::vec::maximum(rlk::log_prob(lo, v_m, v_log_s, v_inv_tau), v_floor), v_A, v_B);
      hi = rlk::grad_element(p1, at::vec::maximum(rlk::log_prob(hi, v_m, v_log_s, v_inv_tau), v_floor), v_A, v_B);
    };
    const int64_t full = len - len % kStep;
    for (int64_t i = 0; i < full; i += kStep) {
      if (entropy_term) IO::load(z + start + i, a, b);
      grad2(i, a, b);
      if (stream) {
        stream_store(grad + start + i, a, b);
      } else {
        IO::store(grad + start + i, a, b);
      }
    }
    if (full < len) {
      if (entropy_term) load_tail(z + start + full, len - full, a, b);
      grad2(full, a, b);
      store_tail(grad + start + full, len - full, a, b);
    }
  }
  if (stream) stream_fence();
  grad[target] = static_cast<scalar_t>(rlk::grad_logit(z_target, m, log_s, inv_tau, true, c));
}

// ---------------------------------------------------------------------------------------------
// Checks and the registered ops

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

int64_t grain_rows(int64_t V) { return std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(V, 1)); }

void check_logits(const at::Tensor& logits) {
  RLK_CHECK_VALUE(logits.device().is_cpu(), "logits: expected a CPU tensor, got ", logits.device());
  rlk::check_logits_layout(logits);
  RLK_CHECK_TYPE(is_supported_float(logits.scalar_type()),
                 "logits: expected dtype float32, bfloat16, float16 or float64, got ", logits.scalar_type());
}

// targets (N,) int64 (int32 accepted) on the CPU, every value in [0, V) (read here: no device to
// synchronise with); returns an int64 contiguous copy or view.
at::Tensor check_targets(const at::Tensor& targets, const at::Tensor& logits) {
  const at::Tensor t = rlk::check_targets_shape(targets, logits);
  const int64_t N = rlk::row_count(logits), V = logits.size(-1);
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    RLK_CHECK_VALUE(p[n] >= 0 && p[n] < V, "targets: expected values in [0, ", V, "), got ", p[n], " at row ", n);
  }
  return t;
}

// forward_row with its compile-time flags chosen at run time.
template <typename scalar_t>
rlk::RowResult<typename Io<scalar_t>::acc_t> forward_row_as(
    bool need_entropy, const scalar_t* z, int64_t V, int64_t target, typename Io<scalar_t>::acc_t inv_tau,
    const rlk::SoftCap<typename Io<scalar_t>::acc_t>& cap) {
  if (cap.on()) {
    return need_entropy ? forward_row<scalar_t, true, true>(z, V, target, inv_tau, cap)
                        : forward_row<scalar_t, false, true>(z, V, target, inv_tau, cap);
  }
  return need_entropy ? forward_row<scalar_t, true, false>(z, V, target, inv_tau, cap)
                      : forward_row<scalar_t, false, false>(z, V, target, inv_tau, cap);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd_cpu(
    const at::Tensor& logits, const at::Tensor& targets, double temperature, double softcap, bool need_entropy) {
  check_logits(logits);
  const int64_t N = rlk::row_count(logits), V = logits.size(-1);
  RLK_CHECK_VALUE(N == 0 || V > 0, "logits: expected V > 0, got shape ", logits.sizes());
  const at::Tensor tgt = check_targets(targets, logits);
  rlk::check_temperature(temperature);
  rlk::check_softcap(softcap);
  const auto opts = logits.options().dtype(acc_type(logits.scalar_type()));
  at::Tensor logp = at::empty({N}, opts);
  at::Tensor lse_parts = at::empty({N, 2}, opts);
  at::Tensor entropy = at::empty({need_entropy ? N : 0}, opts);
  if (N == 0) return {logp, entropy, lse_parts};

  rlk::dispatch_floating<true>(logits.scalar_type(), "logits", [&](auto zero) {
    using scalar_t = decltype(zero);
    using acc_t = typename Io<scalar_t>::acc_t;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const rlk::RowIndex row = rlk::row_index(logits);
    const int64_t* y = tgt.const_data_ptr<int64_t>();
    acc_t* logp_p = logp.mutable_data_ptr<acc_t>();
    acc_t* lse_p = lse_parts.mutable_data_ptr<acc_t>();
    acc_t* ent_p = need_entropy ? entropy.mutable_data_ptr<acc_t>() : nullptr;
    const acc_t inv_tau = static_cast<acc_t>(1.0 / temperature);
    const auto cap = rlk::soft_cap<acc_t>(softcap);
    at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const auto r = forward_row_as<scalar_t>(need_entropy, z + row(n), V, y[n], inv_tau, cap);
        logp_p[n] = r.logp;
        lse_p[2 * n] = r.m;
        lse_p[2 * n + 1] = r.log_s;
        if (need_entropy) ent_p[n] = r.entropy;
      }
    });
  });
  return {logp, entropy, lse_parts};
}

// Writes ∂logits into `grad`: the shape and dtype of logits, unit stride over V, rows apart; it may be `logits`.
void token_logprobs_bwd_into(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_parts,
                             const at::Tensor& entropy, const at::Tensor& grad_logp,
                             const std::optional<at::Tensor>& grad_entropy, double temperature, double softcap,
                             at::Tensor& grad) {
  const int64_t N = rlk::row_count(logits), V = logits.size(-1);
  RLK_CHECK_VALUE(N == 0 || V > 0, "logits: expected V > 0, got shape ", logits.sizes());
  const at::Tensor tgt = check_targets(targets, logits);
  rlk::check_temperature(temperature);
  rlk::check_softcap(softcap);
  const at::ScalarType acc = acc_type(logits.scalar_type());
  const at::Tensor lse_c = rlk::check_row_vector(lse_parts, "lse_parts", logits, acc, /*pair=*/true);
  const at::Tensor g_c = rlk::check_row_vector(grad_logp, "grad_logp", logits, acc);
  const bool has_h = grad_entropy.has_value() && grad_entropy->defined();
  at::Tensor h_c, ent_c;
  if (has_h) {
    h_c = rlk::check_row_vector(*grad_entropy, "grad_entropy", logits, acc);
    ent_c = rlk::check_row_vector(entropy, "entropy", logits, acc);
  }
  if (N == 0) return;

  rlk::dispatch_floating<true>(logits.scalar_type(), "logits", [&](auto zero) {
    using scalar_t = decltype(zero);
    using acc_t = typename Io<scalar_t>::acc_t;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    scalar_t* gz = grad.mutable_data_ptr<scalar_t>();
    const rlk::RowIndex row = rlk::row_index(logits), out_row = rlk::row_index(grad);
    const int64_t* y = tgt.const_data_ptr<int64_t>();
    const acc_t* lse_p = lse_c.const_data_ptr<acc_t>();
    const acc_t* g_p = g_c.const_data_ptr<acc_t>();
    const acc_t* h_p = has_h ? h_c.const_data_ptr<acc_t>() : nullptr;
    const acc_t* ent_p = has_h ? ent_c.const_data_ptr<acc_t>() : nullptr;
    const acc_t inv_tau = static_cast<acc_t>(1.0 / temperature);
    const auto cap = rlk::soft_cap<acc_t>(softcap);
    at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const auto c = has_h ? rlk::grad_coeffs<acc_t>(g_p[n], h_p[n], ent_p[n], inv_tau)
                             : rlk::grad_coeffs<acc_t>(g_p[n], acc_t(0), acc_t(0), inv_tau);
        const auto pass = [&](auto kCap) {
          backward_row<scalar_t, decltype(kCap)::value>(z + row(n), gz + out_row(n), V, y[n], lse_p[2 * n],
                                                        lse_p[2 * n + 1], c, inv_tau, cap);
        };
        if (cap.on()) {
          pass(std::true_type());
        } else {
          pass(std::false_type());
        }
      }
    });
  });
}

at::Tensor token_logprobs_bwd_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_parts,
                                  const at::Tensor& entropy, const at::Tensor& grad_logp,
                                  const std::optional<at::Tensor>& grad_entropy, double temperature, double softcap) {
  check_logits(logits);
  at::Tensor grad = at::empty_like(logits);
  token_logprobs_bwd_into(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap, grad);
  return grad;
}

// `out`: the logits themselves, or memory disjoint from them (rlkernels/grad_out_check.h).
void token_logprobs_bwd_out_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_parts,
                                const at::Tensor& entropy, const at::Tensor& grad_logp,
                                const std::optional<at::Tensor>& grad_entropy, double temperature, double softcap,
                                const at::Tensor& out) {
  check_logits(logits);
  RLK_CHECK_VALUE(out.device().is_cpu(), "out: expected a CPU tensor, got ", out.device());
  rlk::check_grad_out(logits, out);
  at::Tensor grad = out;
  token_logprobs_bwd_into(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap, grad);
}

// Where the two-pass row writes ∂logits: `grad` (the logits' shape, rows apart; it may be the logits),
// scale·(the backward formula of docs/design.md §2) from the token's own derivatives, or ∂/∂H from
// `entropy_grad` where given (an entropy bonus outside the kernel's loss).
struct GradTarget {
  at::Tensor* grad;
  const std::optional<at::Tensor>& entropy_grad;
  double scale;
};

// The forward plus the per-token policy loss (rlkernels/token_loss.h) of each row, evaluated on
// the row's results while they are at hand: one read of the logits. With `into`, the two-pass row
// (docs/design.md §2): the row's ∂logits is written right after, while the row is still in this
// core's cache (a 151936-logit fp32 row is 594 KiB, within L2), so the logits are read once from
// memory and the gradient written once, where forward + backward read them twice.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_token_rows(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, double temperature, double softcap, at::ArrayRef<double> params,
    const GradTarget* into) {
  check_logits(logits);
  const int64_t N = rlk::row_count(logits), V = logits.size(-1);
  RLK_CHECK_VALUE(N == 0 || V > 0, "logits: expected V > 0, got shape ", logits.sizes());
  const at::Tensor tgt = check_targets(targets, logits);
  rlk::check_temperature(temperature);
  rlk::check_softcap(softcap);
  const at::ScalarType acc = acc_type(logits.scalar_type());
  rlk::check_token_inputs(logits, "the rows of logits", mask, weight, adv, old_logp, ref_logp, acc);
  if (is_weights.has_value()) rlk::check_token_tensor(*is_weights, "is_weights", logits, "the rows of logits", acc);
  if (into != nullptr) rlk::check_two_pass_args(logits, into->entropy_grad, into->scale, acc);
  const bool bonus = into != nullptr && into->entropy_grad.has_value();
  const auto opts = logits.options().dtype(acc);
  at::Tensor logp = at::empty({N}, opts), entropy = at::empty({N}, opts), lse_parts = at::empty({N, 2}, opts);
  at::Tensor grad_logp = at::empty({N}, opts), grad_entropy = at::empty({N}, opts);
  at::Tensor stats = at::empty({N, int64_t(rlk::kNumStats)}, opts);

  rlk::dispatch_floating<true>(logits.scalar_type(), "logits", [&](auto zero) {
    using scalar_t = decltype(zero);
    using acc_t = typename Io<scalar_t>::acc_t;
    // Checked before the N == 0 return, so that bad scalars fail on every batch.
    const rlk::TokenLossParams<acc_t> loss = rlk::token_loss_params<acc_t>(params);
    if (N == 0) return;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const rlk::RowIndex row = rlk::row_index(logits);
    const int64_t* y = tgt.const_data_ptr<int64_t>();
    const rlk::TokenArrays<acc_t> in{mask.const_data_ptr<bool>(), weight.const_data_ptr<acc_t>(),
                                     adv.const_data_ptr<acc_t>(), rlk::optional_ptr<acc_t>(old_logp),
                                     rlk::optional_ptr<acc_t>(ref_logp), nullptr,
                                     rlk::optional_ptr<acc_t>(is_weights)};
    acc_t* logp_p = logp.mutable_data_ptr<acc_t>();
    acc_t* ent_p = entropy.mutable_data_ptr<acc_t>();
    acc_t* lse_p = lse_parts.mutable_data_ptr<acc_t>();
    acc_t* gl_p = grad_logp.mutable_data_ptr<acc_t>();
    acc_t* ge_p = grad_entropy.mutable_data_ptr<acc_t>();
    acc_t* st_p = stats.mutable_data_ptr<acc_t>();
    const acc_t inv_tau = static_cast<acc_t>(1.0 / temperature);
    const auto cap = rlk::soft_cap<acc_t>(softcap);
    scalar_t* gz = into != nullptr ? into->grad->mutable_data_ptr<scalar_t>() : nullptr;
    const rlk::RowIndex out_row = into != nullptr ? rlk::row_index(*into->grad) : row;
    const acc_t* bonus_p = bonus ? into->entropy_grad->const_data_ptr<acc_t>() : nullptr;
    const acc_t scale = into != nullptr ? static_cast<acc_t>(into->scale) : acc_t(1);
    // Without a cap the forward keeps e^d of the row, so that the backward takes no exp per element.
    const bool kept = gz != nullptr && !cap.on();
    at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> keep(kept ? V + Io<scalar_t>::kStep : 0), block_m(kept ? (V + kBlock - 1) / kBlock : 0);
      for (int64_t n = begin; n < end; ++n) {
        const auto r = kept ? forward_row<scalar_t, true, false>(z + row(n), V, y[n], inv_tau, cap, keep.data(),
                                                                 block_m.data())
                            : forward_row_as<scalar_t>(true, z + row(n), V, y[n], inv_tau, cap);
        logp_p[n] = r.logp;
        ent_p[n] = r.entropy;
        lse_p[2 * n] = r.m;
        lse_p[2 * n + 1] = r.log_s;
        rlk::token_loss(in.at(n, r.logp, r.entropy), loss).store(n, gl_p, ge_p, st_p);
        if (gz == nullptr) continue;
        const auto c = rlk::two_pass_coeffs<acc_t>(gl_p[n], ge_p[n], bonus_p != nullptr ? bonus_p + n : nullptr,
                                                   loss.entropy_coef != 0, r.entropy, scale, inv_tau);
        // a NaN row returns before keeping every block, a row that starts with −inf blocks skips them
        const bool from_kept = kept && std::isfinite(r.log_s) &&
                               std::all_of(block_m.begin(), block_m.end(), [](acc_t mb) { return mb > rlk::neg_inf<acc_t>(); });
        if (from_kept) {
          backward_row_kept<scalar_t>(z + row(n), gz + out_row(n), V, y[n], r.m, r.log_s, c, inv_tau, keep.data(),
                                      block_m.data());
        } else if (cap.on()) {
          backward_row<scalar_t, true>(z + row(n), gz + out_row(n), V, y[n], r.m, r.log_s, c, inv_tau, cap);
        } else {
          backward_row<scalar_t, false>(z + row(n), gz + out_row(n), V, y[n], r.m, r.log_s, c, inv_tau, cap);
        }
      }
    });
  });
  return {logp, entropy, lse_parts, grad_logp, grad_entropy, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_token_fwd_cpu(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, double temperature, double softcap, at::ArrayRef<double> params) {
  return policy_token_rows(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, temperature, softcap,
                           params, nullptr);
}

// The two-pass row into `out`: the logits themselves, or memory disjoint from them (rlkernels/grad_out_check.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_token_fwd_grad_out_cpu(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, const std::optional<at::Tensor>& entropy_grad, double temperature,
    double softcap, at::ArrayRef<double> params, double scale, const at::Tensor& out) {
  check_logits(logits);
  RLK_CHECK_VALUE(out.device().is_cpu(), "out: expected a CPU tensor, got ", out.device());
  rlk::check_grad_out(logits, out);
  at::Tensor grad = out;
  const GradTarget into{&grad, entropy_grad, scale};
  auto r = policy_token_rows(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, temperature, softcap,
                             params, &into);
  return {std::get<0>(r), std::get<1>(r), std::get<5>(r)};
}

// The two-pass row into a new gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_token_fwd_grad_cpu(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, const std::optional<at::Tensor>& entropy_grad, double temperature,
    double softcap, at::ArrayRef<double> params, double scale) {
  check_logits(logits);
  at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  const GradTarget into{&grad, entropy_grad, scale};
  auto r = policy_token_rows(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, temperature, softcap,
                             params, &into);
  return {std::get<0>(r), std::get<1>(r), std::get<5>(r), grad};
}

// grad ×= grad_out / assumed, in the accumulation precision, unless grad_out equals `assumed` (rounded
// to grad_out's dtype): the backward of the two-pass path. On the CPU the scalar is read where it lies
// (no device to wait for); a GPU kernel reads it on the device and returns at once when it matches.
void scale_grad_cpu(const at::Tensor& grad, const at::Tensor& grad_out, double assumed) {
  RLK_CHECK_VALUE(grad.device().is_cpu() && grad_out.device().is_cpu(), "grad, grad_out: expected CPU tensors, got ",
                  grad.device(), " and ", grad_out.device());
  RLK_CHECK_TYPE(is_supported_float(grad.scalar_type()), "grad: expected dtype float32, bfloat16, float16 or float64, "
                 "got ", grad.scalar_type());
  rlk::check_scale_grad_args(grad, grad_out, assumed);
  // read where it lies (no op: nothing for a dispatcher to see or a device to wait for)
  const bool fp64 = grad_out.scalar_type() == at::kDouble;
  const double incoming = fp64 ? *grad_out.const_data_ptr<double>() : double(*grad_out.const_data_ptr<float>());
  const double expected = fp64 ? assumed : double(static_cast<float>(assumed));
  if (incoming == expected || grad.numel() == 0) return;
  rlk::dispatch_floating<true>(grad.scalar_type(), "grad", [&](auto zero) {
    using scalar_t = decltype(zero);
    using IO = Io<scalar_t>;
    using acc_t = typename IO::acc_t;
    using Vec = typename IO::Vec;
    constexpr int64_t kStep = IO::kStep;
    const Vec ratio(static_cast<acc_t>(incoming / assumed));
    scalar_t* p = grad.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, grad.numel(), int64_t(1) << 16, [&](int64_t begin, int64_t end) {
      Vec a, b;
      int64_t i = begin;
      for (; i + kStep <= end; i += kStep) {
        IO::load(p + i, a, b);
        IO::store(p + i, a * ratio, b * ratio);
      }
      if (i < end) {
        load_tail(p + i, end - i, a, b);
        store_tail(p + i, end - i, a * ratio, b * ratio);
      }
    });
  });
}

}  // namespace
}  // namespace rlk_cpu

TORCH_LIBRARY_IMPL(rlkernels_C, CPU, m) {
  m.impl("token_logprobs_fwd", &rlk_cpu::token_logprobs_fwd_cpu);
  m.impl("token_logprobs_bwd", &rlk_cpu::token_logprobs_bwd_cpu);
  m.impl("token_logprobs_bwd_out", &rlk_cpu::token_logprobs_bwd_out_cpu);
  m.impl("policy_token_fwd", &rlk_cpu::policy_token_fwd_cpu);
  m.impl("policy_token_fwd_grad", &rlk_cpu::policy_token_fwd_grad_cpu);
  m.impl("policy_token_fwd_grad_out", &rlk_cpu::policy_token_fwd_grad_out_cpu);
  m.impl("scale_grad_", &rlk_cpu::scale_grad_cpu);
}

// ---------------------------------------------------------------------------------------------
// The Python module `rlkernels._C`: importing it runs the registrations of every file (the schemas
// in csrc/cpu/schemas.cpp). It refuses to load on a CPU that lacks the instruction set the file was
// compiled for (see setup.py).
#ifndef RLK_NO_PYTHON
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  __builtin_cpu_init();
#if defined(CPU_CAPABILITY_AVX512)
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  if (!ok) {
    PyErr_Format(PyExc_ImportError,
                 "rlkernels._C was compiled for %s but this CPU does not support it; rebuild with "
                 "RLKERNELS_CPU_ISA=default (or on this machine)",
                 rlk_cpu::kIsa);
    return nullptr;
  }
#endif
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "rlkernels compiled kernels", -1, nullptr};
  PyObject* mod = PyModule_Create(&def);
#if defined(RLK_WITH_CUDA)
  constexpr int kWithCuda = 1;  // csrc/cuda/ is compiled in (setup.py); it registers the CUDA kernels
#else
  constexpr int kWithCuda = 0;
#endif
  if (mod != nullptr && (PyModule_AddStringConstant(mod, "cpu_capability", rlk_cpu::kIsa) != 0 ||
                         PyModule_AddIntConstant(mod, "with_cuda", kWithCuda) != 0)) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
#endif
