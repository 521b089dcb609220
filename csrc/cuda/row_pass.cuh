// One row's pass of the CUDA kernels (token_logprobs.cu), per thread: which elements a thread of a
// group of kThreads owns (the first elements up to the row's first 16-byte boundary, one each;
// 16-byte packs, kFwdStep or kBwdStep elements per step; the last partial pack, one each), the
// forward's online softmax state over them, and the backward's gradient of them (the target's term
// added last, by the thread that owns it). __host__ __device__ and torch-free, so that
// csrc/tests/test_row_pass.cu can run every lane of a group on the host, without a GPU.
// Last, what the thread that finishes a row writes: the forward's results, or those and the
// per-token policy loss of rlkernels/token_loss.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "rlkernels/row_math.h"
#include "rlkernels/token_loss.h"
#include "launchers.h"

namespace rlk_cuda {
namespace rows {

using State = rlk::SoftmaxState<float>;

// One 16-byte access (p is 16-byte aligned): a single 128-bit load or store on the device; a
// memcpy on the host, where reading T objects through another type would be undefined.
template <typename V, typename T>
RLK_HOST_DEVICE __forceinline__ V load16(const T* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const V*>(p);
#else
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
#endif
}

template <typename V, typename T>
RLK_HOST_DEVICE __forceinline__ void store16(T* p, const V& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<V*>(p) = v;
#else
  std::memcpy(p, &v, sizeof(V));
#endif
}

// The same, with an evict-first hint (ld/st.global.cs): for the two-pass kernel's logits, read once into shared
// memory, and its gradient, written once: 2 × N·V elements through a 50 MB L2 of which none is reused, so they
// go first and leave in L2 what is (the per-row inputs, the lines that neighbouring rows share).
template <typename T>
RLK_HOST_DEVICE __forceinline__ uint4 load16_stream(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldcs(reinterpret_cast<const uint4*>(p));
#else
  return load16<uint4>(p);
#endif
}

template <typename T>
RLK_HOST_DEVICE __forceinline__ void store16_stream(T* p, const uint4& v) {
#if defined(__CUDA_ARCH__)
  __stcs(reinterpret_cast<uint4*>(p), v);
#else
  store16(p, v);
#endif
}

template <typename To, typename From>
RLK_HOST_DEVICE __forceinline__ To bit_cast(const From& from) {  // a register move on the device
  static_assert(sizeof(To) == sizeof(From), "bit_cast: sizes differ");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// 16 bytes of logits, converted to and from fp32 (stores round to nearest even, as on the CPU).
template <typename T> struct Pack;

template <> struct Pack<float> {
  static constexpr int kElems = 4;
  RLK_HOST_DEVICE static float to_float(float v) { return v; }
  RLK_HOST_DEVICE static float from_float(float v) { return v; }
  RLK_HOST_DEVICE static void load(const float* p, float* x) {
    const float4 v = load16<float4>(p);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  }
  RLK_HOST_DEVICE static void store(float* p, const float* x) { store16(p, make_float4(x[0], x[1], x[2], x[3])); }
  // 16 bytes already in registers (the two-pass kernel keeps them in shared memory, cluster_row.cuh)
  RLK_HOST_DEVICE static void unpack(const uint4& raw, float* x) {
    x[0] = bit_cast<float>(raw.x);
    x[1] = bit_cast<float>(raw.y);
    x[2] = bit_cast<float>(raw.z);
    x[3] = bit_cast<float>(raw.w);
  }
  RLK_HOST_DEVICE static uint4 pack(const float* x) {
    return make_uint4(bit_cast<uint32_t>(x[0]), bit_cast<uint32_t>(x[1]), bit_cast<uint32_t>(x[2]),
                      bit_cast<uint32_t>(x[3]));
  }
};

// 8 bf16 or fp16 values: 4 words of 2, converted pair by pair.
template <typename T, typename T2, typename Cvt>
struct PackHalves {
  static constexpr int kElems = 8;
  RLK_HOST_DEVICE static float to_float(T v) { return Cvt::to_float(v); }
  RLK_HOST_DEVICE static T from_float(float v) { return Cvt::from_float(v); }
  RLK_HOST_DEVICE static void load(const T* p, float* x) { unpack(load16<uint4>(p), x); }
  RLK_HOST_DEVICE static void store(T* p, const float* x) { store16(p, pack(x)); }
  RLK_HOST_DEVICE static void unpack(const uint4& raw, float* x) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = Cvt::to_float2(bit_cast<T2>(w[i]));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  }
  RLK_HOST_DEVICE static uint4 pack(const float* x) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = bit_cast<uint32_t>(Cvt::from_float2(x[2 * i], x[2 * i + 1]));
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

struct CvtBf16 {
  RLK_HOST_DEVICE static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  RLK_HOST_DEVICE static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  RLK_HOST_DEVICE static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  RLK_HOST_DEVICE static __nv_bfloat162 from_float2(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

struct CvtHalf {
  RLK_HOST_DEVICE static float to_float(__half v) { return __half2float(v); }
  RLK_HOST_DEVICE static __half from_float(float v) { return __float2half_rn(v); }
  RLK_HOST_DEVICE static float2 to_float2(__half2 v) { return __half22float2(v); }
  RLK_HOST_DEVICE static __half2 from_float2(float a, float b) { return __floats2half2_rn(a, b); }
};

template <> struct Pack<__nv_bfloat16> : PackHalves<__nv_bfloat16, __nv_bfloat162, CvtBf16> {};
template <> struct Pack<__half> : PackHalves<__half, __half2, CvtHalf> {};

// Elements one thread loads per step, the loads issued together: in the forward 16 (one to four
// packs), in the backward, which also holds the results until it stores them, two packs (8 or 16).
// Half under a cap, whose tanh per element holds registers. With these steps the kernels without a cap
// fit in 40 registers (1536 resident threads per SM: kMinBlocks in token_logprobs.cu) without spilling.
template <bool kCap>
constexpr int kFwdStep = kCap ? 8 : 16;
template <typename T, bool kCap>
constexpr int kBwdStep = Pack<T>::kElems * (kCap ? 1 : 2);

// Elements of a row before its first 16-byte boundary (rows of odd V are misaligned in turn).
template <typename T>
RLK_HOST_DEVICE __forceinline__ int64_t lead_elems(const T* p) {
  return static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / static_cast<int64_t>(sizeof(T));
}

RLK_HOST_DEVICE __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

RLK_HOST_DEVICE __forceinline__ float clamp_floor(float d) {  // max(d, exp_floor), but NaN stays NaN
  return d < rlk::exp_floor<float>() ? rlk::exp_floor<float>() : d;
}

// e^d for d in [exp_floor, 0]: ex2.approx after one multiply (__expf, with subnormal results
// flushed to 0: they are below 1e-38 of the terms that matter). Relative error below 2e-6 for
// d > −20, exactly 1 at d = 0 and 0 at exp_floor. The host version is for the host test.
RLK_HOST_DEVICE __forceinline__ float fast_exp(float d) {
#if defined(__CUDA_ARCH__)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(d * 1.4426950408889634f));
  return e;
#else
  const float e = std::exp2(d * 1.4426950408889634f);
  return e < 1.17549435e-38f ? 0.0f : e;
#endif
}

// The logit the softmax sees: y = cap(z) under a cap, else z. The cap is a template flag, so that a
// kernel without one (the common case) holds no register and issues no instruction of it.
template <bool kCap>
RLK_HOST_DEVICE __forceinline__ float head_logit(const Head& hd, float z) {
  if constexpr (kCap) return hd.cap.capped(z, hd.cap.tanh_of(z));
  return z;
}

// One thread's share of a row: the online softmax state over the elements it has seen.
template <bool kEntropy>
struct Online {
  float inv_tau;
  State st{rlk::neg_inf<float>(), 0.0f, 0.0f};

  template <int kCount>
  RLK_HOST_DEVICE __forceinline__ void add(const float (&x)[kCount]) {
    float mx = rlk::neg_inf<float>();
#pragma unroll
    for (int i = 0; i < kCount; ++i) mx = fmaxf(mx, x[i]);  // ignores NaN; z − m below does not
    if (mx > st.m) {
      float alpha, delta;
      rlk::rescale_factors(st.m, mx, inv_tau, alpha, delta);
      rlk::softmax_rescale<float, float, kEntropy>(st.s, st.u, alpha, delta);
      st.m = mx;
    }
    if (st.m == rlk::neg_inf<float>()) {  // only −inf (or NaN) so far: nothing to add but a NaN
#pragma unroll
      for (int i = 0; i < kCount; ++i) {
        if (x[i] != x[i]) st.s = x[i];
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const float d = clamp_floor(rlk::scaled_diff(x[i], st.m, inv_tau));
      rlk::softmax_accumulate<float, kEntropy>(st.s, st.u, fast_exp(d), d);
    }
  }
};


// kUnroll packs of thread `lane`'s step of kElems at pack i: packs i, i + kThreads, ...; all of them
// exist when kFull (then the loads are issued back to back), else the missing ones read as −inf.
template <typename T, int kThreads, int kElems, bool kFull>
RLK_HOST_DEVICE __forceinline__ void load_step(const T* body, int64_t i, int64_t packs, float* x) {
  using P = Pack<T>;
  constexpr int K = P::kElems, kUnroll = kElems / K;
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t k = i + int64_t(j) * kThreads;
    if (kFull || k < packs) {
      P::load(body + k * K, x + j * K);
    } else {
#pragma unroll
      for (int e = 0; e < K; ++e) x[j * K + e] = rlk::neg_inf<float>();
    }
  }
}

// The state of the elements of row z that thread `lane` of its group of kThreads owns (capped under
// kCap: the missing ones of a partial step stay −inf).
template <typename T, int kThreads, bool kEntropy, bool kCap>
RLK_HOST_DEVICE __forceinline__ State thread_state(const T* __restrict__ z, int64_t V, const Head& hd, int lane) {
  using P = Pack<T>;
  constexpr int kN = kFwdStep<kCap>, K = P::kElems, kUnroll = kN / K;
  Online<kEntropy> acc{hd.inv_tau};
  const int64_t head = min64(V, lead_elems(z));
  if (lane < head) {
    const float x[1] = {head_logit<kCap>(hd, P::to_float(z[lane]))};
    acc.add(x);
  }
  const T* body = z + head;
  const int64_t packs = (V - head) / K;
  float x[kN];
  auto cap_step = [&]() {
#pragma unroll
    for (int e = 0; e < kN; ++e) x[e] = head_logit<kCap>(hd, x[e]);
  };
  int64_t i = lane;
  for (; i + int64_t(kUnroll - 1) * kThreads < packs; i += int64_t(kThreads) * kUnroll) {
    load_step<T, kThreads, kN, true>(body, i, packs, x);
    cap_step();
    acc.add(x);
  }
  if (i < packs) {  // the last step, partial
    load_step<T, kThreads, kN, false>(body, i, packs, x);
    cap_step();
    acc.add(x);
  }
  const int64_t done = head + packs * K;
  if (lane < V - done) {
    const float x1[1] = {head_logit<kCap>(hd, P::to_float(z[done + lane]))};
    acc.add(x1);
  }
  return acc.st;
}

// ∂L/∂z of one element, from the clamped log p = (y − m)/τ − log s, y = cap(z) (rlk::grad_logit
// with a fast exp), times dy/dz under a cap (kCap).
template <bool kCapped>
struct GradOf {
  static constexpr bool kCap = kCapped;
  float m, log_s;
  Head hd;
  rlk::GradCoeffs<float> c;
  int target;  // in [0, V), or −1 for none (V < 2^31); 32 bits: one register fewer across the row
  RLK_HOST_DEVICE __forceinline__ float of(float z, bool is_target) const {
    float t = 0.0f;
    if constexpr (kCap) {
      t = hd.cap.tanh_of(z);
      z = hd.cap.capped(z, t);
    }
    const float l = clamp_floor(rlk::log_prob(z, m, log_s, hd.inv_tau));
    const float g = rlk::grad_element(fast_exp(l), l, c.A, c.B);
    const float gy = is_target ? c.target + g : g;
    if constexpr (kCap) return gy * rlk::SoftCap<float>::slope(t);
    return gy;
  }
};

// Whether thread `lane` of a group of kThreads owns element v of row z in grad_row (kVec: the first
// elements one each, the 16-byte packs in turn, the last partial pack one each; else in turn).
template <typename T, int kThreads, bool kVec>
RLK_HOST_DEVICE __forceinline__ bool owns(const T* z, int64_t V, int64_t v, int lane) {
  if (v < 0 || v >= V) return false;
  if (!kVec) return v % kThreads == lane;
  constexpr int K = Pack<T>::kElems;
  const int64_t head = min64(V, lead_elems(z)), done = head + (V - head) / K * K;
  if (v < head) return v == lane;
  if (v >= done) return v - done == lane;
  return (v - head) / K % kThreads == lane;
}

// No __restrict__: z and out may be the same memory. The target's term is added by the thread that
// owns the target, after its other elements (a select per element would cost an instruction and,
// hoisted, registers): it reads the target's logit before it writes any element, and nobody else
// writes that one.
template <typename T, int kThreads, bool kVec, typename Grad>
RLK_HOST_DEVICE __forceinline__ void grad_row(const T* z, T* out, int64_t V, const Grad& grad, int lane) {
  using P = Pack<T>;
  const bool has_target = owns<T, kThreads, kVec>(z, V, grad.target, lane);
  const float z_y = has_target ? P::to_float(z[grad.target]) : 0.0f;
  auto one = [&](int64_t v) { out[v] = P::from_float(grad.of(P::to_float(z[v]), false)); };
  if (!kVec) {  // z and out differ in alignment: element by element (still coalesced)
    for (int64_t v = lane; v < V; v += kThreads) one(v);
  } else {
    constexpr int kN = kBwdStep<T, Grad::kCap>, K = P::kElems, kUnroll = kN / K;
    const int64_t head = min64(V, lead_elems(z));
    if (lane < head) one(lane);
    const T* zb = z + head;
    T* ob = out + head;
    const int64_t packs = (V - head) / K;
    // Each step loads its packs, then stores them: every element is read before it is written.
    auto step = [&](int64_t i, auto full) {
      float x[kN];
      load_step<T, kThreads, kN, decltype(full)::value>(zb, i, packs, x);
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t k = i + int64_t(j) * kThreads;
        if (decltype(full)::value || k < packs) {
#pragma unroll
          for (int e = 0; e < K; ++e) x[j * K + e] = grad.of(x[j * K + e], false);
          P::store(ob + k * K, x + j * K);
        }
      }
    };
    int64_t i = lane;
    for (; i + int64_t(kUnroll - 1) * kThreads < packs; i += int64_t(kThreads) * kUnroll) {
      step(i, std::true_type());
    }
    if (i < packs) step(i, std::false_type());
    const int64_t done = head + packs * K;
    if (lane < V - done) one(done + lane);
  }
  if (has_target) out[grad.target] = P::from_float(grad.of(z_y, true));
}

// token_logprobs_fwd's row results; `entropy` is written only when kEntropy.
template <bool kEntropy>
struct StoreRow {
  float* logp;
  float* entropy;
  float* lse_parts;
  RLK_HOST_DEVICE __forceinline__ void operator()(int64_t row, const rlk::RowResult<float>& r) const {
    logp[row] = r.logp;
    lse_parts[2 * row] = r.m;
    lse_parts[2 * row + 1] = r.log_s;
    if (kEntropy) entropy[row] = r.entropy;
  }
};

// policy_token_fwd's: the row results and the token's loss, gradients and statistics.
struct StorePolicyToken {
  TokenInputs in;
  rlk::TokenLossParams<float> params;
  TokenOutputs out;
  RLK_HOST_DEVICE __forceinline__ void operator()(int64_t row, const rlk::RowResult<float>& r) const {
    out.logp[row] = r.logp;
    out.entropy[row] = r.entropy;
    out.lse_parts[2 * row] = r.m;
    out.lse_parts[2 * row + 1] = r.log_s;
    rlk::token_loss(in.at(row, r.logp, r.entropy), params).store(row, out.grad_logp, out.grad_entropy, out.stats);
  }
};

}  // namespace rows
}  // namespace rlk_cuda
