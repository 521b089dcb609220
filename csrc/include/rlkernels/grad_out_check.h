// Checks of the `out` buffer of token_logprobs_bwd_out, shared by the CPU and CUDA bindings.
// C++ with torch (never included by .cu files, which stay torch-free).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

#include "rlkernels/checks.h"

namespace rlk {

// Elements from the first of `t` past its last, along its strides (0 when empty).
inline int64_t span_elems(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last + 1;
}

// Whether the rows of `out` (N, V) or (B, T, V), unit stride over V, lie apart: along the smaller of its row
// strides at least V apart, along the larger past the whole run of the smaller.
inline bool rows_apart(const at::Tensor& out) {
  const int64_t V = out.size(-1);
  int64_t n1 = out.size(-2), s1 = out.stride(-2), n2 = 1, s2 = 0;
  if (out.dim() == 3) {
    n2 = out.size(0);
    s2 = out.stride(0);
    if (n2 > 1 && (n1 <= 1 || s2 < s1)) {
      std::swap(n1, n2);
      std::swap(s1, s2);
    }
  }
  return (n1 <= 1 || s1 >= V) && (n2 <= 1 || s2 >= (n1 - 1) * s1 + V);
}

// `out` is either `logits` itself or memory disjoint from it: a partial overlap would let one
// row's writes land on logits another row has yet to read. (The caller checks the device.)
inline void check_grad_out(const at::Tensor& logits, const at::Tensor& out) {
  RLK_CHECK_TYPE(out.scalar_type() == logits.scalar_type(), "out: expected dtype ", logits.scalar_type(),
                 " (that of logits), got ", out.scalar_type());
  RLK_CHECK_VALUE(out.sizes() == logits.sizes(), "out: expected shape ", logits.sizes(), " (that of logits), got ",
                  out.sizes());
  RLK_CHECK_VALUE(out.size(-1) <= 1 || out.stride(-1) == 1, "out: expected unit stride over V, got strides ",
                  out.strides());
  RLK_CHECK_VALUE(rows_apart(out), "out: expected rows that do not overlap, got strides ", out.strides());
  bool same = out.data_ptr() == logits.data_ptr();
  for (int64_t d = 0; d < out.dim(); ++d) same = same && (out.size(d) <= 1 || out.stride(d) == logits.stride(d));
  if (!same && out.numel() > 0) {
    const char* o_begin = static_cast<const char*>(out.data_ptr());
    const char* o_end = o_begin + span_elems(out) * out.element_size();
    const char* z_begin = static_cast<const char*>(logits.data_ptr());
    const char* z_end = z_begin + span_elems(logits) * logits.element_size();
    RLK_CHECK_VALUE(o_end <= z_begin || z_end <= o_begin,
                    "out: expected either the logits themselves or memory disjoint from them");
  }
}

}  // namespace rlk
