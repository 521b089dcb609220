// Checks of the arguments the rlkernels_C ops share, for the CPU and CUDA bindings alike: the
// targets, the temperature and the per-row vectors of the backward (the `out` buffer's are in
// grad_out_check.h, the token loss's in token_loss_args.h). C++ with torch (never included by .cu
// files). The values of device tensors are not read here: that would synchronise.
#pragma once

#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "rlkernels/checks.h"
#include "rlkernels/row_index.h"

namespace rlk {

// logits (N, V) or (B, T, V) with unit stride over V; their rows may lie anywhere (a view such as
// logits[:, :-1] is read where it lies).
inline void check_logits_layout(const at::Tensor& logits) {
  RLK_CHECK_VALUE(logits.dim() == 2 || logits.dim() == 3, "logits: expected shape (N, V) or (B, T, V), got ",
                  logits.sizes());
  RLK_CHECK_VALUE(logits.size(-1) <= 1 || logits.stride(-1) == 1, "logits: expected unit stride over V, got strides ",
                  logits.strides());
}

// The rows of logits (N, V) or (B, T, V), N = B·T; of per-token values (N,), N.
inline int64_t row_count(const at::Tensor& t) { return t.dim() == 3 ? t.size(0) * t.size(1) : t.size(0); }

// Where the rows of logits (N, V) or (B, T, V) lie (rlkernels/row_index.h).
inline RowIndex row_index(const at::Tensor& t) {
  if (t.dim() == 3) return RowIndex{std::max<int64_t>(t.size(1), 1), t.stride(0), t.stride(1)};
  return RowIndex{std::max<int64_t>(t.size(0), 1), 0, t.stride(0)};
}

// targets (N,) int64 (int32 accepted) on the logits' device; returns an int64 contiguous copy or view.
inline at::Tensor check_targets_shape(const at::Tensor& targets, const at::Tensor& logits) {
  const int64_t N = row_count(logits);
  RLK_CHECK_VALUE(targets.device() == logits.device(), "targets: expected a tensor on ", logits.device(),
                  " (that of logits), got ", targets.device());
  RLK_CHECK_TYPE(targets.scalar_type() == at::kLong || targets.scalar_type() == at::kInt,
                 "targets: expected dtype int64, got ", targets.scalar_type());
  RLK_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == N, "targets: expected shape (", N,
                  ",) matching the rows of logits, got ", targets.sizes());
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

// scale_grad_'s arguments but their device and grad's dtype (each backend's): grad contiguous, grad_out one float32
// or float64 number, `assumed` finite and nonzero.
inline void check_scale_grad_args(const at::Tensor& grad, const at::Tensor& grad_out, double assumed) {
  RLK_CHECK_VALUE(grad.is_contiguous(), "grad: expected a contiguous tensor, got strides ", grad.strides());
  RLK_CHECK_VALUE(grad_out.numel() == 1 && (grad_out.scalar_type() == at::kFloat || grad_out.scalar_type() == at::kDouble),
                  "grad_out: expected one float32 or float64 number, got ", grad_out.sizes(), " ",
                  grad_out.scalar_type());
  RLK_CHECK_VALUE(std::isfinite(assumed) && assumed != 0.0, "assumed: expected a finite nonzero number, got ", assumed);
}

// A per-row input of the backward, (N,) or with `pair` (N, 2), on the logits' device: converted to
// the accumulation dtype `acc`, contiguous.
inline at::Tensor check_row_vector(const at::Tensor& t, const char* name, const at::Tensor& logits, at::ScalarType acc,
                                   bool pair = false) {
  const int64_t N = row_count(logits);
  RLK_CHECK_VALUE(t.device() == logits.device(), name, ": expected a tensor on ", logits.device(),
                  " (that of logits), got ", t.device());
  RLK_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name, ": expected a floating dtype, got ", t.scalar_type());
  const bool shape_ok = pair ? t.dim() == 2 && t.size(0) == N && t.size(1) == 2 : t.dim() == 1 && t.size(0) == N;
  RLK_CHECK_VALUE(shape_ok, name, ": expected shape (", N, pair ? ", 2)" : ",)", " matching the rows of logits, got ",
                  t.sizes());
  return t.to(acc).contiguous();
}

}  // namespace rlk
