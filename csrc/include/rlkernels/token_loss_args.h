// Checks of the arguments of policy_token_fwd, policy_token_loss and covariance_choice, shared by the CPU and CUDA
// bindings, and the ops' scalars turned into rlk::TokenLossParams and rlk::CovarianceChoiceParams. C++ with torch
// (never included by .cu files).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "rlkernels/checks.h"
#include "rlkernels/covariance_choice.h"
#include "rlkernels/op_args.h"
#include "rlkernels/token_loss.h"

namespace rlk {

// A per-token input (N,): on the device of `rows` (the logits (N, V) or (B, T, V), or the log-probs (N,), named
// `rows_name`), of exactly `dtype`, contiguous. Never converted: a copy per call would hide a
// caller that keeps these in the wrong dtype.
inline void check_token_tensor(const at::Tensor& t, const char* name, const at::Tensor& rows, const char* rows_name,
                               at::ScalarType dtype) {
  RLK_CHECK_VALUE(t.device() == rows.device(), name, ": expected a tensor on ", rows.device(), " (that of ", rows_name,
                  "), got ", t.device());
  RLK_CHECK_TYPE(t.scalar_type() == dtype, name, ": expected dtype ", dtype, " for ", rows.scalar_type(), " ",
                 rows_name, ", got ", t.scalar_type());
  RLK_CHECK_VALUE(t.dim() == 1 && t.size(0) == row_count(rows), name, ": expected shape (", row_count(rows), ",) matching ",
                  rows_name, ", got ", t.sizes());
  RLK_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// mask (bool) and weight, adv, old_logp, ref_logp (the accumulation dtype `acc`); absent optionals
// are not checked.
inline void check_token_inputs(const at::Tensor& rows, const char* rows_name, const at::Tensor& mask,
                               const at::Tensor& weight, const std::optional<at::Tensor>& adv,
                               const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
                               at::ScalarType acc) {
  check_token_tensor(mask, "mask", rows, rows_name, at::kBool);
  check_token_tensor(weight, "weight", rows, rows_name, acc);
  if (adv.has_value()) check_token_tensor(*adv, "adv", rows, rows_name, acc);
  if (old_logp.has_value()) check_token_tensor(*old_logp, "old_logp", rows, rows_name, acc);
  if (ref_logp.has_value()) check_token_tensor(*ref_logp, "ref_logp", rows, rows_name, acc);
}

// The two-pass op's own arguments (policy_token_fwd_grad): `entropy_grad` (N,) in the accumulation dtype `acc` where
// given, and `scale`, the incoming gradient it assumes, finite and nonzero.
inline void check_two_pass_args(const at::Tensor& logits, const std::optional<at::Tensor>& entropy_grad, double scale,
                                at::ScalarType acc) {
  if (entropy_grad.has_value()) check_token_tensor(*entropy_grad, "entropy_grad", logits, "the rows of logits", acc);
  RLK_CHECK_VALUE(std::isfinite(scale) && scale != 0.0, "scale: expected a finite nonzero number, got ", scale);
}

// The data of an optional per-token input, or null when it is absent.
template <typename T>
inline const T* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

// `value` ≥ low (> low when strict); +inf is allowed only where it means "no bound".
inline double check_scalar(const char* name, double value, double low, bool strict, bool inf_ok) {
  RLK_CHECK_VALUE(!std::isnan(value), name, ": expected a number, got nan");
  RLK_CHECK_VALUE(inf_ok || std::isfinite(value), name, ": expected a finite number, got ", value);
  RLK_CHECK_VALUE(strict ? value > low : value >= low, name, ": expected a value ", strict ? ">" : ">=", " ", low,
                  ", got ", value);
  return value;
}

// `value` as the packed parameter at offset `at` (a TokenLossParam), checked against the range the table gives it
// (rlkernels/token_loss_table.h, generated from the table rlkernels/_token_loss_table.py).
inline double check_token_loss_param(int at, double value) {
  const TokenLossParamRange& range = kTokenLossParamRanges[at];
  if (range.count == 0) return check_scalar(range.name, value, range.low, range.strict, range.inf_ok);
  RLK_CHECK_VALUE(value >= 0 && value < range.count && value == std::floor(value), range.name,  // an id or a bool
                  ": expected an integer in [0, ", range.count, ") (", range.what,
                  " in rlkernels/_token_loss_table.py), got ", value);
  return value;
}

// `params` packed as PARAMS of rlkernels/_token_loss_table.py lays them out, each in its range.
template <typename T>
TokenLossParams<T> token_loss_params(c10::ArrayRef<double> params) {
  RLK_CHECK_VALUE(params.size() == kNumTokenLossParams, "params: expected ", int(kNumTokenLossParams),
                  " values (PARAMS of rlkernels/_token_loss_table.py), got ", params.size());
  for (int at = 0; at < kNumTokenLossParams; ++at) check_token_loss_param(at, params[at]);
  return unpack_token_loss_params<T>(params.data());
}

// covariance_choice's inputs besides `logp` (N,) (checked by the backend: device, dtype T) and its scalars. At most
// 2^31 − 1 tokens: the GPU kernels count them in 32 bits.
template <typename T>
CovarianceChoiceParams<T> covariance_choice_params(const at::Tensor& logp, const at::Tensor& adv,
                                                   const std::optional<at::Tensor>& old_logp, const at::Tensor& mask,
                                                   const std::optional<at::Tensor>& draws, int64_t objective,
                                                   double fraction, double cov_lb, double cov_ub, double clip_low,
                                                   double clip_high, double log_ratio_clamp, double scale) {
  const at::ScalarType acc = logp.scalar_type();
  RLK_CHECK_VALUE(logp.size(0) <= INT32_MAX, "logp: expected at most 2^31 - 1 tokens, got ", logp.size(0));
  check_token_tensor(adv, "adv", logp, "logp (N,)", acc);
  check_token_tensor(mask, "mask", logp, "logp (N,)", at::kBool);
  if (old_logp.has_value()) check_token_tensor(*old_logp, "old_logp", logp, "logp (N,)", acc);
  RLK_CHECK_VALUE(objective == kChooseClipCov || objective == kChooseKlCov,
                  "objective: expected 0 (clip_cov) or 1 (kl_cov), got ", objective);
  RLK_CHECK_VALUE(draws.has_value() == (objective == kChooseClipCov),
                  "draws: expected uniform draws for clip_cov and none for kl_cov");
  if (draws.has_value()) check_token_tensor(*draws, "draws", logp, "logp (N,)", at::kFloat);
  RLK_CHECK_VALUE(fraction > 0 && fraction <= 1, "fraction: expected a value in (0, 1], got ", fraction);
  RLK_CHECK_VALUE(!std::isnan(cov_lb) && !std::isnan(cov_ub), "cov_lb, cov_ub: expected numbers, got ", cov_lb, ", ",
                  cov_ub);
  RLK_CHECK_VALUE(std::isfinite(scale), "scale: expected a finite number, got ", scale);
  return CovarianceChoiceParams<T>{int(objective),
                                   fraction,
                                   T(cov_lb),
                                   T(cov_ub),
                                   T(check_token_loss_param(kParamClipLow, clip_low)),
                                   T(check_token_loss_param(kParamClipHigh, clip_high)),
                                   T(check_token_loss_param(kParamLogRatioClamp, log_ratio_clamp)),
                                   T(scale)};
}

}  // namespace rlk
