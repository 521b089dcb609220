// The CUDA kernels' per-row code (csrc/cuda/row_pass.cuh) run on the host, without a GPU: every
// lane of a group in turn, the lanes' forward states merged with rlk::softmax_merge (as cub's
// reduction does, in another order), against a double-precision reference. Covers the partition of
// a row among the lanes (head elements, 16-byte packs in full and partial steps, tail), for every
// dtype and group size the kernels use, rows aligned or not, large logits (where the saved (m, log s)
// must not be rounded to m + log s), and the backward in place, into another buffer, and into one
// aligned differently (the element-by-element path), and the rows of a (B, T, V) view found by the batch stride
// (rlk::RowIndex). Also the
// per-token policy loss (rlkernels/token_loss.h): its derivatives against central differences of
// its value, for random parameters and inputs, and the epilogue that stores it for a row.
//
//   nvcc -O2 -std=c++17 -Icsrc/include -Icsrc/cuda csrc/tests/test_row_pass.cu -o /tmp/t && /tmp/t
// (python_tests/test_cuda_compile.py builds and runs it when nvcc exists.)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "row_pass.cuh"
#include "host_rows.h"

using namespace rlk_cuda::rows;
using rlk_cuda::Head;

namespace {

int failures = 0;

void fail(const char* what, const char* dtype, int threads, long V, int offset, long v, double got, double want) {
  if (++failures <= 20) {
    std::printf("FAIL %s: %s, %d threads, V=%ld, offset %d, element %ld: got %.9g, want %.9g\n", what, dtype, threads,
                V, offset, v, got, want);
  }
}

void fail_token(const char* what, int trial, double got, double want) {
  if (++failures <= 20) std::printf("FAIL %s, trial %d: got %.12g, want %.12g\n", what, trial, got, want);
}

using host_rows::Buffer;
using host_rows::name;
using host_rows::tiny;
using host_rows::ulp;

template <typename T, int kThreads, bool kCap>
void check(long V, int offset, std::mt19937& rng, int pattern) {
  const float tau = 0.7f, inv_tau = 1.0f / tau;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Buffer<T> buf(V, offset);
  T* z = buf.row;
  std::vector<float> zf(V);  // the values as stored in T
  const long target = static_cast<long>(rng() % V);
  // Pattern 3 shifts the logits to where ulp(m) ≫ the precision log p needs (1e3: bf16 and fp16 hold
  // no more). Pattern 4 puts them near the largest float (not fp16's): 2e38, with a few ties at 3e38
  // in the second half of the row, each raising some lane's max after many smaller terms (δ·s would
  // overflow there), and z/τ itself overflows: only differences may be scaled. Pattern 5 soft-caps
  // logits of scale 15 at c = 10 (many saturate), a quarter of them −inf (which stay −inf).
  const float shift = pattern == 3 ? (sizeof(T) == 4 ? 1e5f : 1e3f) : 0.0f;
  const Head head{inv_tau, rlk::soft_cap<float>(pattern == 5 ? 10.0 : 0.0)};
  std::vector<double> zs(V);  // the reference's logits (capped)
  std::vector<double> slope(V, 1.0);  // dy/dz
  for (long v = 0; v < V; ++v) {
    float x = normal(rng) + shift;
    if (pattern == 5) x = v != target && rng() % 4 == 0 ? -INFINITY : 5.0f * x;
    if (pattern == 1 && v != target && rng() % 2 == 0) x = -INFINITY;  // masked vocabulary entries
    if (pattern == 2 && v != target) x = -INFINITY;                     // only the target is left
    if (pattern == 4) x = v == V - 1 || (2 * v >= V && rng() % 16 == 0) ? 3e38f : 2e38f;
    z[v] = Pack<T>::from_float(x);
    zf[v] = Pack<T>::to_float(z[v]);
    zs[v] = zf[v];
    if (pattern == 5 && zf[v] != -INFINITY) {
      const double t = std::tanh(double(zf[v]) / 10.0);
      zs[v] = 10.0 * t;
      slope[v] = 1.0 - t * t;
    }
  }

  // Forward: every lane's state, merged.
  State st = rlk::softmax_init<float>();
  for (int lane = 0; lane < kThreads; ++lane) st = rlk::softmax_merge(st, thread_state<T, kThreads, true, kCap>(z, V, head, lane), inv_tau);
  const rlk::RowResult<float> r = rlk::softmax_finalize(st, head.cap.apply(zf[target]), inv_tau);
  State st0 = rlk::softmax_init<float>();
  for (int lane = 0; lane < kThreads; ++lane) st0 = rlk::softmax_merge(st0, thread_state<T, kThreads, false, kCap>(z, V, head, lane), inv_tau);
  const rlk::RowResult<float> r0 = rlk::softmax_finalize(st0, head.cap.apply(zf[target]), inv_tau);

  double m = -INFINITY;
  for (long v = 0; v < V; ++v) m = std::fmax(m, zs[v]);
  auto d = [&](long v) { return (zs[v] - m) * double(inv_tau); };
  double s = 0, sx = 0;
  for (long v = 0; v < V; ++v) {
    const double e = std::exp(d(v));
    s += e;
    if (e > 0) sx += e * d(v);
  }
  const double log_s = std::log(s), H = log_s - sx / s, logp = d(target) - log_s;
  const char* dt = name<T>();
  auto close = [](double got, double want) { return std::fabs(got - want) <= 1e-5 * std::fmax(1.0, std::fabs(want)); };
  if (!close(r.m, m)) fail("m", dt, kThreads, V, offset, -1, r.m, m);
  if (!close(r.log_s, log_s)) fail("log s", dt, kThreads, V, offset, -1, r.log_s, log_s);
  if (!close(r.logp, logp) || r.logp > 0) fail("logp", dt, kThreads, V, offset, -1, r.logp, logp);
  if (!close(r.entropy, H) || r.entropy < 0) fail("entropy", dt, kThreads, V, offset, -1, r.entropy, H);
  if (r0.m != r.m || r0.log_s != r.log_s || r0.logp != r.logp) {
    fail("logp without entropy", dt, kThreads, V, offset, -1, r0.logp, r.logp);
  }
  if (pattern == 2 && (r.logp != 0 || r.entropy != 0)) fail("single-entry row", dt, kThreads, V, offset, -1, r.logp, 0);

  // Backward from the kernel's own (m, log s) and H, into: another buffer aligned like z (packs), one
  // aligned differently (element by element), and z itself.
  const float g = 0.8f, h = -0.6f;
  const GradOf<kCap> grad{r.m, r.log_s, head, rlk::grad_coeffs<float>(g, h, r.entropy, inv_tau),
                          static_cast<int>(target)};
  const T sentinel = Pack<T>::from_float(12345.0f);
  for (int mode = 0; mode < 3; ++mode) {
    Buffer<T> out_buf(V, mode == 1 ? offset + 1 : offset);
    T* out = mode == 2 ? z : out_buf.row;
    if (mode != 2) {
      for (long v = -1; v < V + 9; ++v) out[v] = sentinel;
    }
    const bool vec = mode != 1;
    for (int lane = 0; lane < kThreads; ++lane) {
      if (vec) {
        grad_row<T, kThreads, true>(z, out, V, grad, lane);
      } else {
        grad_row<T, kThreads, false>(z, out, V, grad, lane);
      }
    }
    static const char* what[] = {"grad (packs)", "grad (element by element)", "grad (in place)"};
    for (long v = 0; v < V; ++v) {
      const double lp = (zs[v] - double(r.m)) * double(inv_tau) - double(r.log_s), p = std::exp(lp);
      const double plogp = p > 0 ? p * (lp + double(r.entropy)) : 0.0;
      const double want = (g * ((v == target) - p) - h * plogp) / tau * slope[v];
      const double scale = (std::fabs(g) * ((v == target) + p) + std::fabs(h) * (p > 0 ? p * (std::fabs(lp) + r.entropy) : 0)) / tau;
      const double got = Pack<T>::to_float(out[v]);
      if (!(std::fabs(got - want) <= 1e-5 * scale + ulp<T>() * std::fabs(want) + tiny<T>())) {
        fail(what[mode], dt, kThreads, V, offset, v, got, want);
      }
    }
    if (mode != 2) {
      for (long v : {-1L, V, V + 8}) {
        if (Pack<T>::to_float(out[v]) != 12345.0f && std::memcmp(&out[v], &sentinel, sizeof(T)) != 0) {
          fail("write outside the row", dt, kThreads, V, offset, v, Pack<T>::to_float(out[v]), 12345.0);
        }
      }
    }
  }
}

template <typename T, int kThreads>
void sweep(std::mt19937& rng) {
  // V: smaller than a pack; one pack ± 1; a few steps with a partial last one; steps that fill
  // every lane exactly (16 · kThreads); odd sizes past that.
  const long vs[] = {1, 3, 7, 8, 9, 33, 100, 1000, 16L * kThreads, 16L * kThreads + 5, 4099, 20011};
  for (long V : vs) {
    for (int offset : {0, 1, 3}) {
      for (int pattern : {0, 1, 2, 3, 4, 5}) {
        if (pattern == 5) {  // the cap: the kernels' other template
          check<T, kThreads, true>(V, offset, rng, pattern);
        } else if (pattern != 4 || !std::is_same<T, __half>::value) {
          check<T, kThreads, false>(V, offset, rng, pattern);
        }
      }
    }
  }
}

template <typename T>
void nan_rows() {
  // A NaN among finite values, a NaN among −inf only, +inf, and −inf only: the row's results are NaN
  // (the contract, as log_softmax's), whichever element is the target.
  for (int which = 0; which < 4; ++which) {
    Buffer<T> buf(300, 1);
    for (long v = 0; v < 300; ++v) buf.row[v] = Pack<T>::from_float(which % 2 == 1 ? -INFINITY : float(v % 7));
    if (which < 3) buf.row[123] = Pack<T>::from_float(which == 2 ? INFINITY : NAN);
    State st = rlk::softmax_init<float>();
    for (int lane = 0; lane < 32; ++lane) st = rlk::softmax_merge(st, thread_state<T, 32, true, false>(buf.row, 300, Head{1.0f, rlk::soft_cap<float>(0.0)}, lane), 1.0f);
    const rlk::RowResult<float> r = rlk::softmax_finalize(st, Pack<T>::to_float(buf.row[0]), 1.0f);
    if (!std::isnan(r.logp) || !std::isnan(r.entropy)) fail("NaN row", name<T>(), 32, 300, 1, which, r.logp, NAN);
  }
}

// Rows of a (B, T, V) view of a (B, T + 1, V) parent (logits[:, :-1]), found by the kernels' rlk::RowIndex
// (a batch stride beside the row stride), against the same rows copied contiguous: the forward's results,
// and the backward written into a parent-shaped buffer (the last position of each sequence untouched) and
// into a (T, B, V) buffer seen as (B, T, V) (its rows' order transposed).
template <typename T, int kThreads>
void batch_stride_rows(std::mt19937& rng) {
  const long B = 3, Tn = 5, V = 37;  // V odd: the rows are aligned differently in turn
  const Head head{1.0f / 0.7f, rlk::soft_cap<float>(0.0)};
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<T> parent(B * (Tn + 1) * V), flat(B * Tn * V);
  for (auto& x : parent) x = Pack<T>::from_float(normal(rng));
  const rlk::RowIndex view{Tn, (Tn + 1) * V, V}, transposed{Tn, V, B * V};
  for (long n = 0; n < B * Tn; ++n) {
    std::memcpy(&flat[n * V], &parent[(n / Tn) * (Tn + 1) * V + (n % Tn) * V], V * sizeof(T));
  }
  const T sentinel = Pack<T>::from_float(12345.0f);
  std::vector<T> out_parent(parent.size(), sentinel), out_t(flat.size(), sentinel), out_flat(flat.size());
  const char* dt = name<T>();
  for (long n = 0; n < B * Tn; ++n) {
    const T* z = parent.data() + view(n);
    const T* zc = flat.data() + n * V;
    const long target = static_cast<long>(rng() % V);
    State st = rlk::softmax_init<float>(), stc = rlk::softmax_init<float>();
    for (int lane = 0; lane < kThreads; ++lane) {
      st = rlk::softmax_merge(st, thread_state<T, kThreads, true, false>(z, V, head, lane), head.inv_tau);
      stc = rlk::softmax_merge(stc, thread_state<T, kThreads, true, false>(zc, V, head, lane), head.inv_tau);
    }
    const rlk::RowResult<float> r = rlk::softmax_finalize(st, Pack<T>::to_float(z[target]), head.inv_tau);
    const rlk::RowResult<float> rc = rlk::softmax_finalize(stc, Pack<T>::to_float(zc[target]), head.inv_tau);
    auto close = [](double got, double want) { return std::fabs(got - want) <= 1e-6 * std::fmax(1.0, std::fabs(want)); };
    if (!close(r.logp, rc.logp) || !close(r.entropy, rc.entropy) || !close(r.m, rc.m) || !close(r.log_s, rc.log_s)) {
      fail("batch stride: forward", dt, kThreads, V, 0, n, r.logp, rc.logp);
    }
    const GradOf<false> grad{rc.m, rc.log_s, head, rlk::grad_coeffs<float>(0.8f, -0.6f, rc.entropy, head.inv_tau),
                             static_cast<int>(target)};
    for (int lane = 0; lane < kThreads; ++lane) {
      grad_row<T, kThreads, true>(z, out_parent.data() + view(n), V, grad, lane);
      grad_row<T, kThreads, false>(z, out_t.data() + transposed(n), V, grad, lane);
      grad_row<T, kThreads, true>(zc, out_flat.data() + n * V, V, grad, lane);
    }
  }
  double scale = 0;
  for (const T& x : out_flat) scale = std::fmax(scale, std::fabs(Pack<T>::to_float(x)));
  for (long n = 0; n < B * Tn; ++n) {
    for (long v = 0; v < V; ++v) {
      const double want = Pack<T>::to_float(out_flat[n * V + v]);
      for (const double got : {double(Pack<T>::to_float(out_parent[view(n) + v])),
                               double(Pack<T>::to_float(out_t[transposed(n) + v]))}) {
        if (!(std::fabs(got - want) <= 2 * ulp<T>() * std::fabs(want) + 1e-6 * scale)) {
          fail("batch stride: grad", dt, kThreads, V, 0, n * V + v, got, want);
        }
      }
    }
  }
  for (long b = 0; b < B; ++b) {  // the parent's last position of each sequence is not the view's
    for (long v = 0; v < V; ++v) {
      const T x = out_parent[(b * (Tn + 1) + Tn) * V + v];
      if (std::memcmp(&x, &sentinel, sizeof(T)) != 0) fail("batch stride: write outside the view", dt, kThreads, V, 0, v, 0, 0);
    }
  }
}

// The derivatives of token_loss (double) against central differences of its loss value, for random
// parameters (every objective and KL estimator of the generated rlkernels/token_loss_table.h, drawn up to its
// counts; every bound and KL option) and tokens. Where the loss holds a detached value (on-policy ℓ_old, CISPO's
// clamped weight, DPPO's capped weight and trust region, TOPR's truncated weight, GPPO's w/sg(w) on a token the
// clip holds, the KL bias correction's weight, low_var_kl+'s straight-through gradient) the gradient is not the
// derivative of the value; those are checked through identities that remove the detached value. A token within h
// of a kink shows as one-sided differences that disagree: it is skipped, and there must be few.
void token_loss_derivatives(std::mt19937& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double inf = INFINITY, h = 1e-6;
  auto pick = [&](double finite, double p_finite) { return unit(rng) < p_finite ? finite : inf; };
  auto close = [](double a, double b, double scale) { return std::fabs(a - b) <= 1e-12 * (scale + std::fabs(b)); };
  int checked = 0, skipped = 0;
  int drawn[rlk::kNumObjectives] = {}, estimators[rlk::kNumKlEstimators] = {};
  for (int trial = 0; trial < 6000; ++trial) {
    rlk::TokenLossParams<double> p;
    p.objective = static_cast<int>(rng() % rlk::kNumObjectives);
    p.clip_low = pick(0.1 + 0.2 * unit(rng), p.objective == rlk::kCispo ? 0.5 : 1.0);
    p.clip_high = pick(0.1 + 0.3 * unit(rng), p.objective == rlk::kCispo ? 0.5 : 1.0);
    p.delta = pick(1.5 + unit(rng), 0.5);
    p.dual_clip = pick(1.5 + unit(rng), 0.5);
    p.kl_estimator = static_cast<int>(rng() % rlk::kNumKlEstimators);
    p.kl_coef = p.kl_estimator == rlk::kKlNone ? 0.0 : 0.3 * unit(rng);
    p.kl_clamp = pick(0.05 + 0.3 * unit(rng), 0.5);
    p.kl_bias_correction = rng() % 2 == 0;
    p.entropy_coef = rng() % 2 == 0 ? 0.0 : 0.05 * normal(rng);
    p.log_ratio_clamp = rng() % 2 == 0 ? 20.0 : 0.3 + unit(rng);
    p.sapo_tau_pos = 0.5 + unit(rng);
    p.sapo_tau_neg = 0.5 + unit(rng);
    p.ratio_cap = pick(1.0 + unit(rng), 0.5);
    p.dro_beta = unit(rng);
    p.gppo_beta_low = 0.5 + unit(rng);
    p.gppo_beta_high = 0.5 + unit(rng);
    rlk::TokenIn<double> in;
    in.logp = -5.0 * unit(rng);
    in.entropy = 3.0 * unit(rng);
    in.mask = true;
    in.weight = 0.1 * unit(rng) + 1e-3;
    in.adv = normal(rng);
    in.has_old = rng() % 4 != 0;
    in.old_logp = in.logp - 2.4 * (unit(rng) - 0.5);
    in.has_ref = rng() % 2 == 0;
    in.ref_logp = in.logp + 3.0 * (unit(rng) - 0.5);
    // Clip-Cov's and KL-Cov's choice (KL-Cov: its penalty's coefficient); the other objectives never read it
    in.chosen = rng() % 2 == 0 ? 0.0 : 0.05 + unit(rng);
    ++drawn[p.objective];
    ++estimators[p.kl_estimator];
    const rlk::TokenOut<double> out = rlk::token_loss(in, p);
    const double scale = in.weight;

    if (!in.has_old) {  // on-policy: the off-policy loss at ℓ_old = ℓ
      rlk::TokenIn<double> off = in;
      off.has_old = true;
      off.old_logp = in.logp;
      const rlk::TokenOut<double> o = rlk::token_loss(off, p);
      if (o.grad_logp != out.grad_logp || o.stats[rlk::kStatLoss] != out.stats[rlk::kStatLoss]) {
        fail_token("token_loss on-policy", trial, out.grad_logp, o.grad_logp);
      }
      continue;
    }
    const bool kl_in_loss = in.has_ref && p.kl_estimator != rlk::kKlNone && p.kl_coef > 0;
    if (kl_in_loss && p.kl_bias_correction) {  // the KL term's value times w (its gradient, through w too, below)
      rlk::TokenLossParams<double> plain = p, no_kl = p;
      plain.kl_bias_correction = false;
      no_kl.kl_coef = 0;
      const rlk::TokenOut<double> a = rlk::token_loss(in, plain), b = rlk::token_loss(in, no_kl);
      const double w = out.stats[rlk::kStatRatio], got = out.stats[rlk::kStatLoss];
      const double base = b.stats[rlk::kStatLoss], kl = a.stats[rlk::kStatLoss] - base;
      if (!close(got, base + w * kl, scale)) fail_token("token_loss kl_bias_correction", trial, got, base + w * kl);
    }
    // REINFORCE's gradient with the advantage `adv` (a constant), the other terms as they are
    auto reinforce_grad = [&](double adv) {
      rlk::TokenLossParams<double> reinforce = p;
      reinforce.objective = rlk::kReinforce;
      rlk::TokenIn<double> scaled = in;
      scaled.adv = adv;
      return rlk::token_loss(scaled, reinforce).grad_logp;
    };
    const bool low_var_kl_plus = kl_in_loss && p.kl_estimator == rlk::kKlLowVarKlPlus;
    if (low_var_kl_plus) {
      // The value is k3's clamped to ±10; the gradient that of ½(ℓ − ℓ_ref)², which is k2's where Δ is not
      // clamped (|ℓ_ref − ℓ| ≤ c) and neither the KL clamp nor the bias correction (which reads the value) acts.
      rlk::TokenLossParams<double> k3 = p, k2 = p;
      k3.kl_estimator = rlk::kKlK3;
      k3.kl_clamp = std::fmin(p.kl_clamp, rlk::kLowVarKlBound);
      const double want = rlk::token_loss(in, k3).stats[rlk::kStatLoss];
      if (!close(out.stats[rlk::kStatLoss], want, scale)) fail_token("token_loss low_var_kl+ value", trial, out.stats[rlk::kStatLoss], want);
      k2.kl_estimator = rlk::kKlK2;
      if (!p.kl_bias_correction && p.kl_clamp == inf && std::fabs(in.ref_logp - in.logp) <= p.log_ratio_clamp) {
        const double grad = rlk::token_loss(in, k2).grad_logp;
        if (!close(out.grad_logp, grad, scale)) fail_token("token_loss low_var_kl+ gradient", trial, out.grad_logp, grad);
      }
    }
    if (p.objective == rlk::kTopr) {  // REINFORCE, with the advantage times the weight truncated at 1 where A < 0
      const double w = out.stats[rlk::kStatRatio];
      const double grad = reinforce_grad(in.adv < 0 ? rlk::clamp_(w, 0.0, 1.0) * in.adv : in.adv);
      if (!close(out.grad_logp, grad, scale)) fail_token("token_loss topr", trial, out.grad_logp, grad);
      continue;
    }
    if (p.objective == rlk::kGppo) {
      // With β₁ = β₂ = 1 the value is PPO's (without δ); a token the clip holds (and the dual clip does not) has the
      // value β·bound times PPO's, −β·bound·A, and REINFORCE's gradient with the advantage β·bound·A (0 where the
      // clamp of ℓ − ℓ_old stops the gradient of w/sg(w)).
      rlk::TokenLossParams<double> ppo = p, unit_beta = p;
      ppo.objective = rlk::kClip;
      ppo.delta = inf;
      unit_beta.gppo_beta_low = unit_beta.gppo_beta_high = 1;
      const double ppo_loss = rlk::token_loss(in, ppo).stats[rlk::kStatLoss];
      const double unit_loss = rlk::token_loss(in, unit_beta).stats[rlk::kStatLoss];
      if (!close(unit_loss, ppo_loss, scale)) fail_token("token_loss gppo value at beta 1", trial, unit_loss, ppo_loss);
      const double w = out.stats[rlk::kStatRatio], lo = 1 - p.clip_low, hi = 1 + p.clip_high;
      const bool held_low = w < lo && in.adv < 0, held_high = w > hi && in.adv > 0;
      const double kept = held_low ? p.gppo_beta_low * lo : p.gppo_beta_high * hi;  // β·bound
      if ((held_low || held_high) && !(in.adv < 0 && -p.dual_clip * in.adv < -kept * in.adv)) {
        const bool r_passes = std::fabs(in.logp - in.old_logp) <= p.log_ratio_clamp;
        const double grad = reinforce_grad(r_passes ? kept * in.adv : 0.0), bound = held_low ? lo : hi;
        if (!close(out.grad_logp, grad, scale)) fail_token("token_loss gppo held gradient", trial, out.grad_logp, grad);
        const double want = unit_loss + in.weight * -in.adv * (kept - bound);
        if (!close(out.stats[rlk::kStatLoss], want, scale)) fail_token("token_loss gppo held value", trial, out.stats[rlk::kStatLoss], want);
        continue;
      }
    }
    if (low_var_kl_plus) continue;  // its gradient is not the derivative of its value (checked above)
    if (p.objective == rlk::kCispo) {  // REINFORCE with the advantage times the clamped weight
      rlk::TokenLossParams<double> reinforce = p;
      reinforce.objective = rlk::kReinforce;
      rlk::TokenIn<double> scaled = in;
      const double w = out.stats[rlk::kStatRatio];
      scaled.adv = rlk::clamp_(w, 1 - p.clip_low, 1 + p.clip_high) * in.adv;
      const rlk::TokenOut<double> o = rlk::token_loss(scaled, reinforce);
      if (!close(out.grad_logp, o.grad_logp, scale)) fail_token("token_loss cispo", trial, out.grad_logp, o.grad_logp);
      continue;
    }
    if (p.objective == rlk::kDppoTv || p.objective == rlk::kDppoKl) {
      // Inside the trust region REINFORCE with A·min(w, cap) (a constant), outside only the other terms.
      rlk::TokenLossParams<double> reinforce = p;
      reinforce.objective = rlk::kReinforce;
      rlk::TokenIn<double> inside = in, outside = in;
      inside.adv = std::fmin(out.stats[rlk::kStatRatio], p.ratio_cap) * in.adv;
      outside.adv = 0;
      const double a = rlk::token_loss(inside, reinforce).grad_logp, b = rlk::token_loss(outside, reinforce).grad_logp;
      if (!close(out.grad_logp, a, scale) && !close(out.grad_logp, b, scale)) {
        fail_token("token_loss dppo", trial, out.grad_logp, a);
      }
      continue;
    }
    auto loss = [&](double dl, double dh) {
      rlk::TokenIn<double> moved = in;
      moved.logp += dl;
      moved.entropy += dh;
      return rlk::token_loss(moved, p).stats[rlk::kStatLoss];
    };
    const double f = loss(0, 0), left = (f - loss(-h, 0)) / h, right = (loss(h, 0) - f) / h;
    if (std::fabs(left - right) > 1e-4 * scale) {
      ++skipped;
      continue;
    }
    ++checked;
    const double dl = (loss(h, 0) - loss(-h, 0)) / (2 * h), dh = (loss(0, h) - loss(0, -h)) / (2 * h);
    if (!(std::fabs(out.grad_logp - dl) <= 1e-7 * (scale + std::fabs(dl)))) {
      fail_token("token_loss grad_logp", trial, out.grad_logp, dl);
    }
    if (!(std::fabs(out.grad_entropy - dh) <= 1e-7 * scale)) fail_token("token_loss grad_entropy", trial, out.grad_entropy, dh);
  }
  if (checked < 1000 || skipped > checked / 50) {
    fail_token("token_loss: too few tokens checked against differences (checked, skipped)", 0, checked, skipped);
  }
  for (int j = 0; j < rlk::kNumObjectives; ++j) {
    if (drawn[j] < 100) fail_token("token_loss: an objective drawn too rarely (id, times)", 0, j, drawn[j]);
  }
  for (int j = 0; j < rlk::kNumKlEstimators; ++j) {
    if (estimators[j] < 100) fail_token("token_loss: a KL estimator drawn too rarely (id, times)", 0, j, estimators[j]);
  }
}

// StorePolicyToken, as lane 0 runs it for row 1 of 3: it reads that row's inputs (old_logp and
// ref_logp, when given), runs token_loss on the row's results, and writes row 1 and nothing else.
void store_policy_token() {
  rlk::TokenLossParams<float> p{rlk::kClip, 0.2f, 0.28f, INFINITY, 3.0f, rlk::kKlK3, 0.1f, INFINITY, false, 0.01f, 20.0f};
  const bool mask[3] = {true, true, true};
  const float weight[3] = {0.5f, 0.25f, 0.5f}, adv[3] = {1.0f, -0.7f, 1.0f};
  const float old_logp[3] = {-1.0f, -2.0f, -1.0f}, ref_logp[3] = {-1.0f, -1.5f, -1.0f};
  const rlk::RowResult<float> r{3.0f, 1.0f, -1.75f, 2.5f};  // m, log s, logp, entropy
  const float sentinel = 12345.0f;
  for (int variant = 0; variant < 4; ++variant) {
    const bool has_old = variant & 1, has_ref = variant & 2;
    float logp[3], entropy[3], lse_parts[6], grad_logp[3], grad_entropy[3], stats[3 * rlk::kNumStats];
    for (float* a : {logp, entropy, grad_logp, grad_entropy}) std::fill(a, a + 3, sentinel);
    std::fill(lse_parts, lse_parts + 6, sentinel);
    std::fill(stats, stats + 3 * rlk::kNumStats, sentinel);
    const StorePolicyToken store{rlk_cuda::TokenInputs{mask, weight, adv, has_old ? old_logp : nullptr, has_ref ? ref_logp : nullptr},
                                 p, rlk_cuda::TokenOutputs{logp, entropy, lse_parts, grad_logp, grad_entropy, stats}};
    store(1, r);
    const rlk::TokenOut<float> want =
        rlk::token_loss(rlk::TokenIn<float>{-1.75f, 2.5f, true, 0.25f, -0.7f, has_old, -2.0f, has_ref, -1.5f}, p);
    bool ok = logp[1] == r.logp && entropy[1] == r.entropy && lse_parts[2] == r.m && lse_parts[3] == r.log_s &&
              grad_logp[1] == want.grad_logp && grad_entropy[1] == want.grad_entropy;
    for (int j = 0; j < rlk::kNumStats; ++j) ok = ok && stats[rlk::kNumStats + j] == want.stats[j];
    for (int row : {0, 2}) {
      for (const float* a : {logp, entropy, grad_logp, grad_entropy}) ok = ok && a[row] == sentinel;
      ok = ok && lse_parts[2 * row] == sentinel && lse_parts[2 * row + 1] == sentinel;
      for (int j = 0; j < rlk::kNumStats; ++j) ok = ok && stats[row * rlk::kNumStats + j] == sentinel;
    }
    // The inputs reach the loss: off-policy ℓ − ℓ_old = 0.25 gives w = e^0.25; a reference gives kl > 0.
    ok = ok && (has_old ? std::fabs(stats[rlk::kNumStats + rlk::kStatRatio] - std::exp(0.25f)) < 1e-6f
                        : stats[rlk::kNumStats + rlk::kStatRatio] == 1.0f);
    ok = ok && (stats[rlk::kNumStats + rlk::kStatKl] > 0) == has_ref;
    if (!ok) fail_token("StorePolicyToken (variant: has_old + 2 has_ref)", variant, grad_logp[1], want.grad_logp);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  sweep<float, 32>(rng);
  sweep<float, 256>(rng);
  sweep<float, 512>(rng);
  sweep<__nv_bfloat16, 32>(rng);
  sweep<__nv_bfloat16, 256>(rng);
  sweep<__nv_bfloat16, 512>(rng);
  sweep<__half, 32>(rng);
  sweep<__half, 256>(rng);
  sweep<__half, 512>(rng);
  batch_stride_rows<float, 32>(rng);
  batch_stride_rows<float, 256>(rng);
  batch_stride_rows<__nv_bfloat16, 32>(rng);
  batch_stride_rows<__half, 512>(rng);
  nan_rows<float>();
  nan_rows<__nv_bfloat16>();
  nan_rows<__half>();
  token_loss_derivatives(rng);
  store_policy_token();
  if (failures) {
    std::printf("test_row_pass: %d failures\n", failures);
    return 1;
  }
  std::printf("test_row_pass: ok\n");
  return 0;
}
