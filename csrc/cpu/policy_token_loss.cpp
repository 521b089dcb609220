// CPU implementation of `policy_token_loss` (the contract is in rlkernels/kernels/__init__.py):
// the per-token policy loss of rlkernels/token_loss.h at given log-probs, without logits. The
// sequence-level losses evaluate their row-level (or token-level) surrogate with it once the
// forward pass has given every log-prob: one launch where the same math in PyTorch with its
// autograd takes ~30.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "rlkernels/checks.h"
#include "rlkernels/dispatch.h"
#include "rlkernels/token_loss.h"
#include "rlkernels/token_loss_args.h"

namespace rlk_cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_token_loss_cpu(
    const at::Tensor& logp, const std::optional<at::Tensor>& entropy, const at::Tensor& mask,
    const at::Tensor& weight, const std::optional<at::Tensor>& adv, const std::optional<at::Tensor>& old_logp,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& chosen,
    const std::optional<at::Tensor>& is_weights, at::ArrayRef<double> params) {
  RLK_CHECK_VALUE(logp.device().is_cpu(), "logp: expected a CPU tensor, got ", logp.device());
  RLK_CHECK_TYPE(logp.scalar_type() == at::kFloat || logp.scalar_type() == at::kDouble,
                 "logp: expected dtype float32 or float64, got ", logp.scalar_type());
  RLK_CHECK_VALUE(logp.dim() == 1 && logp.is_contiguous(), "logp: expected a contiguous tensor of shape (N,), got ",
                  logp.sizes());
  const at::ScalarType acc = logp.scalar_type();
  if (entropy.has_value()) rlk::check_token_tensor(*entropy, "entropy", logp, "logp (N,)", acc);
  rlk::check_token_inputs(logp, "logp (N,)", mask, weight, adv, old_logp, ref_logp, acc);
  if (chosen.has_value()) rlk::check_token_tensor(*chosen, "chosen", logp, "logp (N,)", acc);
  if (is_weights.has_value()) rlk::check_token_tensor(*is_weights, "is_weights", logp, "logp (N,)", acc);
  const int64_t N = logp.size(0);
  const auto opts = logp.options();
  at::Tensor grad_logp = at::empty({N}, opts), grad_entropy = at::empty({N}, opts);
  at::Tensor stats = at::empty({N, int64_t(rlk::kNumStats)}, opts);
  rlk::dispatch_floating<false>(acc, "logp", [&](auto zero) {
    using scalar_t = decltype(zero);
    // Checked before the N == 0 return, so that bad scalars fail on every batch.
    const rlk::TokenLossParams<scalar_t> loss = rlk::token_loss_params<scalar_t>(params);
    if (N == 0) return;
    const rlk::TokenArrays<scalar_t> in{mask.const_data_ptr<bool>(), weight.const_data_ptr<scalar_t>(),
                                        rlk::optional_ptr<scalar_t>(adv), rlk::optional_ptr<scalar_t>(old_logp),
                                        rlk::optional_ptr<scalar_t>(ref_logp), rlk::optional_ptr<scalar_t>(chosen),
                                        rlk::optional_ptr<scalar_t>(is_weights)};
    const scalar_t *l_p = logp.const_data_ptr<scalar_t>(), *h_p = rlk::optional_ptr<scalar_t>(entropy);
    scalar_t* gl_p = grad_logp.mutable_data_ptr<scalar_t>();
    scalar_t* ge_p = grad_entropy.mutable_data_ptr<scalar_t>();
    scalar_t* st_p = stats.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t h = h_p != nullptr ? h_p[n] : scalar_t(0);  // absent: H = 0
        rlk::token_loss(in.at(n, l_p[n], h), loss).store(n, gl_p, ge_p, st_p);
      }
    });
  });
  return {grad_logp, grad_entropy, stats};
}

}  // namespace
}  // namespace rlk_cpu

TORCH_LIBRARY_IMPL(rlkernels_C, CPU, m) { m.impl("policy_token_loss", &rlk_cpu::policy_token_loss_cpu); }
