// What the host tests of the CUDA row code (test_row_pass.cu, test_cluster_row.cu) share: each dtype's name, its
// rounding allowance, and a row placed at a chosen offset from a 16-byte boundary.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace host_rows {

template <typename T> const char* name();
template <> inline const char* name<float>() { return "float32"; }
template <> inline const char* name<__nv_bfloat16>() { return "bfloat16"; }
template <> inline const char* name<__half>() { return "float16"; }

// Relative rounding of T (half an ulp is not enough: the kernel's fp32 result may round either way
// when it lies within its own error of a rounding boundary), and T's smallest subnormal.
template <typename T> double ulp();
template <> inline double ulp<float>() { return 0; }
template <> inline double ulp<__nv_bfloat16>() { return std::ldexp(1.0, -8); }
template <> inline double ulp<__half>() { return std::ldexp(1.0, -11); }
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

}  // namespace host_rows
