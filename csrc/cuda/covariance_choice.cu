// CUDA implementation of `covariance_choice` (the contract is in rlkernels/kernels/__init__.py, the launcher in
// launchers.h): Clip-Cov's and KL-Cov's tokens, the k eligible tokens of smallest key of
// rlkernels/covariance_choice.h, in one launch of one block. The choice couples every token, so one block makes
// it: a pass for the means (summed in double, as the spec), four radix passes of 8 bits that find the k-th
// smallest key (a shared 256-bin histogram each), and a last pass in position order that takes the tokens below
// that key and, of those at it, the first ones (a block-wide prefix count). Torch-free.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "launchers.h"

namespace rlk_cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 256;

__device__ inline rlk::Candidate<float> candidate_at(const ChoiceInputs& in, const rlk::CovarianceChoiceParams<float>& p,
                                                     int64_t i, float mean_adv, float mean_logp) {
  return rlk::candidate(p, in.adv[i], in.logp[i], in.old_logp != nullptr,
                        in.old_logp != nullptr ? in.old_logp[i] : 0.0f, in.draws != nullptr ? in.draws[i] : 0.0f,
                        mean_adv, mean_logp);
}

// One block per launch: registers for 1024 threads (64 each), not for two blocks an SM (32 each: sm_80 spilled).
__global__ void __launch_bounds__(kThreads, 1)
    covariance_choice_kernel(int64_t n, ChoiceInputs in, rlk::CovarianceChoiceParams<float> p, float* __restrict__ out) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ unsigned int hist[kBins];
  __shared__ float mean[2];
  __shared__ int64_t k_shared, need_shared;
  __shared__ uint32_t prefix_shared;
  __shared__ bool take_all_shared;

  // The means over the masked tokens (count: an integer below 2^53, exact in double).
  double sums[3] = {0.0, 0.0, 0.0};
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    if (!in.mask[i]) continue;
    sums[0] += in.adv[i];
    sums[1] += in.logp[i];
    sums[2] += 1.0;
  }
  for (int j = 0; j < 3; ++j) {
    sums[j] = Reduce(temp.reduce).Sum(sums[j]);  // valid in thread 0
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double divisor = sums[2] > 1.0 ? sums[2] : 1.0;
    mean[0] = float(sums[0] / divisor);
    mean[1] = float(sums[1] / divisor);
    k_shared = rlk::choice_size(int64_t(sums[2]), p.fraction);
    need_shared = k_shared;
    prefix_shared = 0;
    take_all_shared = false;
  }
  __syncthreads();
  const float mean_adv = mean[0], mean_logp = mean[1];

  // The k-th smallest key, 8 bits a pass; need_shared: how many of the tokens at that key are taken.
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t prefix = prefix_shared;
    for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      if (!in.mask[i]) continue;
      const auto c = candidate_at(in, p, i, mean_adv, mean_logp);
      if (c.eligible && (pass == 0 || (c.key >> (shift + 8)) == (prefix >> (shift + 8))))
        atomicAdd(&hist[(c.key >> shift) & (kBins - 1)], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t below = 0;
      if (pass == 0) {
        for (int b = 0; b < kBins; ++b) below += hist[b];
        take_all_shared = below <= k_shared;  // every eligible token is chosen
        below = 0;
      }
      int digit = 0;
      while (digit < kBins - 1 && below + hist[digit] < need_shared) below += hist[digit++];
      prefix_shared = prefix | (uint32_t(digit) << shift);
      need_shared -= below;
    }
    __syncthreads();
    if (take_all_shared) break;  // uniform: every thread reads it after the barrier
  }
  const bool take_all = take_all_shared;
  const uint32_t threshold = prefix_shared;
  const int64_t need = need_shared;

  int64_t taken = 0;  // tokens at the threshold already taken, in position order (the same in every thread)
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    bool eligible = false;
    uint32_t key = 0;
    if (i < n && in.mask[i]) {
      const auto c = candidate_at(in, p, i, mean_adv, mean_logp);
      eligible = c.eligible;
      key = c.key;
    }
    const int tie = eligible && key == threshold ? 1 : 0;
    int rank, ties;
    Scan(temp.scan).ExclusiveSum(tie, rank, ties);
    __syncthreads();  // before the next chunk's scan reuses the storage
    const bool take = eligible && (take_all || key < threshold || (tie && taken + rank < need));
    if (i < n) out[i] = take ? p.scale : 0.0f;
    taken += ties;
  }
}

}  // namespace

cudaError_t covariance_choice(int64_t n, const ChoiceInputs& in, const rlk::CovarianceChoiceParams<float>& params,
                              float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  covariance_choice_kernel<<<1, kThreads, 0, stream>>>(n, in, params, out);
  return cudaGetLastError();
}

}  // namespace rlk_cuda
