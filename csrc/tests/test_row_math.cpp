// Checks rlkernels/row_math.h against a direct two-pass computation, in float and double:
// the online state built element by element, and built from chunks merged in any order, must
// give the same (m, log s) / logp / entropy; the factored gradient must equal the textbook formula,
// also for logits offset by 1e5 and near the largest float (where m + log s would round to m, and
// z/τ overflows at the τ = 0.5 of every check).
// Exit status 0 on success, 1 on any failure (ctest, or run the binary).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "rlkernels/row_math.h"

namespace {

int failures = 0;

void expect_close(const char* what, int row, double got, double want, double tol) {
  const bool ok = (std::isnan(got) && std::isnan(want)) || std::fabs(got - want) <= tol * (1.0 + std::fabs(want));
  if (!ok) {
    std::printf("FAIL %-24s row %d: got %.17g, want %.17g\n", what, row, got, want);
    ++failures;
  }
}

struct Direct {  // two passes, in long double, relative to the max (exact for any offset)
  double m, log_s, logp, entropy;
};

constexpr double kInvTau = 2.0;  // τ = 0.5

Direct two_pass(const std::vector<double>& x, int target) {
  long double m = -INFINITY;
  for (double v : x) m = std::max<long double>(m, v);
  auto d = [&](double v) { return (static_cast<long double>(v) - m) * kInvTau; };
  long double s = 0, sd = 0;
  for (double v : x) {
    const long double e = std::exp(d(v));
    s += e;
    if (e > 0) sd += e * d(v);
  }
  const long double log_s = std::log(s);
  return {static_cast<double>(m), static_cast<double>(log_s), static_cast<double>(d(x[target]) - log_s),
          static_cast<double>(log_s - sd / s)};
}

template <typename T>
rlk::SoftmaxState<T> online(const std::vector<double>& x, size_t begin, size_t end) {
  rlk::SoftmaxState<T> st = rlk::softmax_init<T>();
  for (size_t i = begin; i < end; ++i) {
    const T v = static_cast<T>(x[i]);
    if (v > st.m) {
      T alpha, delta;
      rlk::rescale_factors(st.m, v, T(kInvTau), alpha, delta);
      rlk::softmax_rescale(st.s, st.u, alpha, delta);
      st.m = v;
    }
    if (st.m == rlk::neg_inf<T>()) continue;
    T d = rlk::scaled_diff(v, st.m, T(kInvTau));
    d = d < rlk::exp_floor<T>() ? rlk::exp_floor<T>() : d;
    rlk::softmax_accumulate(st.s, st.u, rlk::exp_(d), d);
  }
  return st;
}

template <typename T>
void check_row(std::vector<double> x, int target, int row, double tol, std::mt19937& rng) {
  for (auto& v : x) v = static_cast<T>(v);  // the reference sees the values T can hold
  const Direct want = two_pass(x, target);
  const T x_target = static_cast<T>(x[target]);

  // Element by element.
  auto r = rlk::softmax_finalize(online<T>(x, 0, x.size()), x_target, T(kInvTau));
  expect_close("m (online)", row, r.m, want.m, 0);
  expect_close("log s (online)", row, r.log_s, want.log_s, tol);
  expect_close("logp (online)", row, r.logp, want.logp, tol);
  expect_close("entropy (online)", row, r.entropy, want.entropy, tol);

  // Random chunks, merged left to right and in a tree (as threads or warps would).
  std::vector<size_t> cuts{0, x.size()};
  for (int k = 0; k < 5; ++k) cuts.push_back(std::uniform_int_distribution<size_t>(0, x.size())(rng));
  std::sort(cuts.begin(), cuts.end());
  std::vector<rlk::SoftmaxState<T>> parts;
  for (size_t k = 0; k + 1 < cuts.size(); ++k) parts.push_back(online<T>(x, cuts[k], cuts[k + 1]));
  rlk::SoftmaxState<T> left = rlk::softmax_init<T>();
  for (const auto& p : parts) left = rlk::softmax_merge(left, p, T(kInvTau));
  while (parts.size() > 1) {
    std::vector<rlk::SoftmaxState<T>> next;
    for (size_t k = 0; k + 1 < parts.size(); k += 2) next.push_back(rlk::softmax_merge(parts[k + 1], parts[k], T(kInvTau)));
    if (parts.size() % 2) next.push_back(parts.back());
    parts = next;
  }
  for (const auto* st : {&left, &parts[0]}) {
    r = rlk::softmax_finalize(*st, x_target, T(kInvTau));
    expect_close("m (merged)", row, r.m, want.m, 0);
    expect_close("log s (merged)", row, r.log_s, want.log_s, tol);
    expect_close("logp (merged)", row, r.logp, want.logp, tol);
    expect_close("entropy (merged)", row, r.entropy, want.entropy, tol);
  }

  // Gradient: (1/τ)[g(1[v=y] − p) − h p (log p + H)].
  const double g = 0.7, h = -1.3, inv_tau = kInvTau;
  const auto c = rlk::grad_coeffs<T>(T(g), T(h), T(want.entropy), T(inv_tau));
  for (size_t v = 0; v < x.size(); ++v) {
    const double logp = (x[v] - want.m) * inv_tau - want.log_s;
    const double p = std::exp(logp);
    const double textbook = p > 0 ? inv_tau * (g * ((int(v) == target) - p) - h * p * (logp + want.entropy))
                                  : inv_tau * g * (int(v) == target);
    const T got = rlk::grad_logit(static_cast<T>(x[v]), T(want.m), T(want.log_s), T(inv_tau), int(v) == target, c);
    expect_close("grad", row, got, textbook, tol * 10);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  std::normal_distribution<double> normal(0.0, 3.0);
  const double inf = std::numeric_limits<double>::infinity();
  int row = 0;
  for (size_t V : {1, 2, 7, 100, 4099}) {
    for (int variant = 0; variant < 6; ++variant, ++row) {
      std::vector<double> x(V);
      for (auto& v : x) v = normal(rng);
      const int target = std::uniform_int_distribution<int>(0, int(V) - 1)(rng);
      if (variant == 1) {  // about half of the vocabulary masked with −inf
        for (size_t i = 0; i < V; ++i) if (int(i) != target && (rng() & 1)) x[i] = -inf;
      } else if (variant == 2) {  // only the target is finite
        for (size_t i = 0; i < V; ++i) if (int(i) != target) x[i] = -inf;
      } else if (variant == 3) {  // large offset: shift invariance
        for (auto& v : x) v += 1000.0;
      } else if (variant == 4) {  // an offset where ulp(m) = 2⁻⁷ in float: m + log s would lose p to 0.4%
        for (auto& v : x) v += 1e5;
      } else if (variant == 5) {  // near the largest float: ties at the max, every other p is 0
        for (auto& v : x) v = v > 0 ? 3e38 : 2e38;
      }
      check_row<double>(x, target, row, 1e-12, rng);
      check_row<float>(x, target, row, 2e-5, rng);
    }
  }
  if (failures) {
    std::printf("test_row_math: %d failures\n", failures);
    return 1;
  }
  std::printf("test_row_math: ok (%d rows)\n", row);
  return 0;
}
