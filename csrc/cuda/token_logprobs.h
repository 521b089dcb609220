// Launchers of the CUDA kernels of the per-token log-prob / entropy primitive (DESIGN.md §2; the
// contract is in rlkernels/kernels/__init__.py). Torch-free: raw pointers, sizes and a stream, so
// that token_logprobs.cu compiles with nvcc alone; csrc/cuda/bindings.cpp joins them to torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlk_cuda {

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// An (n, v) matrix with unit stride over v, rows `row_stride` elements apart. `data` is aligned
// to its element size (any torch tensor is); 16-byte alignment is not needed.
struct Rows {
  void* data;
  int64_t n;
  int64_t v;
  int64_t row_stride;
  Dtype dtype;
};

// Forward: logp[n], lse[n] and, when `entropy` is not null, entropy[n] (fp32, device memory) of the
// rows of x = logits · inv_tau. targets[n] are int64 in [0, v); a row whose target is outside gets
// a NaN logp (the callers check the range). Returns the launch error, if any.
cudaError_t token_logprobs_fwd(const Rows& logits, const int64_t* targets, float inv_tau, float* logp,
                               float* entropy, float* lse, cudaStream_t stream);

// Per-row inputs of the backward, fp32 device arrays of n elements. grad_entropy == nullptr means
// h = 0 (and `entropy` is then not read).
struct RowGrads {
  const float* lse;
  const float* entropy;
  const float* grad_logp;
  const float* grad_entropy;
};

// Backward: out[n, v] = ∂L/∂logits in the dtype of the logits. `out` may be `logits` itself (the
// same data and row stride; every element is read before it is written) or disjoint from it.
cudaError_t token_logprobs_bwd(const Rows& logits, const int64_t* targets, const RowGrads& grads, float inv_tau,
                               const Rows& out, cudaStream_t stream);

}  // namespace rlk_cuda
