// CUDA backend of the per-token log-prob / entropy primitive (docs/design.md §2; the contract is in
// rlkernels/kernels/__init__.py, the launchers in launchers.h), and the same forward with the
// per-token policy loss (rlkernels/token_loss.h) evaluated by the thread that finishes each row.
// Torch-free.
//
// A row is served by a group of kThreads threads: a logical warp of 32 for V ≤ 2048 (8 rows per
// 256-thread block), else a whole block of 256 or 512. Each thread walks its share of the row in
// 16-byte packs (the first elements, up to the row's first 16-byte boundary, and the last partial
// pack one element per thread), a step of packs per iteration with the loads issued together
// (row_pass.cuh). A final-logit cap is a template flag (kCap), so that the kernels without one carry
// nothing of it; and those hold 1536 threads per SM (kMinBlocks).
// Forward: per thread an online softmax state (running max m of the raw logits, Σ e^d, Σ e^d·d with
// d = (z − m)/τ) in fp32,
// merged across the group with cub's warp/block reduction and rlk::softmax_merge. One read of
// the logits. Backward: elementwise from the saved (m, log s) (and H); one read, one write, and each
// thread reads every element it owns before writing it, so `out` may be the logits themselves.
//
// The max is of the raw logits and τ scales differences only (z/τ overflows near 3e38 at τ < 1): the
// max element gives d = 0 exactly, e^0 = 1, so log Σ ≥ 0 and logp ≤ 0. d is rounded on its own
// (__fmul_rn, never contracted into the − log s that follows), as on the CPU.
#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "row_pass.cuh"
#include "launchers.h"

namespace rlk_cuda {
namespace {

using rows::GradOf;
using rows::Pack;
using rows::State;

constexpr int kWarpBlock = 256;   // threads per block when a warp serves a row
constexpr int64_t kMaxGrid = int64_t(1) << 28;  // blocks per launch along x: kRows · kMaxGrid < 2^31
constexpr int64_t kMaxSeqs = 65535;             // and along y, one sequence each

struct Merge {
  float inv_tau;
  __device__ __forceinline__ State operator()(const State& a, const State& b) const {
    return rlk::softmax_merge(a, b, inv_tau);
  }
};

template <int kThreads> struct Group {  // kThreads threads per row, kRows rows per block
  static constexpr int kRows = kThreads >= kWarpBlock ? 1 : kWarpBlock / kThreads;
  static constexpr int kBlock = kThreads * kRows;
};

// Blocks per SM each kernel asks ptxas to fit (__launch_bounds__): 1536 threads, at most 40
// registers, so that enough loads are in flight for the memory's bandwidth. None under a cap: the
// tanh of each logit needs more registers, and would spill.
template <int kThreads, bool kCap>
constexpr int kMinBlocks = kCap ? 0 : 1536 / Group<kThreads>::kBlock;

// Row r = blockIdx.x · kRows + (group) of the launch's `rows` of sequence blockIdx.y (`over_rows`: `logits`
// at the launch's first row, first_row its index), where `at` says (a batch stride beside the row stride: a
// view such as logits[:, :-1] in one launch); lane 0 of the row's group hands its results to `out`
// (rows::StoreRow, rows::StorePolicyToken).
template <typename T, int kThreads, bool kEntropy, bool kCap, typename Out>
__global__ void __launch_bounds__(Group<kThreads>::kBlock, (kMinBlocks<kThreads, kCap>))
    fwd_kernel(const T* __restrict__ logits, rlk::RowIndex at, int64_t first_row, int rows, int64_t V,
               const int64_t* __restrict__ targets, Head head, Out out) {
  constexpr int kRows = Group<kThreads>::kRows;
  const int lane = threadIdx.x % kThreads, group = threadIdx.x / kThreads;
  const int r = static_cast<int>(blockIdx.x) * kRows + group;
  if (kRows > 1 && r >= rows) return;  // a whole logical warp leaves together
  const int64_t row = first_row + int64_t(blockIdx.y) * at.seq_len + r;
  const T* z = logits + at.offset(blockIdx.y, r);
  State st = rows::thread_state<T, kThreads, kEntropy, kCap>(z, V, head, lane);
  if constexpr (kRows == 1) {
    using Reduce = cub::BlockReduce<State, kThreads>;
    __shared__ typename Reduce::TempStorage tmp;
    st = Reduce(tmp).Reduce(st, Merge{head.inv_tau});
  } else {
    using Reduce = cub::WarpReduce<State, kThreads>;
    __shared__ typename Reduce::TempStorage tmp[kRows];
    st = Reduce(tmp[group]).Reduce(st, Merge{head.inv_tau});
  }
  if (lane == 0) {
    const int64_t y = targets[row];
    const float z_y =
        (y >= 0 && y < V) ? rows::head_logit<kCap>(head, Pack<T>::to_float(z[y])) : __int_as_float(0x7fc00000);
    out(row, rlk::softmax_finalize(st, z_y, head.inv_tau));
  }
}

template <typename T, int kThreads, bool kCap>
__global__ void __launch_bounds__(Group<kThreads>::kBlock, (kMinBlocks<kThreads, kCap>))
    bwd_kernel(const T* logits, rlk::RowIndex at, int64_t first_row, int rows, int64_t V,
               const int64_t* __restrict__ targets, RowGrads grads, Head head, T* out, rlk::RowIndex out_at) {
  constexpr int kRows = Group<kThreads>::kRows;
  const int lane = threadIdx.x % kThreads, group = threadIdx.x / kThreads;
  const int r = static_cast<int>(blockIdx.x) * kRows + group;
  if (r >= rows) return;
  const T* z = logits + at.offset(blockIdx.y, r);
  T* o = out + out_at.offset(blockIdx.y, r);
  const int64_t row = first_row + int64_t(blockIdx.y) * at.seq_len + r;
  const bool has_h = grads.grad_entropy != nullptr;
  const GradOf<kCap> grad{grads.lse_parts[2 * row], grads.lse_parts[2 * row + 1], head,
                          rlk::grad_coeffs<float>(grads.grad_logp[row], has_h ? grads.grad_entropy[row] : 0.0f,
                                                  has_h ? grads.entropy[row] : 0.0f, head.inv_tau),
                          static_cast<int>(targets[row] >= 0 && targets[row] < V ? targets[row] : -1)};
  if ((reinterpret_cast<uintptr_t>(z) & 15) == (reinterpret_cast<uintptr_t>(o) & 15)) {
    rows::grad_row<T, kThreads, true>(z, o, V, grad, lane);
  } else {
    rows::grad_row<T, kThreads, false>(z, o, V, grad, lane);
  }
}

// Threads per row: one warp up to V = 2048 (≥ 8 packs per thread), then 256, then 512 threads; and
// whether the logits are capped, as a template flag (the kernels without a cap carry none of it).
template <typename F>
cudaError_t with_threads(int64_t V, const Head& head, F&& launch) {
  auto with_cap = [&](auto threads) {
    if (head.cap.on()) {
      launch(threads, std::true_type());
    } else {
      launch(threads, std::false_type());
    }
  };
  if (V <= 2048) {
    with_cap(std::integral_constant<int, 32>());
  } else if (V <= 32768) {
    with_cap(std::integral_constant<int, 256>());
  } else {
    with_cap(std::integral_constant<int, 512>());
  }
  return cudaGetLastError();
}

// launch(grid, b, t, rows) over every row of `at`'s n: blocks of kRows rows of a sequence along x (`rows` of them
// from row t), a sequence along y (from b); one launch unless T > 2^28 · kRows or B > 65535. Where T is not a
// multiple of kRows (8 for V ≤ 2048) a sequence's last block leaves some warps idle.
template <int kRows, typename F>
void over_rows(const rlk::RowIndex& at, int64_t n, F&& launch) {
  const int64_t seqs = n / at.seq_len;
  for (int64_t b = 0; b < seqs; b += kMaxSeqs) {
    for (int64_t t = 0; t < at.seq_len; t += kMaxGrid * kRows) {
      const int64_t rows = std::min(kMaxGrid * kRows, at.seq_len - t), blocks = (rows + kRows - 1) / kRows;
      launch(dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(std::min(kMaxSeqs, seqs - b))), b, t,
             static_cast<int>(rows));
    }
  }
}

template <typename T, bool kEntropy, typename Out>
cudaError_t fwd(const Rows& logits, const int64_t* targets, Head head, const Out& out, cudaStream_t stream) {
  return with_threads(logits.v, head, [&](auto threads, auto cap) {
    constexpr int kThreads = decltype(threads)::value;
    using G = Group<kThreads>;
    over_rows<G::kRows>(logits.at, logits.n, [&](dim3 grid, int64_t b, int64_t t, int rows) {
      fwd_kernel<T, kThreads, kEntropy, decltype(cap)::value, Out><<<grid, G::kBlock, 0, stream>>>(
          static_cast<const T*>(logits.data) + logits.at.offset(b, t), logits.at, b * logits.at.seq_len + t, rows,
          logits.v, targets, head, out);
    });
  });
}

template <typename T>
cudaError_t fwd_rows(const Rows& logits, const int64_t* targets, Head head, float* logp, float* entropy,
                     float* lse_parts, cudaStream_t stream) {
  if (entropy != nullptr) {
    return fwd<T, true>(logits, targets, head, rows::StoreRow<true>{logp, entropy, lse_parts}, stream);
  }
  return fwd<T, false>(logits, targets, head, rows::StoreRow<false>{logp, nullptr, lse_parts}, stream);
}

template <typename T>
cudaError_t bwd(const Rows& logits, const int64_t* targets, const RowGrads& grads, Head head, const Rows& out,
                cudaStream_t stream) {
  return with_threads(logits.v, head, [&](auto threads, auto cap) {
    constexpr int kThreads = decltype(threads)::value;
    using G = Group<kThreads>;
    over_rows<G::kRows>(logits.at, logits.n, [&](dim3 grid, int64_t b, int64_t t, int rows) {
      bwd_kernel<T, kThreads, decltype(cap)::value><<<grid, G::kBlock, 0, stream>>>(
          static_cast<const T*>(logits.data) + logits.at.offset(b, t), logits.at, b * logits.at.seq_len + t, rows,
          logits.v, targets, grads, head, static_cast<T*>(out.data) + out.at.offset(b, t), out.at);
    });
  });
}

}  // namespace

cudaError_t token_logprobs_fwd(const Rows& logits, const int64_t* targets, const Head& head, float* logp,
                               float* entropy, float* lse_parts, cudaStream_t stream) {
  if (logits.n == 0) return cudaSuccess;
  if (logits.v <= 0 || logits.at.seq_len <= 0) return cudaErrorInvalidValue;
  switch (logits.dtype) {
    case Dtype::kFloat32: return fwd_rows<float>(logits, targets, head, logp, entropy, lse_parts, stream);
    case Dtype::kBFloat16:
      return fwd_rows<__nv_bfloat16>(logits, targets, head, logp, entropy, lse_parts, stream);
    case Dtype::kFloat16: return fwd_rows<__half>(logits, targets, head, logp, entropy, lse_parts, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t token_logprobs_bwd(const Rows& logits, const int64_t* targets, const RowGrads& grads, const Head& head,
                               const Rows& out, cudaStream_t stream) {
  if (logits.n == 0 || logits.v == 0) return cudaSuccess;
  if (out.n != logits.n || out.v != logits.v || out.dtype != logits.dtype || logits.at.seq_len <= 0 ||
      out.at.seq_len != logits.at.seq_len) {
    return cudaErrorInvalidValue;
  }
  switch (logits.dtype) {
    case Dtype::kFloat32: return bwd<float>(logits, targets, grads, head, out, stream);
    case Dtype::kBFloat16: return bwd<__nv_bfloat16>(logits, targets, grads, head, out, stream);
    case Dtype::kFloat16: return bwd<__half>(logits, targets, grads, head, out, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t policy_token_fwd(const Rows& logits, const int64_t* targets, const Head& head, const TokenInputs& in,
                             const rlk::TokenLossParams<float>& params, const TokenOutputs& out,
                             cudaStream_t stream) {
  if (logits.n == 0) return cudaSuccess;
  if (logits.v <= 0 || logits.at.seq_len <= 0) return cudaErrorInvalidValue;
  const rows::StorePolicyToken store{in, params, out};
  switch (logits.dtype) {
    case Dtype::kFloat32: return fwd<float, true>(logits, targets, head, store, stream);
    case Dtype::kBFloat16: return fwd<__nv_bfloat16, true>(logits, targets, head, store, stream);
    case Dtype::kFloat16: return fwd<__half, true>(logits, targets, head, store, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rlk_cuda
