// Checks of the `out` buffer of token_logprobs_bwd_out, shared by the CPU and CUDA bindings.
// C++ with torch (never included by .cu files, which stay torch-free).
#pragma once

#include <ATen/core/Tensor.h>

#include "rlkernels/checks.h"

namespace rlk {

// `out` is either `logits` itself or memory disjoint from it: a partial overlap would let one
// row's writes land on logits another row has yet to read. (The caller checks the device.)
inline void check_grad_out(const at::Tensor& logits, const at::Tensor& out) {
  RLK_CHECK_TYPE(out.scalar_type() == logits.scalar_type(), "out: expected dtype ", logits.scalar_type(),
                 " (that of logits), got ", out.scalar_type());
  RLK_CHECK_VALUE(out.sizes() == logits.sizes(), "out: expected shape ", logits.sizes(), " (that of logits), got ",
                  out.sizes());
  RLK_CHECK_VALUE(out.size(1) <= 1 || out.stride(1) == 1, "out: expected unit stride over V, got strides ",
                  out.strides());
  RLK_CHECK_VALUE(out.size(0) <= 1 || out.stride(0) >= out.size(1),
                  "out: expected rows that do not overlap, got strides ", out.strides());
  const bool same = out.data_ptr() == logits.data_ptr() && (out.size(0) <= 1 || out.stride(0) == logits.stride(0));
  if (!same && out.numel() > 0) {
    const char* o_begin = static_cast<const char*>(out.data_ptr());
    const char* o_end = o_begin + ((out.size(0) - 1) * out.stride(0) + out.size(1)) * out.element_size();
    const char* z_begin = static_cast<const char*>(logits.data_ptr());
    const char* z_end = z_begin + logits.nbytes();
    RLK_CHECK_VALUE(o_end <= z_begin || z_end <= o_begin,
                    "out: expected either the logits themselves or memory disjoint from them");
  }
}

}  // namespace rlk
