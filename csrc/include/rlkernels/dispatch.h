// The CPU ops' dispatch on a floating dtype. AT_DISPATCH_* throws c10::NotImplementedError from this library
// for a dtype it does not list (see rlkernels/checks.h for why nothing is thrown here); this refuses it with a
// TypeError through TORCH_CHECK. The ops check the dtype before, so that is a backstop.
#pragma once

#include <c10/core/ScalarType.h>

#include "rlkernels/checks.h"

namespace rlk {

// f(T()) for T the C++ type of `dtype`: float or double, and with kReduced c10::BFloat16 or c10::Half too.
template <bool kReduced, typename F>
void dispatch_floating(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float());
    case at::kDouble: return f(double());
    case at::kBFloat16:
      if constexpr (kReduced) return f(c10::BFloat16());
      break;
    case at::kHalf:
      if constexpr (kReduced) return f(c10::Half());
      break;
    default: break;
  }
  const char* expected = kReduced ? "float32, float64, bfloat16 or float16" : "float32 or float64";
  RLK_CHECK_TYPE(false, name, ": expected dtype ", expected, ", got ", dtype);
}

}  // namespace rlk
