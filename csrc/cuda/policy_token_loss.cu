// CUDA implementation of `policy_token_loss` (the contract is in rlkernels/kernels/__init__.py,
// the launcher in token_logprobs.h): the per-token policy loss of rlkernels/token_loss.h at given
// log-probs, one thread per token. Torch-free.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "token_logprobs.h"

namespace rlk_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // a grid-stride loop covers the rest

__global__ void __launch_bounds__(kThreads)
    policy_token_loss_kernel(int64_t n, const float* __restrict__ logp, const float* __restrict__ entropy,
                             TokenInputs in, rlk::TokenLossParams<float> params, float* __restrict__ grad_logp,
                             float* __restrict__ grad_entropy, float* __restrict__ stats) {
  const bool has_old = in.old_logp != nullptr, has_ref = in.ref_logp != nullptr;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    // Absent: no entropy (H = 0), no advantage (A = 0: only the KL and entropy terms).
    const rlk::TokenIn<float> t{logp[i], entropy != nullptr ? entropy[i] : 0.0f, in.mask[i], in.weight[i],
                                in.adv != nullptr ? in.adv[i] : 0.0f, has_old, has_old ? in.old_logp[i] : 0.0f,
                                has_ref, has_ref ? in.ref_logp[i] : 0.0f};
    const rlk::TokenOut<float> o = rlk::token_loss(t, params);
    grad_logp[i] = o.grad_logp;
    grad_entropy[i] = o.grad_entropy;
#pragma unroll
    for (int j = 0; j < rlk::kNumStats; ++j) stats[i * rlk::kNumStats + j] = o.stats[j];
  }
}

}  // namespace

cudaError_t policy_token_loss(int64_t n, const float* logp, const float* entropy, const TokenInputs& in,
                              const rlk::TokenLossParams<float>& params, float* grad_logp, float* grad_entropy,
                              float* stats, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  policy_token_loss_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(n, logp, entropy, in, params,
                                                                                   grad_logp, grad_entropy, stats);
  return cudaGetLastError();
}

}  // namespace rlk_cuda
