// The schemas of the ops of `torch.ops.rlkernels_C`, in one place; each backend registers its kernels
// with TORCH_LIBRARY_IMPL next to them (csrc/cpu/*.cpp, csrc/cuda/bindings.cpp). Here, with the CPU
// sources, because those are compiled in every build.
#include <torch/library.h>

TORCH_LIBRARY(rlkernels_C, m) {
  // Returns (logp, entropy, lse_parts); lse_parts (N, 2) holds each row's [m, log s], whose sum is the
  // logsumexp (see rlkernels/kernels/__init__.py).
  // softcap: the final-logit cap c (y = c·tanh(z/c)), 0 for none (rlkernels/row_math.h).
  m.def("token_logprobs_fwd(Tensor logits, Tensor targets, float temperature, float softcap, bool need_entropy)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("token_logprobs_bwd(Tensor logits, Tensor targets, Tensor lse_parts, Tensor entropy, Tensor grad_logp,"
        " Tensor? grad_entropy, float temperature, float softcap) -> Tensor");
  // The same, written into `out`, which may be `logits` itself (see rlkernels/kernels/__init__.py).
  m.def("token_logprobs_bwd_out(Tensor logits, Tensor targets, Tensor lse_parts, Tensor entropy, Tensor grad_logp,"
        " Tensor? grad_entropy, float temperature, float softcap, Tensor(a!) out) -> ()");
  // The forward plus the per-token policy loss; `params` packed as PARAMS of
  // rlkernels/kernels/token_loss_params.py lays them out; is_weights: ω of the surrogate (None: 1). Returns (logp,
  // entropy, lse_parts, grad_logp, grad_entropy, stats).
  m.def("policy_token_fwd(Tensor logits, Tensor targets, Tensor mask, Tensor weight, Tensor adv, Tensor? old_logp,"
        " Tensor? ref_logp, Tensor? is_weights, float temperature, float softcap, float[] params)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The two-pass row (docs/design.md §2): policy_token_fwd's (logp, entropy, stats) and, from the same read of
  // each row, ∂logits = scale·(the backward at the token's derivatives; at ∂/∂H = entropy_grad where given).
  // The second returns a new gradient; the `_out` one writes `out`, which may be `logits` itself.
  m.def("policy_token_fwd_grad(Tensor logits, Tensor targets, Tensor mask, Tensor weight, Tensor adv,"
        " Tensor? old_logp, Tensor? ref_logp, Tensor? is_weights, Tensor? entropy_grad, float temperature,"
        " float softcap, float[] params, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("policy_token_fwd_grad_out(Tensor logits, Tensor targets, Tensor mask, Tensor weight, Tensor adv,"
        " Tensor? old_logp, Tensor? ref_logp, Tensor? is_weights, Tensor? entropy_grad, float temperature,"
        " float softcap, float[] params, float scale, Tensor(a!) out) -> (Tensor, Tensor, Tensor)");
  // grad ×= grad_out / assumed unless the one number grad_out equals `assumed`: the backward of the two-pass row.
  m.def("scale_grad_(Tensor(a!) grad, Tensor grad_out, float assumed) -> ()");
  // CUDA only: (clusters resident at once, blocks per cluster) of the two-pass kernel on logits' device for rows
  // like logits' (its occupancy, checked by benchmarks/gpu_check.sh before the kernel is timed).
  m.def("two_pass_active_clusters(Tensor logits) -> (int, int)");
  // The per-token policy loss at given log-probs (N,); `params` as in policy_token_fwd.
  // `chosen`: Clip-Cov's and KL-Cov's tokens, as covariance_choice gives them; is_weights: ω of the surrogate (None:
  // 1). Returns (grad_logp, grad_entropy, stats).
  m.def("policy_token_loss(Tensor logp, Tensor? entropy, Tensor mask, Tensor weight, Tensor? adv, Tensor? old_logp,"
        " Tensor? ref_logp, Tensor? chosen, Tensor? is_weights, float[] params) -> (Tensor, Tensor, Tensor)");
  // Clip-Cov's (objective 0, with uniform `draws`) or KL-Cov's (1) tokens of a call: `scale` on each chosen token,
  // 0 elsewhere, in the dtype of logp.
  m.def("covariance_choice(Tensor logp, Tensor adv, Tensor? old_logp, Tensor mask, Tensor? draws, int objective, float fraction, float cov_lb, float cov_ub, float clip_low, float clip_high,"
        " float log_ratio_clamp, float scale) -> Tensor");
}
