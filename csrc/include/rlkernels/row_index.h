// Where the rows of a logits tensor lie, for every compiled backend: the kernels take logits (N, V) or
// (B, T, V) with unit stride over V, a (B, T, V) view such as `logits[:, :-1]` of a (B, T + 1, V) parent
// read where it lies in one launch. No torch includes.
#pragma once

#include <cstdint>

#include "rlkernels/row_math.h"  // RLK_HOST_DEVICE

namespace rlk {

// Row n = b·T + t (of N = B·T) starts b·batch_stride + t·row_stride elements past the first. A 2-D (N, V)
// tensor is B = 1, T = N (its batch stride is never used). The CUDA kernels take (b, t) from their grid (a
// 64-bit division would be a call and a stack frame there); the CPU divides.
struct RowIndex {
  int64_t seq_len;  // T ≥ 1
  int64_t batch_stride;
  int64_t row_stride;
  RLK_HOST_DEVICE int64_t offset(int64_t b, int64_t t) const { return b * batch_stride + t * row_stride; }
  RLK_HOST_DEVICE int64_t operator()(int64_t n) const { return offset(n / seq_len, n % seq_len); }
};

}  // namespace rlk
