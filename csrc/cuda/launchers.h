// Launchers of every CUDA kernel: the per-token log-prob / entropy primitive (docs/design.md §2), the
// per-token policy loss and the covariance choice (the contract is in rlkernels/kernels/__init__.py).
// Torch-free: raw pointers, sizes and a stream, so that the .cu files compile with nvcc alone;
// csrc/cuda/bindings.cpp joins them to torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "rlkernels/covariance_choice.h"
#include "rlkernels/row_index.h"
#include "rlkernels/row_math.h"
#include "rlkernels/token_loss.h"

namespace rlk_cuda {

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// n rows of v elements with unit stride, row r at at(r) elements past `data` (rlk::RowIndex: logits
// (N, V), or a (B, T, V) view such as logits[:, :-1] of a (B, T + 1, V) parent, in one launch). `data`
// is aligned to its element size (any torch tensor is); 16-byte alignment is not needed.
struct Rows {
  void* data;
  int64_t n;
  int64_t v;
  rlk::RowIndex at;
  Dtype dtype;
};

// What the model does to the head's output z before the softmax: y = cap(z) (rlk::SoftCap; c = 0
// for none), then y/τ.
struct Head {
  float inv_tau;
  rlk::SoftCap<float> cap;
};

// Forward: logp[n], lse_parts[2n], lse_parts[2n + 1] (the row max m of y = cap(z) and log s,
// s = Σ e^{(y − m)·inv_tau}) and, when `entropy` is not null, entropy[n] (fp32, device memory) of
// softmax(y · inv_tau). targets[n] are int64 in [0, v); a row whose target is outside gets
// a NaN logp (the callers check the range). Returns the launch error, if any.
cudaError_t token_logprobs_fwd(const Rows& logits, const int64_t* targets, const Head& head, float* logp,
                               float* entropy, float* lse_parts, cudaStream_t stream);

// Per-row inputs of the backward, fp32 device arrays of n elements (lse_parts: n pairs [m, log s],
// as the forward writes them). grad_entropy == nullptr means h = 0 (and `entropy` is then not read).
struct RowGrads {
  const float* lse_parts;
  const float* entropy;
  const float* grad_logp;
  const float* grad_entropy;
};

// Backward: out[n, v] = ∂L/∂logits in the dtype of the logits, its rows where out.at says. `out` may be
// `logits` itself (the same data and strides; every element is read before it is written) or disjoint from it.
cudaError_t token_logprobs_bwd(const Rows& logits, const int64_t* targets, const RowGrads& grads, const Head& head,
                               const Rows& out, cudaStream_t stream);

// Per-token inputs of the policy loss, device arrays of n elements: fp32, the mask bool (adv is
// never null for policy_token_fwd).
using TokenInputs = rlk::TokenArrays<float>;

// Outputs of policy_token_fwd, fp32 device arrays: n elements each, lse_parts n × 2 (as in the
// forward), stats n × rlk::kNumStats.
struct TokenOutputs {
  float* logp;
  float* entropy;
  float* lse_parts;
  float* grad_logp;
  float* grad_entropy;
  float* stats;
};

// The forward plus the per-token policy loss of rlkernels/token_loss.h on every row (the contract
// is `policy_token_fwd` in rlkernels/kernels/__init__.py). A row whose target is outside [0, v)
// gets a NaN logp, and so a NaN loss unless it is masked. Returns the launch error, if any.
cudaError_t policy_token_fwd(const Rows& logits, const int64_t* targets, const Head& head, const TokenInputs& in,
                             const rlk::TokenLossParams<float>& params, const TokenOutputs& out,
                             cudaStream_t stream);

// What the two-pass row takes and gives besides policy_token_fwd's inputs: fp32 device arrays of n elements
// (stats n × rlk::kNumStats); entropy_grad may be null (see policy_token_fwd_grad).
struct TwoPassArgs {
  const float* entropy_grad;
  float scale;
  float* logp;
  float* entropy;
  float* stats;
};

// The cluster size (1, 2, 4 or 8) the two-pass kernel takes for rows of v logits of `dtype`, and 0 where a row
// does not fit the shared memory of 8 blocks (policy_token_two_pass.cu).
int two_pass_cluster_size(int64_t v, Dtype dtype);

// Into *clusters: how many clusters of that size the current device holds at once for rows of v logits of `dtype`
// (cudaOccupancyMaxActiveClusters at the launch's configuration; 3 blocks per SM is the design). sm_90 and later.
cudaError_t two_pass_active_clusters(int64_t v, Dtype dtype, int* clusters);

// The two-pass row (docs/design.md §2; the contract is `policy_token_fwd_grad` in rlkernels/kernels/__init__.py):
// policy_token_fwd's logp, entropy and statistics, and ∂logits into `grad` (rows where grad.at says; it may be
// `logits` itself) at g = scale·grad_logp, h = scale·(entropy_grad, else the token's grad_entropy where
// params.entropy_coef != 0, else 0), from one read of each row. sm_90 and later (thread-block clusters):
// cudaErrorNotSupported below; cudaErrorInvalidValue where two_pass_cluster_size is 0. Returns the launch error.
cudaError_t policy_token_fwd_grad(const Rows& logits, const int64_t* targets, const Head& head, const TokenInputs& in,
                                  const rlk::TokenLossParams<float>& params, const TwoPassArgs& args, const Rows& grad,
                                  cudaStream_t stream);

// grad[n] ×= incoming / assumed in fp32, unless *incoming (device memory: fp32, or fp64 when `fp64`) equals
// `assumed` rounded to its dtype; the kernel's blocks read it and return at once when it does (no host sync).
// grad: n contiguous elements of `dtype`. Returns the launch error.
cudaError_t scale_grad(void* grad, int64_t n, Dtype dtype, const void* incoming, bool fp64, double assumed,
                       cudaStream_t stream);

// The per-token policy loss at given log-probs `logp` (and `entropy`, nullptr: H = 0), n fp32
// device elements each; outputs as in policy_token_fwd (the contract is `policy_token_loss` in
// rlkernels/kernels/__init__.py). Returns the launch error, if any.
cudaError_t policy_token_loss(int64_t n, const float* logp, const float* entropy, const TokenInputs& in,
                              const rlk::TokenLossParams<float>& params, float* grad_logp, float* grad_entropy,
                              float* stats, cudaStream_t stream);

// The inputs of covariance_choice, fp32 device arrays of n elements (the mask bool); old_logp and draws (Clip-Cov
// only) may be null.
struct ChoiceInputs {
  const float* logp;
  const float* adv;
  const float* old_logp;
  const bool* mask;
  const float* draws;
};

// Clip-Cov's or KL-Cov's chosen tokens of rlkernels/covariance_choice.h into out[n] (fp32 device memory): scale
// on each, 0 elsewhere (the contract is `covariance_choice` in rlkernels/kernels/__init__.py).
// One block; n < 2^31. Returns the launch error, if any.
cudaError_t covariance_choice(int64_t n, const ChoiceInputs& in, const rlk::CovarianceChoiceParams<float>& params,
                              float* out, cudaStream_t stream);

}  // namespace rlk_cuda
