// Where the rows of a logits tensor lie, for every compiled backend: the kernels take logits (N, V) or
// (B, T, V) with unit stride over V, a (B, T, V) view such as `logits[:, :-1]` of a (B, T + 1, V) parent
// read where it lies in one launch. No torch includes.
#pragma once

#include <cstdint>

#include "rlkernels/row_math.h"  // RLK_HOST_DEVICE

namespace rlk {

// Row n (of N = B·T, in the order b·T + t) starts (n / T)·batch_stride + (n % T)·row_stride elements past
// the first. A 2-D (N, V) tensor is B = 1, T = N (its batch stride is never used).
struct RowIndex {
  int64_t seq_len;  // T ≥ 1
  int64_t batch_stride;
  int64_t row_stride;
  RLK_HOST_DEVICE int64_t operator()(int64_t n) const {
    return (n / seq_len) * batch_stride + (n % seq_len) * row_stride;
  }
};

}  // namespace rlk
