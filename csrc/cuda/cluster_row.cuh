// The phases of the two-pass row on sm_90 (policy_token_two_pass.cu; docs/design.md §2, §7): a row held in the
// shared memory of the C blocks of a thread-block cluster (C = 1: one block, no cluster), read once from global
// memory and its gradient written once. Per block `rank` of C, per thread `lane` of kThreads:
//   1. load_slice: the block's slice of 16-byte packs from global into shared memory (evict-first loads: the
//      row's last read from global memory but for its first and last few elements), and the thread's online
//      softmax state over its elements (the block reduces them to its partial; block 0 also takes the elements
//      before the row's first 16-byte boundary, block C − 1 those after its last, from global memory);
//   2. merge_level: after a cluster barrier, lane i of warp 0 reads partial i through distributed shared
//      memory and the warp merges them in a fixed tree of rank order, so that every block holds the same
//      (m, s, u), and the target's logit;
//   3. TwoPassRow: the row's results and the token's loss (rlkernels/token_loss.h), stored by rank 0 only, and
//      the gradient's coefficients at scale·(its derivatives), as the CPU two-pass row takes them;
//   4. store_slice_grad: ∂z of the slice from shared memory (the first and last elements again from global),
//      16-byte evict-first stores where the output is aligned as the logits are; the target's term by the thread
//      that owns it.
// __host__ __device__ and torch-free: csrc/tests/test_cluster_row.cu runs every block's phase for every lane in
// turn, with the barriers between the phases, on the host.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "row_pass.cuh"

namespace rlk_cuda {
namespace cluster {

using rows::Pack;
using rows::State;

constexpr int kThreads = 512;  // per block; 3 blocks per SM (kBlocksPerSm) hold 1536 threads
constexpr int kBlocksPerSm = 3;
constexpr int kMaxCluster = 8;  // the portable maximum
// Dynamic shared memory per block: a third of an sm_90 SM's 228 KB (77824 bytes) less the 1 KB the driver reserves
// per block and 512 bytes for the kernel's static shared memory (its partial, its row's results and the block
// reduction's scratch: 272 bytes), so that kBlocksPerSm blocks fit an SM whatever the row. It holds a 151936-logit
// row in 4 blocks in bf16/fp16 and in 8 in fp32 (75968 bytes each).
constexpr int64_t kSliceBudget = 77824 - 1024 - 512;

// The cluster size a row of V elements of `elem_bytes` takes (the smallest C ∈ {1, 2, 4, 8} whose slice fits
// kSliceBudget; 0 when none does), and the shared memory per block that size asks.
struct Plan {
  int cluster;
  int64_t slice_bytes;
};
RLK_HOST_DEVICE inline Plan plan(int64_t V, int elem_bytes) {
  const int64_t packs = V * elem_bytes / 16;  // at least any row's whole packs, whatever its alignment
  for (int c = 1; c <= kMaxCluster; c *= 2) {
    const int64_t bytes = (packs + c - 1) / c * 16;
    if (bytes <= kSliceBudget) return Plan{c, bytes};
  }
  return Plan{0, 0};
}

// How a row is cut among the C blocks: the `head` elements before its first 16-byte boundary (block 0, one per
// lane), `packs` 16-byte packs from there, `per_block` of them to each block in rank order (the last may hold
// fewer, or none), and the tail from `done` to V (block C − 1, one per lane).
struct Slices {
  int clusters;
  int64_t head, packs, per_block, done;
  RLK_HOST_DEVICE int64_t first(int rank) const { return rows::min64(int64_t(rank) * per_block, packs); }
  RLK_HOST_DEVICE int64_t count(int rank) const { return rows::min64(first(rank) + per_block, packs) - first(rank); }
};

template <typename T>
RLK_HOST_DEVICE inline Slices slices(const T* z, int64_t V, int C) {
  constexpr int K = Pack<T>::kElems;
  const int64_t head = rows::min64(V, rows::lead_elems(z)), packs = (V - head) / K;
  return Slices{C, head, packs, (packs + C - 1) / C, head + packs * K};
}

// The block and the thread that own element y of the row (its logit, its gradient): rank −1 for a y outside
// [0, V) (the row's log-prob is then NaN, as in the 3-pass kernels).
struct Owner {
  int rank, lane;
};
template <typename T, int kThreadsT>
RLK_HOST_DEVICE inline Owner owner(const Slices& s, int64_t V, int64_t y) {
  constexpr int K = Pack<T>::kElems;
  if (y < 0 || y >= V) return Owner{-1, -1};
  if (y < s.head) return Owner{0, static_cast<int>(y)};
  if (y >= s.done) return Owner{s.clusters - 1, static_cast<int>(y - s.done)};
  const int64_t k = (y - s.head) / K, rank = k / s.per_block;
  return Owner{static_cast<int>(rank), static_cast<int>((k - rank * s.per_block) % kThreadsT)};
}

// A block's partial: its elements' softmax state, and in the target's block the target's raw logit; 16 bytes,
// one distributed-shared-memory load.
struct alignas(16) Partial {
  State st;
  float z_y;
};

// Phase 1, thread `lane` of block `rank`: packs lane, lane + kThreads, ... of the block's slice, loaded together
// a step at a time (rows::kFwdStep elements), each stored at its index in `slice` (the block's shared memory) and
// added to the thread's state (capped under kCap); block 0's thread `lane` also takes head element `lane`, block
// C − 1's tail element `lane`.
template <typename T, int kThreadsT, bool kCap>
RLK_HOST_DEVICE __forceinline__ State load_slice(const T* z, int64_t V, const Head& hd, const Slices& s, int rank,
                                                 int lane, uint4* slice) {
  using P = Pack<T>;
  constexpr int kN = rows::kFwdStep<kCap>, K = P::kElems, kUnroll = kN / K;
  rows::Online<true> acc{hd.inv_tau};
  auto one = [&](int64_t v) {
    const float x[1] = {rows::head_logit<kCap>(hd, P::to_float(z[v]))};
    acc.add(x);
  };
  if (rank == 0 && lane < s.head) one(lane);
  if (rank == s.clusters - 1 && lane < V - s.done) one(s.done + lane);
  const uint4* body = reinterpret_cast<const uint4*>(z + s.head) + s.first(rank);
  const int64_t n = s.count(rank);
  auto step = [&](int64_t i, auto full) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {  // the loads first, issued together
      const int64_t k = i + int64_t(j) * kThreadsT;
      if (decltype(full)::value || k < n) raw[j] = rows::load16_stream(body + k);
    }
    float x[kN];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t k = i + int64_t(j) * kThreadsT;
      if (decltype(full)::value || k < n) {
        slice[k] = raw[j];
        P::unpack(raw[j], x + j * K);
      } else {
#pragma unroll
        for (int e = 0; e < K; ++e) x[j * K + e] = rlk::neg_inf<float>();
      }
    }
#pragma unroll
    for (int e = 0; e < kN; ++e) x[e] = rows::head_logit<kCap>(hd, x[e]);
    acc.add(x);
  };
  int64_t i = lane;
  for (; i + int64_t(kUnroll - 1) * kThreadsT < n; i += int64_t(kThreadsT) * kUnroll) step(i, std::true_type());
  if (i < n) step(i, std::false_type());
  return acc.st;
}

// Phase 2, on the lanes of warp 0: lane i < C holds block i's partial (on the
// device read through distributed shared memory, the C reads at once), and at level d = 1, 2, 4 lane i with
// i % 2d = 0 and i + d < C merges lane i + d's state into its own, the lower rank on the left. Lane 0 ends with
// ((p0 p1)(p2 p3))((p4 p5)(p6 p7)): the rank-order fold regrouped (the same merges, log2 C deep rather than
// C − 1), the same bits in every block.
RLK_HOST_DEVICE __forceinline__ State merge_level(const State& mine, const State& down, int lane, int d, int C,
                                                  float inv_tau) {
  return (lane & (2 * d - 1)) == 0 && lane + d < C ? rlk::softmax_merge(mine, down, inv_tau) : mine;
}

// Phase 3: the row's results and the token's loss; rank 0 stores them (logp, entropy, stats: the two-pass op's
// outputs) and every block takes the gradient's coefficients, rlk::two_pass_coeffs as the CPU row takes them.
struct TwoPassRow {
  TokenInputs in;
  rlk::TokenLossParams<float> params;
  TwoPassArgs args;
  RLK_HOST_DEVICE __forceinline__ rlk::GradCoeffs<float> operator()(int64_t row, const rlk::RowResult<float>& r,
                                                                   float inv_tau, bool store) const {
    const rlk::TokenOut<float> t = rlk::token_loss(in.at(row, r.logp, r.entropy), params);
    if (store) {
      args.logp[row] = r.logp;
      args.entropy[row] = r.entropy;
#pragma unroll
      for (int j = 0; j < rlk::kNumStats; ++j) args.stats[row * rlk::kNumStats + j] = t.stats[j];
    }
    return rlk::two_pass_coeffs<float>(t.grad_logp, t.grad_entropy,
                                       args.entropy_grad != nullptr ? args.entropy_grad + row : nullptr,
                                       params.entropy_coef != 0.0f, r.entropy, args.scale, inv_tau);
  }
};

// Phase 4, thread `lane` of block `rank`: ∂z of the elements it loaded in phase 1, the packs from `slice`, into
// `out` (16-byte stores when `vec`: out aligned as z; else element by element); the head and tail elements read
// again from z, each before the same thread writes it (out may be z). The target's owner writes the target last.
template <typename T, int kThreadsT, typename Grad>
RLK_HOST_DEVICE __forceinline__ void store_slice_grad(const T* z, T* out, int64_t V, const Slices& s, int rank,
                                                      int lane, const uint4* slice, const Grad& grad, Owner target,
                                                      float z_y, bool vec) {
  using P = Pack<T>;
  constexpr int K = P::kElems;
  auto one = [&](int64_t v) { out[v] = P::from_float(grad.of(P::to_float(z[v]), false)); };
  if (rank == 0 && lane < s.head) one(lane);
  if (rank == s.clusters - 1 && lane < V - s.done) one(s.done + lane);
  const int64_t first = s.first(rank), n = s.count(rank);
  T* ob = out + s.head + first * K;
  auto grads = [&](int64_t i, float* x) {
    P::unpack(slice[i], x);
#pragma unroll
    for (int e = 0; e < K; ++e) x[e] = grad.of(x[e], false);
  };
  if (vec) {  // two loops, not a branch in one: the aligned loop stays free of the other's 8 narrow stores
#pragma unroll 2
    for (int64_t i = lane; i < n; i += kThreadsT) {
      float x[K];
      grads(i, x);
      rows::store16_stream(ob + i * K, P::pack(x));
    }
  } else {
#pragma unroll 2
    for (int64_t i = lane; i < n; i += kThreadsT) {
      float x[K];
      grads(i, x);
#pragma unroll
      for (int e = 0; e < K; ++e) ob[i * K + e] = P::from_float(x[e]);
    }
  }
  if (target.rank == rank && target.lane == lane) out[grad.target] = P::from_float(grad.of(z_y, true));
}

}  // namespace cluster
}  // namespace rlk_cuda
