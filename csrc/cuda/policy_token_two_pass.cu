// CUDA backend of the two-pass row (`policy_token_fwd_grad`, docs/design.md §2, §7; the launchers in launchers.h)
// and of `scale_grad_`, its backward. Torch-free.
//
// sm_90: a row of logits is held in the shared memory of a thread-block cluster of C blocks (C = 1: one block, no
// cluster), the smallest C ∈ {1, 2, 4, 8} whose slice fits cluster::kSliceBudget, so that 3 blocks of 512 threads
// fit an SM. Each block loads its slice once with 128-bit loads, reduces its partial softmax state, and after a
// cluster barrier lane i of warp 0 reads block i's partial through distributed shared memory and the warp merges
// them in a fixed tree of rank order (cluster::merge_level); thread 0 evaluates the token's loss (rank 0 stores
// it) and the gradient's coefficients, and the block writes ∂z
// of its slice from shared memory with 128-bit stores. A block arrives at the second cluster barrier as soon as it
// has read the others' partials and waits on it only before it exits, so that no block's shared memory goes while
// another reads it. The phases are cluster_row.cuh's, tested on the host (csrc/tests/test_cluster_row.cu).
// sm_80 has no clusters: the kernel is a trap there, and the launcher refuses devices below sm_90.
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cluster_row.cuh"
#include "launchers.h"

namespace rlk_cuda {
namespace {

using cluster::kThreads;
using rows::Pack;
using rows::State;

constexpr int64_t kMaxGridRows = int64_t(1) << 27;  // rows per launch along x: rows · 8 blocks < 2^31
constexpr int64_t kMaxSeqs = 65535;                 // sequences per launch along y

// What thread 0 hands the block after phases 2 and 3.
struct RowShared {
  float m, log_s, z_y;
  rlk::GradCoeffs<float> c;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
struct Merge {
  float inv_tau;
  __device__ __forceinline__ State operator()(const State& a, const State& b) const {
    return rlk::softmax_merge(a, b, inv_tau);
  }
};

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
#endif

// Row r = blockIdx.x / C of sequence blockIdx.y of the launch (`logits` at its first row, first_row its index),
// served by the C blocks blockIdx.x = r·C + rank, one cluster.
template <typename T, bool kCap>
__global__ void __launch_bounds__(kThreads, cluster::kBlocksPerSm)
    two_pass_kernel(const T* logits, rlk::RowIndex at, int64_t first_row, int64_t V, int C,
                    const int64_t* __restrict__ targets, Head head, cluster::TwoPassRow epilogue, T* out,
                    rlk::RowIndex out_at) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  extern __shared__ uint4 slice[];
  __shared__ cluster::Partial partial;
  __shared__ RowShared shared_row;
  using Reduce = cub::BlockReduce<State, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const cg::cluster_group cl = cg::this_cluster();
  const int rank = C == 1 ? 0 : static_cast<int>(cl.block_rank()), lane = threadIdx.x;
  const int r = static_cast<int>(blockIdx.x) / C;
  const int64_t row = first_row + int64_t(blockIdx.y) * at.seq_len + r;
  const T* z = logits + at.offset(blockIdx.y, r);
  T* o = out + out_at.offset(blockIdx.y, r);
  const cluster::Slices s = cluster::slices(z, V, C);
  const int64_t y = targets[row];
  const cluster::Owner target = cluster::owner<T, kThreads>(s, V, y);

  // 1. the slice into shared memory, the block's partial
  State st = cluster::load_slice<T, kThreads, kCap>(z, V, head, s, rank, lane, slice);
  st = Reduce(tmp).Reduce(st, Merge{head.inv_tau});
  if (lane == 0) {
    partial.st = st;
    if (target.rank == rank) partial.z_y = Pack<T>::to_float(z[y]);
  }
  if (C == 1) {
    __syncthreads();
  } else {
    cl.sync();  // every block's partial written
  }
  // 2., 3. the partials merged by warp 0 (lane i reads block i's); thread 0's token loss and gradient coefficients.
  // The warp's index broadcast from its lane 0 is uniform as the compiler sees it: with `lane < 32` it guards the
  // shuffles against a diverged warp (a fallback path of ~1800 instructions).
  if (__shfl_sync(~0u, lane / 32, 0) == 0) {
    const cluster::Partial& p = C == 1 ? partial : *cl.map_shared_rank(&partial, lane < C ? lane : 0);
    State st = lane < C ? p.st : rlk::softmax_init<float>();
    for (int d = 1; d < C; d *= 2) {
      const State down{__shfl_down_sync(~0u, st.m, d), __shfl_down_sync(~0u, st.s, d), __shfl_down_sync(~0u, st.u, d)};
      st = cluster::merge_level(st, down, lane, d, C, head.inv_tau);
    }
    const float z_y = __shfl_sync(~0u, p.z_y, target.rank >= 0 ? target.rank : 0);
    if (lane == 0) {
      const float zy = target.rank >= 0 ? z_y : NAN;
      const rlk::RowResult<float> res = rlk::softmax_finalize(st, rows::head_logit<kCap>(head, zy), head.inv_tau);
      shared_row = RowShared{res.m, res.log_s, zy, epilogue(row, res, head.inv_tau, rank == 0)};
    }
  }
  __syncthreads();
  if (C > 1) cluster_arrive();  // this block reads no other's shared memory any more
  // 4. the gradient of the slice
  const rows::GradOf<kCap> grad{shared_row.m, shared_row.log_s, head, shared_row.c,
                                static_cast<int>(target.rank >= 0 ? y : -1)};
  const bool vec = (reinterpret_cast<uintptr_t>(z) & 15) == (reinterpret_cast<uintptr_t>(o) & 15);
  cluster::store_slice_grad<T, kThreads>(z, o, V, s, rank, lane, slice, grad, target, shared_row.z_y, vec);
  if (C > 1) cluster_wait();  // no block leaves while another may read its partial
#else
  __trap();  // clusters are sm_90's: the launcher refuses older devices
#endif
}

// The kernel's attributes at a plan: its slice as dynamic shared memory, and the whole carveout as shared memory
// (the L1 keeps only what is left: 3 × (slice + 1.3 KB) of the SM's 228 KB), set rather than left to the driver's
// guess from the first launch.
template <typename Kernel>
cudaError_t set_attributes(Kernel kernel, const cluster::Plan& plan) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(plan.slice_bytes));
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

// The clusters of plan.cluster blocks one launch of the kernel keeps resident on the whole device at once
// (cudaOccupancyMaxActiveClusters, with the launch's block, shared memory and cluster shape).
template <typename T>
cudaError_t active_clusters(int64_t v, int* clusters) {
  const cluster::Plan plan = cluster::plan(v, sizeof(T));
  if (plan.cluster == 0) return cudaErrorInvalidValue;
  auto kernel = two_pass_kernel<T, false>;
  cudaError_t err = set_attributes(kernel, plan);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(plan.slice_bytes);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(clusters, kernel, &config);
}

template <typename T>
cudaError_t launch_two_pass(const Rows& logits, const int64_t* targets, const Head& head,
                            const cluster::TwoPassRow& epilogue, const Rows& grad, cudaStream_t stream) {
  const cluster::Plan plan = cluster::plan(logits.v, sizeof(T));
  if (plan.cluster == 0) return cudaErrorInvalidValue;
  auto go = [&](auto kernel) {
    cudaError_t err = set_attributes(kernel, plan);
    if (err != cudaSuccess) return err;
    const rlk::RowIndex& at = logits.at;
    const int64_t seqs = logits.n / at.seq_len;
    for (int64_t b = 0; b < seqs; b += kMaxSeqs) {
      for (int64_t t = 0; t < at.seq_len; t += kMaxGridRows) {
        const int64_t rows = std::min(kMaxGridRows, at.seq_len - t);
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(static_cast<unsigned>(rows * plan.cluster), static_cast<unsigned>(std::min(kMaxSeqs, seqs - b)));
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = static_cast<size_t>(plan.slice_bytes);
        config.stream = stream;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        config.attrs = attr;
        config.numAttrs = plan.cluster > 1 ? 1 : 0;
        err = cudaLaunchKernelEx(&config, kernel, static_cast<const T*>(logits.data) + at.offset(b, t), at,
                                 b * at.seq_len + t, logits.v, plan.cluster, targets, head, epilogue,
                                 static_cast<T*>(grad.data) + grad.at.offset(b, t), grad.at);
        if (err != cudaSuccess) return err;
      }
    }
    return cudaGetLastError();
  };
  return head.cap.on() ? go(two_pass_kernel<T, true>) : go(two_pass_kernel<T, false>);
}

// scale_grad_: every block reads the incoming gradient and leaves at once when it is the assumed one.
constexpr int kScaleThreads = 256;
constexpr int64_t kScaleMaxBlocks = 4096;  // a grid-stride loop covers the rest

template <typename T, typename S>
__global__ void __launch_bounds__(kScaleThreads)
    scale_grad_kernel(T* grad, int64_t n, const S* __restrict__ incoming, S assumed_rounded, double assumed) {
  const S g = *incoming;
  if (g == assumed_rounded) return;
  const float ratio = static_cast<float>(static_cast<double>(g) / assumed);  // as scale_grad_cpu rounds it
  using P = Pack<T>;
  constexpr int K = P::kElems;
  const int64_t head = rows::min64(n, rows::lead_elems(grad)), packs = (n - head) / K, done = head + packs * K;
  const int64_t first = int64_t(blockIdx.x) * kScaleThreads + threadIdx.x, stride = int64_t(gridDim.x) * kScaleThreads;
  if (first < head) grad[first] = P::from_float(P::to_float(grad[first]) * ratio);
  if (first < n - done) grad[done + first] = P::from_float(P::to_float(grad[done + first]) * ratio);
  T* body = grad + head;
  for (int64_t i = first; i < packs; i += stride) {
    float x[K];
    P::load(body + i * K, x);
#pragma unroll
    for (int e = 0; e < K; ++e) x[e] *= ratio;
    P::store(body + i * K, x);
  }
}

template <typename T, typename S>
cudaError_t launch_scale(T* grad, int64_t n, const S* incoming, double assumed, cudaStream_t stream) {
  const int64_t packs = n / Pack<T>::kElems + 1;
  const int64_t blocks = std::min<int64_t>((packs + kScaleThreads - 1) / kScaleThreads, kScaleMaxBlocks);
  scale_grad_kernel<T, S><<<static_cast<unsigned>(blocks), kScaleThreads, 0, stream>>>(
      grad, n, incoming, static_cast<S>(assumed), assumed);
  return cudaGetLastError();
}

template <typename T>
cudaError_t scale_as(T* grad, int64_t n, const void* incoming, bool fp64, double assumed, cudaStream_t stream) {
  if (fp64) return launch_scale(grad, n, static_cast<const double*>(incoming), assumed, stream);
  return launch_scale(grad, n, static_cast<const float*>(incoming), assumed, stream);
}

}  // namespace

int two_pass_cluster_size(int64_t v, Dtype dtype) {
  return cluster::plan(v, dtype == Dtype::kFloat32 ? 4 : 2).cluster;
}

cudaError_t two_pass_active_clusters(int64_t v, Dtype dtype, int* clusters) {
  switch (dtype) {
    case Dtype::kFloat32: return active_clusters<float>(v, clusters);
    case Dtype::kBFloat16: return active_clusters<__nv_bfloat16>(v, clusters);
    case Dtype::kFloat16: return active_clusters<__half>(v, clusters);
  }
  return cudaErrorInvalidValue;
}

cudaError_t policy_token_fwd_grad(const Rows& logits, const int64_t* targets, const Head& head, const TokenInputs& in,
                                  const rlk::TokenLossParams<float>& params, const TwoPassArgs& args, const Rows& grad,
                                  cudaStream_t stream) {
  if (logits.n == 0) return cudaSuccess;
  if (logits.v <= 0 || logits.at.seq_len <= 0 || grad.n != logits.n || grad.v != logits.v ||
      grad.dtype != logits.dtype || grad.at.seq_len != logits.at.seq_len) {
    return cudaErrorInvalidValue;
  }
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  if (major < 9) return cudaErrorNotSupported;
  const cluster::TwoPassRow epilogue{in, params, args};
  switch (logits.dtype) {
    case Dtype::kFloat32: return launch_two_pass<float>(logits, targets, head, epilogue, grad, stream);
    case Dtype::kBFloat16: return launch_two_pass<__nv_bfloat16>(logits, targets, head, epilogue, grad, stream);
    case Dtype::kFloat16: return launch_two_pass<__half>(logits, targets, head, epilogue, grad, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t scale_grad(void* grad, int64_t n, Dtype dtype, const void* incoming, bool fp64, double assumed,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case Dtype::kFloat32: return scale_as(static_cast<float*>(grad), n, incoming, fp64, assumed, stream);
    case Dtype::kBFloat16: return scale_as(static_cast<__nv_bfloat16*>(grad), n, incoming, fp64, assumed, stream);
    case Dtype::kFloat16: return scale_as(static_cast<__half*>(grad), n, incoming, fp64, assumed, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rlk_cuda
