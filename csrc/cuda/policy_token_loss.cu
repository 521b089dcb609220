// CUDA implementation of `policy_token_loss` (the contract is in rlkernels/kernels/__init__.py,
// the launcher in launchers.h): the per-token policy loss of rlkernels/token_loss.h at given
// log-probs, one thread per token. Torch-free.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "launchers.h"

namespace rlk_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // a grid-stride loop covers the rest

__global__ void __launch_bounds__(kThreads)
    policy_token_loss_kernel(int64_t n, const float* __restrict__ logp, const float* __restrict__ entropy,
                             TokenInputs in, rlk::TokenLossParams<float> params, float* __restrict__ grad_logp,
                             float* __restrict__ grad_entropy, float* __restrict__ stats) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const float h = entropy != nullptr ? entropy[i] : 0.0f;  // absent: H = 0
    rlk::token_loss(in.at(i, logp[i], h), params).store(i, grad_logp, grad_entropy, stats);
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
