// CUDA implementations of the rlkernels_C ops (schemas: csrc/cpu/*.cpp): input checks,
// allocation, the current stream, then the torch-free launchers of launchers.h. Compiled only
// in the CUDA build (setup.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "rlkernels/checks.h"
#include "rlkernels/grad_out_check.h"
#include "rlkernels/op_args.h"
#include "rlkernels/token_loss_args.h"

#include <cmath>
#include <optional>
#include <tuple>

#include "launchers.h"

namespace rlk_cuda {
namespace {

Dtype dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return Dtype::kFloat32;
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kHalf: return Dtype::kFloat16;
    default:
      RLK_CHECK_TYPE(false, name, ": expected dtype float32, bfloat16 or float16 on CUDA, got ", t.scalar_type());
  }
}

// logits or out (N, V) or (B, T, V), unit stride over V (rlk::check_logits_layout), as the launchers take them.
Rows rows_of(const at::Tensor& t, const char* name) {
  return Rows{const_cast<void*>(t.const_data_ptr()), rlk::row_count(t), t.size(-1), rlk::row_index(t),
              dtype_of(t, name)};
}

void check_logits(const at::Tensor& logits) {
  RLK_CHECK_VALUE(logits.is_cuda(), "logits: expected a CUDA tensor, got ", logits.device());
  rlk::check_logits_layout(logits);
  dtype_of(logits, "logits");
  RLK_CHECK_VALUE(rlk::row_count(logits) == 0 || logits.size(-1) > 0, "logits: expected V > 0, got shape ",
                  logits.sizes());
  RLK_CHECK_VALUE(logits.size(-1) < (int64_t(1) << 31), "logits: expected V < 2^31, got shape ", logits.sizes());
}

Head head_of(double temperature, double softcap) {
  // 1/τ rounded as on the CPU
  return Head{static_cast<float>(1.0 / rlk::check_temperature(temperature)),
              rlk::soft_cap<float>(rlk::check_softcap(softcap))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd_cuda(const at::Tensor& logits,
                                                                     const at::Tensor& targets, double temperature,
                                                                     double softcap, bool need_entropy) {
  check_logits(logits);
  const at::Tensor tgt = rlk::check_targets_shape(targets, logits);  // values: not read (see ops/)
  const Head head = head_of(temperature, softcap);
  const int64_t N = rlk::row_count(logits);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, opts), lse_parts = at::empty({N, 2}, opts);
  at::Tensor entropy = at::empty({need_entropy ? N : 0}, opts);
  if (N == 0) return {logp, entropy, lse_parts};
  const c10::cuda::CUDAGuard guard(logits.device());
  C10_CUDA_CHECK(token_logprobs_fwd(rows_of(logits, "logits"), tgt.const_data_ptr<int64_t>(), head,
                                    logp.mutable_data_ptr<float>(),
                                    need_entropy ? entropy.mutable_data_ptr<float>() : nullptr,
                                    lse_parts.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return {logp, entropy, lse_parts};
}

void bwd_into(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_parts,
              const at::Tensor& entropy, const at::Tensor& grad_logp, const std::optional<at::Tensor>& grad_entropy,
              double temperature, double softcap, const at::Tensor& out) {
  const at::Tensor tgt = rlk::check_targets_shape(targets, logits);  // values: not read (see ops/)
  const Head head = head_of(temperature, softcap);
  const at::Tensor lse_c = rlk::check_row_vector(lse_parts, "lse_parts", logits, at::kFloat, /*pair=*/true);
  const at::Tensor g_c = rlk::check_row_vector(grad_logp, "grad_logp", logits, at::kFloat);
  const bool has_h = grad_entropy.has_value() && grad_entropy->defined();
  at::Tensor h_c, ent_c;
  if (has_h) {
    h_c = rlk::check_row_vector(*grad_entropy, "grad_entropy", logits, at::kFloat);
    ent_c = rlk::check_row_vector(entropy, "entropy", logits, at::kFloat);
  }
  if (logits.numel() == 0) return;
  const RowGrads grads{lse_c.const_data_ptr<float>(), has_h ? ent_c.const_data_ptr<float>() : nullptr,
                       g_c.const_data_ptr<float>(), has_h ? h_c.const_data_ptr<float>() : nullptr};
  const c10::cuda::CUDAGuard guard(logits.device());
  C10_CUDA_CHECK(token_logprobs_bwd(rows_of(logits, "logits"), tgt.const_data_ptr<int64_t>(), grads, head,
                                    rows_of(out, "out"), c10::cuda::getCurrentCUDAStream()));
}

at::Tensor token_logprobs_bwd_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_parts,
                                   const at::Tensor& entropy, const at::Tensor& grad_logp,
                                   const std::optional<at::Tensor>& grad_entropy, double temperature, double softcap) {
  check_logits(logits);
  at::Tensor grad = at::empty_like(logits);
  bwd_into(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap, grad);
  return grad;
}

// `out`: the logits themselves, or memory disjoint from them (rlkernels/grad_out_check.h).
void token_logprobs_bwd_out_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_parts,
                                 const at::Tensor& entropy, const at::Tensor& grad_logp,
                                 const std::optional<at::Tensor>& grad_entropy, double temperature, double softcap,
                                 const at::Tensor& out) {
  check_logits(logits);
  RLK_CHECK_VALUE(out.device() == logits.device(), "out: expected a tensor on ", logits.device(), ", got ",
                  out.device());
  rlk::check_grad_out(logits, out);
  bwd_into(logits, targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap, out);
}

// The per-token inputs of the forward ops (policy_token_fwd, policy_token_fwd_grad), checked against the rows of
// `logits`: fp32, as they accumulate in fp32.
TokenInputs token_inputs(const at::Tensor& logits, const at::Tensor& mask, const at::Tensor& weight,
                         const at::Tensor& adv, const std::optional<at::Tensor>& old_logp,
                         const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& is_weights) {
  rlk::check_token_inputs(logits, "the rows of logits", mask, weight, adv, old_logp, ref_logp, at::kFloat);
  if (is_weights.has_value()) {
    rlk::check_token_tensor(*is_weights, "is_weights", logits, "the rows of logits", at::kFloat);
  }
  return TokenInputs{mask.const_data_ptr<bool>(), weight.const_data_ptr<float>(), adv.const_data_ptr<float>(),
                     rlk::optional_ptr<float>(old_logp), rlk::optional_ptr<float>(ref_logp), nullptr,
                     rlk::optional_ptr<float>(is_weights)};
}

// The forward plus the per-token policy loss.
// Target values are not checked here (a row outside [0, V) gets a NaN logp; ops/ checks on the device).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_token_fwd_cuda(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, double temperature, double softcap, at::ArrayRef<double> params) {
  check_logits(logits);
  const at::Tensor tgt = rlk::check_targets_shape(targets, logits);  // values: not read (see ops/)
  const Head head = head_of(temperature, softcap);
  const TokenInputs in = token_inputs(logits, mask, weight, adv, old_logp, ref_logp, is_weights);
  const rlk::TokenLossParams<float> loss = rlk::token_loss_params<float>(params);
  const int64_t N = rlk::row_count(logits);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, opts), entropy = at::empty({N}, opts), lse_parts = at::empty({N, 2}, opts);
  at::Tensor grad_logp = at::empty({N}, opts), grad_entropy = at::empty({N}, opts);
  at::Tensor stats = at::empty({N, int64_t(rlk::kNumStats)}, opts);
  if (N == 0) return {logp, entropy, lse_parts, grad_logp, grad_entropy, stats};
  const TokenOutputs out{logp.mutable_data_ptr<float>(),      entropy.mutable_data_ptr<float>(),
                         lse_parts.mutable_data_ptr<float>(), grad_logp.mutable_data_ptr<float>(),
                         grad_entropy.mutable_data_ptr<float>(), stats.mutable_data_ptr<float>()};
  const c10::cuda::CUDAGuard guard(logits.device());
  C10_CUDA_CHECK(policy_token_fwd(rows_of(logits, "logits"), tgt.const_data_ptr<int64_t>(), head, in, loss, out,
                                  c10::cuda::getCurrentCUDAStream()));
  return {logp, entropy, lse_parts, grad_logp, grad_entropy, stats};
}

// The two-pass row into `grad` (a new gradient, or `out`: the logits themselves or memory disjoint from them). The
// checks of policy_token_fwd, those of the CPU two-pass op (entropy_grad, scale), and the device: sm_90 or later
// (thread-block clusters) and a row that fits the shared memory of 8 blocks.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_grad_into(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, const std::optional<at::Tensor>& entropy_grad, double temperature,
    double softcap, at::ArrayRef<double> params, double scale, const at::Tensor& grad) {
  const at::Tensor tgt = rlk::check_targets_shape(targets, logits);  // values: not read (see ops/)
  const Head head = head_of(temperature, softcap);
  const TokenInputs in = token_inputs(logits, mask, weight, adv, old_logp, ref_logp, is_weights);
  rlk::check_two_pass_args(logits, entropy_grad, scale, at::kFloat);
  const rlk::TokenLossParams<float> loss = rlk::token_loss_params<float>(params);
  const int64_t N = rlk::row_count(logits);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, opts), entropy = at::empty({N}, opts);
  at::Tensor stats = at::empty({N, int64_t(rlk::kNumStats)}, opts);
  if (N == 0) return {logp, entropy, stats};
  const c10::cuda::CUDAGuard guard(logits.device());
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, logits.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, logits.get_device()));
  TORCH_CHECK(major >= 9, "policy_token_fwd_grad: the CUDA two-pass kernel needs thread-block clusters (sm_90 or "
              "later); ", logits.device(), " is sm_", major, minor, " (two_pass=False keeps three passes)");
  const int64_t V = logits.size(-1);
  RLK_CHECK_VALUE(two_pass_cluster_size(V, dtype_of(logits, "logits")) > 0, "logits: the CUDA two-pass kernel holds a "
                  "row in the shared memory of at most 8 blocks; V = ", V, " of ", logits.scalar_type(), " does not "
                  "fit (two_pass=False keeps three passes)");
  const TwoPassArgs args{rlk::optional_ptr<float>(entropy_grad), static_cast<float>(scale),
                         logp.mutable_data_ptr<float>(), entropy.mutable_data_ptr<float>(),
                         stats.mutable_data_ptr<float>()};
  C10_CUDA_CHECK(policy_token_fwd_grad(rows_of(logits, "logits"), tgt.const_data_ptr<int64_t>(), head, in, loss, args,
                                       rows_of(grad, "out"), c10::cuda::getCurrentCUDAStream()));
  return {logp, entropy, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_token_fwd_grad_cuda(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, const std::optional<at::Tensor>& entropy_grad, double temperature,
    double softcap, at::ArrayRef<double> params, double scale) {
  check_logits(logits);
  at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  auto r = fwd_grad_into(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, entropy_grad, temperature,
                         softcap, params, scale, grad);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), grad};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_token_fwd_grad_out_cuda(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask, const at::Tensor& weight,
    const at::Tensor& adv, const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weights, const std::optional<at::Tensor>& entropy_grad, double temperature,
    double softcap, at::ArrayRef<double> params, double scale, const at::Tensor& out) {
  check_logits(logits);
  RLK_CHECK_VALUE(out.device() == logits.device(), "out: expected a tensor on ", logits.device(), ", got ",
                  out.device());
  rlk::check_grad_out(logits, out);
  return fwd_grad_into(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, entropy_grad, temperature,
                       softcap, params, scale, out);
}

// grad ×= grad_out / assumed unless grad_out equals `assumed` (rounded to its dtype): the kernel reads grad_out on
// the device and returns at once when it matches (no host sync).
std::tuple<int64_t, int64_t> two_pass_active_clusters_cuda(const at::Tensor& logits) {
  check_logits(logits);
  const int64_t V = logits.size(-1);
  const Dtype dtype = dtype_of(logits, "logits");
  const int size = two_pass_cluster_size(V, dtype);
  RLK_CHECK_VALUE(size > 0, "logits: V = ", V, " of ", logits.scalar_type(), " does not fit the two-pass kernel's "
                  "clusters");
  const c10::cuda::CUDAGuard guard(logits.device());
  int clusters = 0;
  C10_CUDA_CHECK(two_pass_active_clusters(V, dtype, &clusters));
  return {clusters, size};
}

void scale_grad_cuda(const at::Tensor& grad, const at::Tensor& grad_out, double assumed) {
  RLK_CHECK_VALUE(grad.is_cuda() && grad_out.device() == grad.device(), "grad, grad_out: expected tensors on one "
                  "CUDA device, got ", grad.device(), " and ", grad_out.device());
  const Dtype dtype = dtype_of(grad, "grad");
  rlk::check_scale_grad_args(grad, grad_out, assumed);
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  C10_CUDA_CHECK(scale_grad(grad.data_ptr(), grad.numel(), dtype, grad_out.const_data_ptr(),
                            grad_out.scalar_type() == at::kDouble, assumed, c10::cuda::getCurrentCUDAStream()));
}

// The per-token policy loss at given fp32 log-probs (N,).
std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_token_loss_cuda(
    const at::Tensor& logp, const std::optional<at::Tensor>& entropy, const at::Tensor& mask,
    const at::Tensor& weight, const std::optional<at::Tensor>& adv, const std::optional<at::Tensor>& old_logp,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& chosen,
    const std::optional<at::Tensor>& is_weights, at::ArrayRef<double> params) {
  RLK_CHECK_VALUE(logp.is_cuda(), "logp: expected a CUDA tensor, got ", logp.device());
  RLK_CHECK_TYPE(logp.scalar_type() == at::kFloat, "logp: expected dtype float32 on CUDA, got ", logp.scalar_type());
  RLK_CHECK_VALUE(logp.dim() == 1 && logp.is_contiguous(), "logp: expected a contiguous tensor of shape (N,), got ",
                  logp.sizes());
  if (entropy.has_value()) rlk::check_token_tensor(*entropy, "entropy", logp, "logp (N,)", at::kFloat);
  rlk::check_token_inputs(logp, "logp (N,)", mask, weight, adv, old_logp, ref_logp, at::kFloat);
  if (chosen.has_value()) rlk::check_token_tensor(*chosen, "chosen", logp, "logp (N,)", at::kFloat);
  if (is_weights.has_value()) rlk::check_token_tensor(*is_weights, "is_weights", logp, "logp (N,)", at::kFloat);
  const rlk::TokenLossParams<float> loss = rlk::token_loss_params<float>(params);
  const int64_t N = logp.size(0);
  const auto opts = logp.options();
  at::Tensor grad_logp = at::empty({N}, opts), grad_entropy = at::empty({N}, opts);
  at::Tensor stats = at::empty({N, int64_t(rlk::kNumStats)}, opts);
  if (N == 0) return {grad_logp, grad_entropy, stats};
  const auto ptr = [](const std::optional<at::Tensor>& t) { return rlk::optional_ptr<float>(t); };
  const TokenInputs in{mask.const_data_ptr<bool>(), weight.const_data_ptr<float>(), ptr(adv), ptr(old_logp),
                       ptr(ref_logp), ptr(chosen), ptr(is_weights)};
  const c10::cuda::CUDAGuard guard(logp.device());
  C10_CUDA_CHECK(policy_token_loss(N, logp.const_data_ptr<float>(), ptr(entropy), in, loss,
                                   grad_logp.mutable_data_ptr<float>(), grad_entropy.mutable_data_ptr<float>(),
                                   stats.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return {grad_logp, grad_entropy, stats};
}

// Clip-Cov's or KL-Cov's chosen tokens at given fp32 log-probs (N,).
at::Tensor covariance_choice_cuda(const at::Tensor& logp, const at::Tensor& adv,
                                  const std::optional<at::Tensor>& old_logp, const at::Tensor& mask,
                                  const std::optional<at::Tensor>& draws, int64_t objective, double fraction,
                                  double cov_lb, double cov_ub, double clip_low, double clip_high,
                                  double log_ratio_clamp, double scale) {
  RLK_CHECK_VALUE(logp.is_cuda(), "logp: expected a CUDA tensor, got ", logp.device());
  RLK_CHECK_TYPE(logp.scalar_type() == at::kFloat, "logp: expected dtype float32 on CUDA, got ", logp.scalar_type());
  RLK_CHECK_VALUE(logp.dim() == 1 && logp.is_contiguous(), "logp: expected a contiguous tensor of shape (N,), got ",
                  logp.sizes());
  const auto params = rlk::covariance_choice_params<float>(logp, adv, old_logp, mask, draws, objective,
                                                           fraction, cov_lb, cov_ub, clip_low, clip_high,
                                                           log_ratio_clamp, scale);
  const int64_t N = logp.size(0);
  at::Tensor out = at::empty({N}, logp.options());
  if (N == 0) return out;
  const auto ptr = [](const std::optional<at::Tensor>& t) { return rlk::optional_ptr<float>(t); };
  const ChoiceInputs in{logp.const_data_ptr<float>(), adv.const_data_ptr<float>(), ptr(old_logp),
                        mask.const_data_ptr<bool>(), ptr(draws)};
  const c10::cuda::CUDAGuard guard(logp.device());
  C10_CUDA_CHECK(covariance_choice(N, in, params, out.mutable_data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace rlk_cuda

TORCH_LIBRARY_IMPL(rlkernels_C, CUDA, m) {
  m.impl("token_logprobs_fwd", &rlk_cuda::token_logprobs_fwd_cuda);
  m.impl("token_logprobs_bwd", &rlk_cuda::token_logprobs_bwd_cuda);
  m.impl("token_logprobs_bwd_out", &rlk_cuda::token_logprobs_bwd_out_cuda);
  m.impl("policy_token_fwd", &rlk_cuda::policy_token_fwd_cuda);
  m.impl("policy_token_fwd_grad", &rlk_cuda::policy_token_fwd_grad_cuda);
  m.impl("policy_token_fwd_grad_out", &rlk_cuda::policy_token_fwd_grad_out_cuda);
  m.impl("scale_grad_", &rlk_cuda::scale_grad_cuda);
  m.impl("two_pass_active_clusters", &rlk_cuda::two_pass_active_clusters_cuda);
  m.impl("policy_token_loss", &rlk_cuda::policy_token_loss_cuda);
  m.impl("covariance_choice", &rlk_cuda::covariance_choice_cuda);
}
