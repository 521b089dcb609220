// CPU implementation of `covariance_choice` (the contract is in rlkernels/kernels/__init__.py): Clip-Cov's
// and KL-Cov's tokens, the k eligible tokens of smallest key of rlkernels/covariance_choice.h. One op where
// the same choice in PyTorch takes ~30 (means, covariance, a sort for the ranks).
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "rlkernels/checks.h"
#include "rlkernels/covariance_choice.h"
#include "rlkernels/dispatch.h"
#include "rlkernels/token_loss_args.h"

namespace rlk_cpu {
namespace {

at::Tensor covariance_choice_cpu(const at::Tensor& logp, const at::Tensor& adv, const std::optional<at::Tensor>& old_logp,
                                 const at::Tensor& mask, const std::optional<at::Tensor>& draws, int64_t objective,
                                 double fraction, double cov_lb, double cov_ub, double clip_low, double clip_high,
                                 double log_ratio_clamp, double scale) {
  RLK_CHECK_VALUE(logp.device().is_cpu(), "logp: expected a CPU tensor, got ", logp.device());
  RLK_CHECK_TYPE(logp.scalar_type() == at::kFloat || logp.scalar_type() == at::kDouble,
                 "logp: expected dtype float32 or float64, got ", logp.scalar_type());
  RLK_CHECK_VALUE(logp.dim() == 1 && logp.is_contiguous(), "logp: expected a contiguous tensor of shape (N,), got ",
                  logp.sizes());
  const int64_t N = logp.size(0);
  at::Tensor out = at::zeros({N}, logp.options());
  rlk::dispatch_floating<false>(logp.scalar_type(), "logp", [&](auto zero) {
    using scalar_t = decltype(zero);
    using Key = typename rlk::OrderedBits<scalar_t>::type;
    const auto p = rlk::covariance_choice_params<scalar_t>(logp, adv, old_logp, mask, draws, objective,
                                                           fraction, cov_lb, cov_ub, clip_low, clip_high,
                                                           log_ratio_clamp, scale);
    const scalar_t *l = logp.const_data_ptr<scalar_t>(), *a = adv.const_data_ptr<scalar_t>();
    const scalar_t* old = rlk::optional_ptr<scalar_t>(old_logp);
    const float* u = rlk::optional_ptr<float>(draws);
    const bool* m = mask.const_data_ptr<bool>();
    // The means over the masked tokens, summed in double and rounded to the accumulation dtype (the spec's).
    double sum_adv = 0, sum_logp = 0;
    int64_t count = 0;
    for (int64_t n = 0; n < N; ++n) {
      if (!m[n]) continue;
      sum_adv += a[n];
      sum_logp += l[n];
      ++count;
    }
    const double divisor = double(std::max<int64_t>(count, 1));
    const scalar_t mean_adv = scalar_t(sum_adv / divisor), mean_logp = scalar_t(sum_logp / divisor);
    std::vector<std::pair<Key, int64_t>> eligible;  // (key, position): ties go to the first position
    for (int64_t n = 0; n < N; ++n) {
      if (!m[n]) continue;
      const auto c = rlk::candidate(p, a[n], l[n], old != nullptr, old != nullptr ? old[n] : scalar_t(0),
                                    u != nullptr ? u[n] : 0.0f, mean_adv, mean_logp);
      if (c.eligible) eligible.emplace_back(c.key, n);
    }
    const int64_t k = std::min<int64_t>(rlk::choice_size(count, fraction), int64_t(eligible.size()));
    if (k < int64_t(eligible.size())) std::nth_element(eligible.begin(), eligible.begin() + k, eligible.end());
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for (int64_t j = 0; j < k; ++j) o[eligible[j].second] = p.scale;
  });
  return out;
}

}  // namespace
}  // namespace rlk_cpu

TORCH_LIBRARY_IMPL(rlkernels_C, CPU, m) { m.impl("covariance_choice", &rlk_cpu::covariance_choice_cpu); }
