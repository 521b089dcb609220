// The two-pass cluster kernel's phases (csrc/cuda/cluster_row.cuh) run on the host, without a GPU: for each
// simulated block of a cluster of C ∈ {1, 2, 4, 8}, every one of its 512 lanes in turn runs phase 1 (the slice
// into that block's "shared memory", the lanes' states merged into the block's partial); then, past the
// "barrier", every block runs phase 2 (a warp's tree merge of the partials, its lanes in lockstep) and phase 3;
// then every lane of every block phase 4. Against a double-precision reference (the row's m, log s, log-prob,
// entropy and, from the token's derivatives in double, every element's gradient), for fp32/bf16/fp16, rows
// aligned or not and of odd V, a cap, −inf entries, the target in the head, the tail or any block's packs, NaN
// and all −inf rows, a target outside [0, V), the gradient into another buffer, one aligned differently and the
// logits themselves. Phase 2 must give every block the same bits: the pairwise tree of the partials in rank
// order, equal to their serial left fold up to rounding. Also the cluster size of plan().
//
//   nvcc -O2 -std=c++17 -Icsrc/include -Icsrc/cuda csrc/tests/test_cluster_row.cu -o /tmp/t && /tmp/t
// (python_tests/test_cuda_compile.py builds and runs it when nvcc exists.)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cluster_row.cuh"
#include "host_rows.h"

using namespace rlk_cuda;
using cluster::kThreads;
using rows::Pack;
using rows::State;

namespace {

int failures = 0;

void fail(const char* what, const char* dtype, int C, long V, int offset, long v, double got, double want) {
  if (++failures <= 20) {
    std::printf("FAIL %s: %s, cluster %d, V=%ld, offset %d, element %ld: got %.9g, want %.9g\n", what, dtype, C, V,
                offset, v, got, want);
  }
}

using host_rows::Buffer;
using host_rows::name;
using host_rows::tiny;
using host_rows::ulp;

// Phase 2 as warp 0 runs it on the device, its 32 lanes in lockstep: lane i < C holds block i's partial (the others
// the empty state), at each level every lane reads lane i + d's state as __shfl_down_sync gives it (its own past
// lane 31) before any lane merges, and the target's logit comes from the lane of the target's block.
cluster::Partial warp_merge(int C, int target_rank, float inv_tau, const std::vector<cluster::Partial>& parts) {
  State st[32];
  for (int lane = 0; lane < 32; ++lane) st[lane] = lane < C ? parts[lane].st : rlk::softmax_init<float>();
  for (int d = 1; d < C; d *= 2) {
    State down[32];
    for (int lane = 0; lane < 32; ++lane) down[lane] = st[lane + d < 32 ? lane + d : lane];
    for (int lane = 0; lane < 32; ++lane) st[lane] = cluster::merge_level(st[lane], down[lane], lane, d, C, inv_tau);
  }
  return cluster::Partial{st[0], target_rank >= 0 ? parts[target_rank].z_y : NAN};
}

// The order phase 2 must merge in, written out independently of merge_level: the partials [lo, hi) split at the
// largest power of two below hi − lo ((p0 p1)(p2 p3)) for C = 4, the lower half on the left.
State pairwise_tree(const std::vector<cluster::Partial>& parts, int lo, int hi, float inv_tau) {
  if (hi - lo == 1) return parts[lo].st;
  int half = 1;
  while (2 * half < hi - lo) half *= 2;
  return rlk::softmax_merge(pairwise_tree(parts, lo, lo + half, inv_tau), pairwise_tree(parts, lo + half, hi, inv_tau),
                            inv_tau);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// One token's loss inputs (row 0 of one-element arrays) and the loss: PPO's clip with a k3 KL term and an entropy
// bonus inside the loss (entropy_coef), or none (`h_kind` 1), or one given apart (`h_kind` 2: entropy_grad).
struct Token {
  bool mask = true;
  float weight = 0.37f, adv = -0.8f, old_logp = -1.3f, ref_logp = -1.1f, bonus = -0.02f;
  rlk::TokenLossParams<float> params{rlk::kClip, 0.2f, 0.28f, INFINITY, 3.0f, rlk::kKlK3, 0.1f, INFINITY, false,
                                     0.01f, 20.0f};
  float logp_out = 7.0f, entropy_out = 7.0f, stats_out[rlk::kNumStats] = {};
  cluster::TwoPassRow epilogue(int h_kind, float scale) {
    if (h_kind == 1) params.entropy_coef = 0.0f;
    return cluster::TwoPassRow{TokenInputs{&mask, &weight, &adv, &old_logp, &ref_logp}, params,
                               TwoPassArgs{h_kind == 2 ? &bonus : nullptr, scale, &logp_out, &entropy_out, stats_out}};
  }
  // (g, h) of the token in double at the row's reference log-prob and entropy, before the scale.
  void derivatives(double logp, double H, int h_kind, double& g, double& h) const {
    rlk::TokenLossParams<double> p{params.objective, params.clip_low, params.clip_high, INFINITY, params.dual_clip,
                                   params.kl_estimator, params.kl_coef, INFINITY, false, params.entropy_coef,
                                   params.log_ratio_clamp};
    const rlk::TokenOut<double> t =
        rlk::token_loss(rlk::TokenIn<double>{logp, H, true, weight, adv, true, old_logp, true, ref_logp}, p);
    g = t.grad_logp;
    h = h_kind == 2 ? bonus : t.grad_entropy;
  }
};

// The whole cluster on one row, phase by phase; checked against the reference.
template <typename T, bool kCap>
void check(long V, int offset, int C, int pattern, int where, int h_kind, int out_mode, std::mt19937& rng) {
  const float tau = 0.7f, inv_tau = 1.0f / tau, scale = h_kind == 0 ? 1.0f : 0.375f;
  const Head hd{inv_tau, rlk::soft_cap<float>(kCap ? 10.0 : 0.0)};
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Buffer<T> buf(V, offset);
  T* z = buf.row;
  const cluster::Slices s = cluster::slices(z, V, C);
  constexpr int K = Pack<T>::kElems;
  // the target: random, the first element (a head element unless aligned), the last (the tail, if any), the first
  // pack of block `where % C`, or outside [0, V)
  long target = static_cast<long>(rng() % V);
  if (where == 1) target = 0;
  if (where == 2) target = V - 1;
  const int block = static_cast<int>(rng() % C);
  if (where == 3 && s.count(block) > 0) target = s.head + (s.first(block) + rng() % s.count(block)) * K + rng() % K;
  if (where == 4) target = V;
  std::vector<double> zs(V), slope(V, 1.0);
  for (long v = 0; v < V; ++v) {
    float x = normal(rng) + (pattern == 3 ? (sizeof(T) == 4 ? 1e5f : 1e3f) : 0.0f);
    if (kCap) x = v != target && rng() % 4 == 0 ? -INFINITY : 5.0f * x;
    if (pattern == 1 && v != target && rng() % 2 == 0) x = -INFINITY;
    if (pattern == 2 && v != target) x = -INFINITY;
    if (pattern == 6 && v == (V - 1) / 2) x = NAN;
    if (pattern == 7) x = -INFINITY;
    z[v] = Pack<T>::from_float(x);
    zs[v] = Pack<T>::to_float(z[v]);
    if (kCap && zs[v] != -INFINITY) {
      const double t = std::tanh(zs[v] / 10.0);
      zs[v] = 10.0 * t;
      slope[v] = 1.0 - t * t;
    }
  }
  const char* dt = name<T>();
  // the reference; the token near its old and reference log-probs (ratios near 1, as in training)
  double m = -INFINITY;
  bool nan = false;
  for (long v = 0; v < V; ++v) {
    m = std::fmax(m, zs[v]);
    nan = nan || std::isnan(zs[v]);
  }
  double se = 0, sx = 0;
  for (long v = 0; v < V; ++v) {
    const double d = (zs[v] - m) * inv_tau, e = std::exp(d);
    se += e;
    if (e > 0) sx += e * d;
  }
  const double log_s = std::log(se), H = log_s - sx / se;
  const double logp = target < V ? (zs[target] - m) * inv_tau - log_s : NAN;
  Token token;
  if (std::isfinite(logp)) {
    token.old_logp = static_cast<float>(logp + 0.15);
    token.ref_logp = static_cast<float>(logp - 0.1);
  }
  const cluster::Owner owner = cluster::owner<T, kThreads>(s, V, target);

  // Phase 1, every block, every lane; the lanes' states merged as the block's reduction does (in another order).
  std::vector<std::vector<uint4>> smem(C, std::vector<uint4>(s.per_block + 1));
  std::vector<cluster::Partial> parts(C);
  for (int rank = 0; rank < C; ++rank) {
    State st = rlk::softmax_init<float>();
    for (int lane = 0; lane < kThreads; ++lane) {
      st = rlk::softmax_merge(st, cluster::load_slice<T, kThreads, kCap>(z, V, hd, s, rank, lane, smem[rank].data()),
                              inv_tau);
    }
    parts[rank] = cluster::Partial{st, rank == owner.rank ? Pack<T>::to_float(z[target]) : 12345.0f};
  }
  for (int rank = 0; rank < C; ++rank) {  // each block's shared memory holds its packs as they were
    if (std::memcmp(smem[rank].data(), z + s.head + s.first(rank) * K, s.count(rank) * 16) != 0) {
      fail("slice in shared memory", dt, C, V, offset, rank, 0, 0);
    }
  }
  // --- barrier: phases 2 and 3 in every block
  const State tree = pairwise_tree(parts, 0, C, inv_tau);
  State fold = parts[0].st;  // the serial rank-order fold the warp's tree regroups
  for (int r = 1; r < C; ++r) fold = rlk::softmax_merge(fold, parts[r].st, inv_tau);
  if (!nan && pattern != 7 && !(std::fabs(tree.s - fold.s) <= 1e-6f * fold.s && tree.m == fold.m &&
                                std::fabs(tree.u - fold.u) <= 1e-5f * (std::fabs(fold.u) + fold.s))) {
    fail("merge: the tree is not the serial fold up to rounding", dt, C, V, offset, -1, tree.s, fold.s);
  }
  std::vector<rlk::RowResult<float>> res(C);
  std::vector<rlk::GradCoeffs<float>> coeffs(C);
  std::vector<float> z_y(C);
  float stored_logp = 0, stored_entropy = 0;
  for (int rank = 0; rank < C; ++rank) {
    const cluster::Partial all = warp_merge(C, owner.rank, inv_tau, parts);
    if (!same_bits(all.st.m, tree.m) || !same_bits(all.st.s, tree.s) || !same_bits(all.st.u, tree.u)) {
      fail("merge: not the pairwise rank-order tree of the partials", dt, C, V, offset, rank, all.st.s, tree.s);
    }
    res[rank] = rlk::softmax_finalize(all.st, rows::head_logit<kCap>(hd, all.z_y), inv_tau);
    coeffs[rank] = token.epilogue(h_kind, scale)(0, res[rank], inv_tau, rank == 0);
    if (rank == 0) {  // only rank 0 stores: a later rank's store would show in logp_out
      stored_logp = token.logp_out;
      stored_entropy = token.entropy_out;
      token.logp_out = 7.0f;
    }
    z_y[rank] = all.z_y;
  }
  if (token.logp_out != 7.0f) fail("a rank other than 0 stored the row", dt, C, V, offset, -1, token.logp_out, 7);

  const rlk::RowResult<float>& r = res[0];
  const bool nan_row = nan || pattern == 7 || target >= V;
  auto close = [](double got, double want) { return std::fabs(got - want) <= 1e-5 * std::fmax(1.0, std::fabs(want)); };
  if (nan_row) {
    if (!std::isnan(r.logp)) fail("NaN log-prob", dt, C, V, offset, target, r.logp, NAN);
    if ((nan || pattern == 7) && !std::isnan(r.entropy)) fail("NaN entropy", dt, C, V, offset, -1, r.entropy, NAN);
  } else {
    if (!close(r.m, m)) fail("m", dt, C, V, offset, -1, r.m, m);
    if (!close(r.log_s, log_s)) fail("log s", dt, C, V, offset, -1, r.log_s, log_s);
    if (!close(r.logp, logp) || r.logp > 0) fail("logp", dt, C, V, offset, target, r.logp, logp);
    if (!close(r.entropy, H)) fail("entropy", dt, C, V, offset, -1, r.entropy, H);
    if (!same_bits(stored_logp, r.logp) || !same_bits(stored_entropy, r.entropy)) {
      fail("stored logp", dt, C, V, offset, -1, stored_logp, r.logp);
    }
  }
  for (int rank = 1; rank < C; ++rank) {
    if (!same_bits(coeffs[rank].A, coeffs[0].A) || !same_bits(coeffs[rank].B, coeffs[0].B) ||
        !same_bits(coeffs[rank].target, coeffs[0].target) || !same_bits(res[rank].log_s, r.log_s)) {
      fail("blocks disagree on the row", dt, C, V, offset, rank, coeffs[rank].A, coeffs[0].A);
    }
  }

  // Phase 4, every block, every lane: into another buffer aligned as z (16-byte stores), one aligned differently
  // (element by element), or z itself.
  Buffer<T> other(V, out_mode == 1 ? offset + 1 : offset);
  T* out = out_mode == 2 ? z : other.row;
  const T sentinel = Pack<T>::from_float(12345.0f);
  if (out_mode != 2) {
    for (long v = -1; v < V + 9; ++v) out[v] = sentinel;
  }
  const bool vec = (reinterpret_cast<uintptr_t>(z) & 15) == (reinterpret_cast<uintptr_t>(out) & 15);
  for (int rank = 0; rank < C; ++rank) {
    const rows::GradOf<kCap> grad{res[rank].m, res[rank].log_s, hd, coeffs[rank],
                                  static_cast<int>(owner.rank >= 0 ? target : -1)};
    for (int lane = 0; lane < kThreads; ++lane) {
      cluster::store_slice_grad<T, kThreads>(z, out, V, s, rank, lane, smem[rank].data(),
                                             grad, owner, z_y[rank], vec);
    }
  }
  if (out_mode != 2) {
    for (long v : {-1L, V, V + 8}) {
      if (std::memcmp(&out[v], &sentinel, sizeof(T)) != 0) fail("write outside the row", dt, C, V, offset, v, 0, 0);
    }
  }
  double g = 0, h = 0;
  if (!nan_row) token.derivatives(logp, H, h_kind, g, h);
  g *= scale;
  h *= scale;
  for (long v = 0; v < V; ++v) {
    const double got = Pack<T>::to_float(out[v]);
    if (nan_row) {  // NaN where the row is (a target outside [0, V): its g is NaN, so every element)
      if (!std::isnan(got)) fail("grad of a NaN row", dt, C, V, offset, v, got, NAN);
      continue;
    }
    const double lp = (zs[v] - m) * inv_tau - log_s, p = std::exp(lp);
    const double plogp = p > 0 ? p * (lp + H) : 0.0;
    const double want = (g * ((v == target) - p) - h * plogp) / tau * slope[v];
    const double size = (std::fabs(g) * ((v == target) + p) + std::fabs(h) * (p > 0 ? p * (std::fabs(lp) + H) : 0)) / tau;
    if (!(std::fabs(got - want) <= 1e-5 * size + ulp<T>() * std::fabs(want) + tiny<T>())) {
      fail("grad", dt, C, V, offset, v, got, want);
    }
  }
}

template <typename T>
void sweep(std::mt19937& rng) {
  int turn = 0;
  for (long V : {1L, 3L, 7L, 8L, 9L, 33L, 100L, 1000L, 4099L, 20011L}) {
    for (int offset : {0, 1, 3}) {
      for (int C : {1, 2, 4, 8}) {
        for (int pattern : {0, 1, 2, 3, 5, 6, 7}) {
          ++turn;
          const int where = turn % 5, h_kind = turn % 3, out_mode = (turn / 3) % 3;
          if (pattern == 5) {
            check<T, true>(V, offset, C, pattern, where, h_kind, out_mode, rng);
          } else {
            check<T, false>(V, offset, C, pattern, where, h_kind, out_mode, rng);
          }
        }
      }
    }
  }
  // the vocabulary the kernel is for, at its cluster size (plan()) and one smaller and larger
  const long V = 151936;
  const int planned = cluster::plan(V, sizeof(T)).cluster;
  for (int C : {planned / 2, planned, 8}) {
    for (int offset : {0, 3}) {
      check<T, false>(V, offset, C, 0, turn++ % 4, 0, offset == 0 ? 2 : 0, rng);
      check<T, true>(V, offset, C, 5, turn++ % 4, 1, 1, rng);
    }
  }
}

// plan(): the smallest cluster whose slice fits the budget; none past 8 blocks.
void plans() {
  struct Want {
    long V;
    int bytes, cluster;
    long slice;
  } wants[] = {{151936, 2, 4, 75968}, {151936, 4, 8, 75968}, {32768, 2, 1, 65536}, {32768, 4, 2, 65536},
               {262144, 2, 8, 65536}, {262144, 4, 0, 0},     {1, 4, 1, 0},         {152576, 4, 8, 76288},
               {152584, 4, 0, 0}};
  for (const Want& w : wants) {
    const cluster::Plan p = cluster::plan(w.V, w.bytes);
    if (p.cluster != w.cluster || p.slice_bytes != w.slice) {
      fail("plan (cluster, then slice bytes)", w.bytes == 4 ? "float32" : "16-bit", p.cluster, w.V, 0, p.slice_bytes,
           p.cluster, w.cluster);
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(4321);
  plans();
  sweep<float>(rng);
  sweep<__nv_bfloat16>(rng);
  sweep<__half>(rng);
  if (failures) {
    std::printf("test_cluster_row: %d failures\n", failures);
    return 1;
  }
  std::printf("test_cluster_row: ok\n");
  return 0;
}
