// Checks of the arguments the rlkernels_C ops share, for the CPU and CUDA bindings alike: the
// targets, the temperature and the per-row vectors of the backward (the `out` buffer's are in
// grad_out_check.h, the token loss's in token_loss_args.h). C++ with torch (never included by .cu
// files). The values of device tensors are not read here: that would synchronise.
#pragma once

#include <ATen/core/Tensor.h>
#include <cmath>
#include <cstdint>

#include "rlkernels/checks.h"

namespace rlk {

// targets (N,) int64 (int32 accepted) on the logits' device; returns an int64 contiguous copy or view.
inline at::Tensor check_targets_shape(const at::Tensor& targets, const at::Tensor& logits) {
  const int64_t N = logits.size(0);
  RLK_CHECK_VALUE(targets.device() == logits.device(), "targets: expected a tensor on ", logits.device(),
                  " (that of logits), got ", targets.device());
  RLK_CHECK_TYPE(targets.scalar_type() == at::kLong || targets.scalar_type() == at::kInt,
                 "targets: expected dtype int64, got ", targets.scalar_type());
  RLK_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == N, "targets: expected shape (", N,
                  ",) matching logits (N, V), got ", targets.sizes());
  return targets.to(at::kLong).contiguous();
}

inline double check_temperature(double temperature) {
  RLK_CHECK_VALUE(temperature > 0 && std::isfinite(temperature), "temperature: expected a finite value > 0, got ",
                  temperature);
  return temperature;
}

inline double check_softcap(double softcap) {
  RLK_CHECK_VALUE(softcap >= 0 && std::isfinite(softcap), "softcap: expected a finite value >= 0 (0: no cap), got ",
                  softcap);
  return softcap;
}

// A per-row input of the backward, (N,) or with `pair` (N, 2), on the logits' device: converted to
// the accumulation dtype `acc`, contiguous.
inline at::Tensor check_row_vector(const at::Tensor& t, const char* name, const at::Tensor& logits, at::ScalarType acc,
                                   bool pair = false) {
  const int64_t N = logits.size(0);
  RLK_CHECK_VALUE(t.device() == logits.device(), name, ": expected a tensor on ", logits.device(),
                  " (that of logits), got ", t.device());
  RLK_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name, ": expected a floating dtype, got ", t.scalar_type());
  const bool shape_ok = pair ? t.dim() == 2 && t.size(0) == N && t.size(1) == 2 : t.dim() == 1 && t.size(0) == N;
  RLK_CHECK_VALUE(shape_ok, name, ": expected shape (", N, pair ? ", 2)" : ",)", " matching logits (N, V), got ",
                  t.sizes());
  return t.to(acc).contiguous();
}

}  // namespace rlk
