// The CUDA kernels' per-row code (csrc/cuda/row_pass.cuh) run on the host, without a GPU: every
// lane of a group in turn, the lanes' forward states merged with rlk::softmax_merge (as cub's
// reduction does, in another order), against a double-precision reference. Covers the partition of
// a row among the lanes (head elements, 16-byte packs in full and partial steps, tail), for every
// dtype and group size the kernels use, rows aligned or not, and the backward in place, into
// another buffer, and into one aligned differently (the element-by-element path).
//
//   nvcc -O2 -std=c++17 -Icsrc/include -Icsrc/cuda csrc/tests/test_row_pass.cu -o /tmp/t && /tmp/t
// (python_tests/test_cuda_compile.py builds and runs it when nvcc exists.)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "row_pass.cuh"

using namespace rlk_cuda::rows;

namespace {

int failures = 0;

void fail(const char* what, const char* dtype, int threads, long V, int offset, long v, double got, double want) {
  if (++failures <= 20) {
    std::printf("FAIL %s: %s, %d threads, V=%ld, offset %d, element %ld: got %.9g, want %.9g\n", what, dtype, threads,
                V, offset, v, got, want);
  }
}

template <typename T> const char* name();
template <> const char* name<float>() { return "float32"; }
template <> const char* name<__nv_bfloat16>() { return "bfloat16"; }
template <> const char* name<__half>() { return "float16"; }

// Relative rounding of T (half an ulp is not enough: the kernel's fp32 result may round either way
// when it lies within its own error of a rounding boundary), and T's smallest subnormal.
template <typename T> double ulp();
template <> double ulp<float>() { return 0; }
template <> double ulp<__nv_bfloat16>() { return std::ldexp(1.0, -8); }
template <> double ulp<__half>() { return std::ldexp(1.0, -11); }
template <typename T> double tiny() { return std::is_same<T, __half>::value ? std::ldexp(1.0, -24) : 0; }

// A row of V elements that starts `offset` elements past a 16-byte boundary, with 16 bytes of
// guard before it and at least 16 elements after.
template <typename T>
struct Buffer {
  std::vector<unsigned char> storage;
  T* row;
  Buffer(long V, int offset) : storage(64 + (V + offset + 16) * sizeof(T)) {
    const uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + 31) & ~uintptr_t(15);
    row = reinterpret_cast<T*>(base) + offset;
  }
};

template <typename T, int kThreads>
void check(long V, int offset, std::mt19937& rng, int pattern) {
  const float tau = 0.7f, inv_tau = 1.0f / tau;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Buffer<T> buf(V, offset);
  T* z = buf.row;
  std::vector<float> zf(V);  // the values as stored in T
  const long target = static_cast<long>(rng() % V);
  for (long v = 0; v < V; ++v) {
    float x = normal(rng);
    if (pattern == 1 && v != target && rng() % 2 == 0) x = -INFINITY;  // masked vocabulary entries
    if (pattern == 2 && v != target) x = -INFINITY;                     // only the target is left
    z[v] = Pack<T>::from_float(x);
    zf[v] = Pack<T>::to_float(z[v]);
  }

  // Forward: every lane's state, merged.
  State st = rlk::softmax_init<float>();
  for (int lane = 0; lane < kThreads; ++lane) st = rlk::softmax_merge(st, thread_state<T, kThreads, true>(z, V, inv_tau, lane));
  const rlk::RowResult<float> r = rlk::softmax_finalize(st, mul_rn(zf[target], inv_tau));
  State st0 = rlk::softmax_init<float>();
  for (int lane = 0; lane < kThreads; ++lane) st0 = rlk::softmax_merge(st0, thread_state<T, kThreads, false>(z, V, inv_tau, lane));
  const rlk::RowResult<float> r0 = rlk::softmax_finalize(st0, mul_rn(zf[target], inv_tau));

  double m = -INFINITY;
  for (long v = 0; v < V; ++v) m = std::fmax(m, double(zf[v]) / tau);
  double s = 0, sx = 0;
  for (long v = 0; v < V; ++v) {
    const double e = std::exp(double(zf[v]) / tau - m);
    s += e;
    if (e > 0) sx += e * (double(zf[v]) / tau - m);
  }
  const double lse = m + std::log(s), H = std::log(s) - sx / s, logp = double(zf[target]) / tau - lse;
  const char* dt = name<T>();
  auto close = [](double got, double want) { return std::fabs(got - want) <= 1e-5 * std::fmax(1.0, std::fabs(want)); };
  if (!close(r.lse, lse)) fail("lse", dt, kThreads, V, offset, -1, r.lse, lse);
  if (!close(r.logp, logp) || r.logp > 0) fail("logp", dt, kThreads, V, offset, -1, r.logp, logp);
  if (!close(r.entropy, H) || r.entropy < 0) fail("entropy", dt, kThreads, V, offset, -1, r.entropy, H);
  if (r0.lse != r.lse || r0.logp != r.logp) fail("logp without entropy", dt, kThreads, V, offset, -1, r0.logp, r.logp);
  if (pattern == 2 && (r.logp != 0 || r.entropy != 0)) fail("single-entry row", dt, kThreads, V, offset, -1, r.logp, 0);

  // Backward from the kernel's own lse and H, into: another buffer aligned like z (packs), one
  // aligned differently (element by element), and z itself.
  const float g = 0.8f, h = -0.6f;
  const GradOf grad{r.lse, inv_tau, rlk::grad_coeffs<float>(g, h, r.entropy, inv_tau), target};
  const T sentinel = Pack<T>::from_float(12345.0f);
  for (int mode = 0; mode < 3; ++mode) {
    Buffer<T> out_buf(V, mode == 1 ? offset + 1 : offset);
    T* out = mode == 2 ? z : out_buf.row;
    if (mode != 2) {
      for (long v = -1; v < V + 9; ++v) out[v] = sentinel;
    }
    const bool vec = mode != 1;
    for (int lane = 0; lane < kThreads; ++lane) {
      if (vec) {
        grad_row<T, kThreads, true>(z, out, V, grad, lane);
      } else {
        grad_row<T, kThreads, false>(z, out, V, grad, lane);
      }
    }
    static const char* what[] = {"grad (packs)", "grad (element by element)", "grad (in place)"};
    for (long v = 0; v < V; ++v) {
      const double x = double(zf[v]) / tau, lp = x - double(r.lse), p = std::exp(lp);
      const double plogp = p > 0 ? p * (lp + double(r.entropy)) : 0.0;
      const double want = (g * ((v == target) - p) - h * plogp) / tau;
      const double scale = (std::fabs(g) * ((v == target) + p) + std::fabs(h) * (p > 0 ? p * (std::fabs(lp) + r.entropy) : 0)) / tau;
      const double got = Pack<T>::to_float(out[v]);
      if (!(std::fabs(got - want) <= 1e-5 * scale + ulp<T>() * std::fabs(want) + tiny<T>())) {
        fail(what[mode], dt, kThreads, V, offset, v, got, want);
      }
    }
    if (mode != 2) {
      for (long v : {-1L, V, V + 8}) {
        if (Pack<T>::to_float(out[v]) != 12345.0f && std::memcmp(&out[v], &sentinel, sizeof(T)) != 0) {
          fail("write outside the row", dt, kThreads, V, offset, v, Pack<T>::to_float(out[v]), 12345.0);
        }
      }
    }
  }
}

template <typename T, int kThreads>
void sweep(std::mt19937& rng) {
  // V: smaller than a pack; one pack ± 1; a few steps with a partial last one; steps that fill
  // every lane exactly (16 · kThreads); odd sizes past that.
  const long vs[] = {1, 3, 7, 8, 9, 33, 100, 1000, 16L * kThreads, 16L * kThreads + 5, 4099, 20011};
  for (long V : vs) {
    for (int offset : {0, 1, 3}) {
      for (int pattern : {0, 1, 2}) check<T, kThreads>(V, offset, rng, pattern);
    }
  }
}

template <typename T>
void nan_rows() {
  // A NaN among finite values, a NaN among −inf only, and +inf: the row's results are NaN.
  for (int which = 0; which < 3; ++which) {
    Buffer<T> buf(300, 1);
    for (long v = 0; v < 300; ++v) buf.row[v] = Pack<T>::from_float(which == 1 ? -INFINITY : float(v % 7));
    buf.row[123] = Pack<T>::from_float(which == 2 ? INFINITY : NAN);
    State st = rlk::softmax_init<float>();
    for (int lane = 0; lane < 32; ++lane) st = rlk::softmax_merge(st, thread_state<T, 32, true>(buf.row, 300, 1.0f, lane));
    const rlk::RowResult<float> r = rlk::softmax_finalize(st, 0.0f);
    if (!std::isnan(r.lse) || !std::isnan(r.logp)) fail("NaN row", name<T>(), 32, 300, 1, which, r.lse, NAN);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  sweep<float, 32>(rng);
  sweep<float, 256>(rng);
  sweep<float, 512>(rng);
  sweep<__nv_bfloat16, 32>(rng);
  sweep<__nv_bfloat16, 256>(rng);
  sweep<__nv_bfloat16, 512>(rng);
  sweep<__half, 32>(rng);
  sweep<__half, 256>(rng);
  sweep<__half, 512>(rng);
  nan_rows<float>();
  nan_rows<__nv_bfloat16>();
  nan_rows<__half>();
  if (failures) {
    std::printf("test_row_pass: %d failures\n", failures);
    return 1;
  }
  std::printf("test_row_pass: ok\n");
  return 0;
}
