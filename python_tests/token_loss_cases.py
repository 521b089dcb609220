"""Cases, inputs, the fp64 spec, error bounds and backends of the per-token loss contract tests:
`policy_token_fwd` (test_policy_token_fwd.py) and `policy_token_loss` (test_policy_token_loss.py) of
every backend (rlkernels/kernels/__init__.py gives the contract).

The spec is torch autograd of `rlkernels.losses` in fp64: `LossInputs.masked` + `per_token_loss`,
weighted by `aggregation_weights`, differentiated at ℓ and H (the op's inputs, or ℓ and H of the
same logits upcast to fp64 for the forward). Every per-token input is drawn in fp64 and rounded to
the op's dtype first, so the spec sees exactly the values the op does.

Log-ratios ℓ − ℓ_old and ℓ_ref − ℓ are drawn directly, away from every kink of the loss (the clip
bounds, δ, the dual clip, ±c, ±kl_clamp): there fp32 and fp64 may take different sides, and the
derivative jumps. Each case names the branches its inputs must reach (`exercises`); the tests assert
it. Masked tokens hold NaN / ±inf padding, which the op must not read.

Triton runs on CPU tensors in its interpreter when there is no GPU: TRITON_INTERPRET=1 is set here,
before triton is imported, and the test files make RuntimeWarnings errors (an inf·0 or inf − inf in
a lane that `tl.where` discards fails a test). The interpreter is slow: its shapes are small.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Optional, Tuple

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: @triton.jit picks the interpreter at decoration.
    os.environ["TRITON_INTERPRET"] = "1"

import numpy  # noqa: E402
import pytest  # noqa: E402

from rlkernels.kernels import cpu, cuda, token_loss_params as P, torch_chunked  # noqa: E402
from rlkernels.kernels.token_loss_params import KL_NONE, NUM_STATS, STATS, TokenLossParams  # noqa: E402
from rlkernels.losses import PolicyLossConfig  # noqa: E402
from rlkernels.losses.aggregation import aggregation_weights  # noqa: E402
from rlkernels.losses.inputs import LossInputs  # noqa: E402
from rlkernels.losses import objectives  # noqa: E402
from rlkernels.losses.kl import kl_estimate  # noqa: E402
from rlkernels.losses.policy_loss import per_token_loss  # noqa: E402
from rlkernels.ops.kernel_params import surrogate_params, token_loss_params, token_terms_params  # noqa: E402

try:
    from rlkernels.kernels import triton as tk  # noqa: E402
except ImportError as e:  # triton not installed
    tk, _TRITON = None, (False, f"triton is not importable ({e})")
else:
    _TRITON = tk.available()  # False on CPU when triton was imported before TRITON_INTERPRET=1

HALF_WIDTH = 1.2  # ℓ − ℓ_old in [−1.2, 1.2]: ratios from 0.3 to 3.3, through every clip bound
REF_HALF_WIDTH = 1.5  # ℓ_ref − ℓ in [−1.5, 1.5]
LOSS, CLIP_LOW, CLIP_HIGH, RATIO, APPROX_KL, KL, ENTROPY = range(NUM_STATS)
assert STATS == ("loss", "clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy")


# --------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Case:
    config: PolicyLossConfig  # the loss the spec evaluates
    params: TokenLossParams  # what the op is given
    old: bool = True  # old_logp given (else on-policy)
    ref: bool = False  # ref_logp given
    entropy: bool = True  # entropy given (else None: H = 0; policy_token_loss only)
    adv: bool = True  # adv given (else None, or zeros for policy_token_fwd: A = 0)
    exercises: tuple = ()  # branches that some, not all, unmasked tokens must reach
    # policy_token_fwd only: the logits' dtype (on fp32 backends; fp64 on cpu-fp64), τ, and V where it
    # is not the backend's
    dtype: torch.dtype = torch.float32
    temperature: float = 1.0
    vocab: Optional[int] = None


def make_case(*, old=True, ref=False, entropy=True, adv=True, exercises=(), dtype=torch.float32, temperature=1.0,
          vocab=None, **config):
    cfg = PolicyLossConfig(**config)
    return Case(cfg, token_loss_params(cfg), old, ref, entropy, adv, tuple(exercises), dtype, temperature, vocab)


def _terms_case(*, old=True, entropy=True, exercises=(), **config):
    """`token_terms_params` of a clip config without advantages (how sequence-level losses take their
    KL and entropy terms): the spec is REINFORCE at A = 0, whose surrogate is 0."""
    full = PolicyLossConfig(**config)
    spec = dataclasses.replace(full, objective="reinforce", delta=None, dual_clip=None)
    return Case(spec, token_terms_params(full), old, True, entropy, False, tuple(exercises))


def _kl_cases():
    # each below the estimate's largest value on the drawn Δ
    clamps = {"k1": 0.5, "k2": 0.3, "k3": 0.2, "abs": 0.5, "low_var_kl+": 0.2}
    cases = {}
    for est in clamps:
        for clamp in (None, clamps[est]):
            for bias in (False, True):
                name = f"kl_{est.replace('+', '_plus')}" + ("_clamp" if clamp else "") + ("_bias" if bias else "")
                # with bias correction, c = 1: some w (and so the KL weight) clamped, and some Δ
                c = 1.0 if bias else 20.0
                exercises = ("kl_clamp",) if clamp else ()
                if bias:
                    exercises += ("log_ratio_clamp", "kl_log_ratio_clamp")
                cases[name] = make_case(ref=True, kl_estimator=est, kl_coef=0.1 if est != "k2" else 0.3, kl_clamp=clamp,
                                    kl_bias_correction=bias, log_ratio_clamp=c, exercises=exercises)
    return cases


def _c2(**kw):
    """A case with c = 2 and a reference given (the defaults of the former Triton harness)."""
    kw.setdefault("log_ratio_clamp", 2.0)
    kw.setdefault("ref", True)
    return make_case(**kw)


# Every op runs each case it can express on every backend (the union of the configs of the three harnesses these
# tests replace: compiled forward, Triton forward, per-token loss).
CASES = {
    # objectives, clip sides, δ, dual clip
    "clip": make_case(exercises=("clip_low", "clip_high")),
    "clip_asymmetric": make_case(clip_low=0.1, clip_high=0.28, agg="seq_mean_token_sum",
                             exercises=("clip_low", "clip_high")),
    "clip_delta": make_case(delta=1.5, exercises=("clip_low", "clip_high", "delta")),
    "clip_delta_below_one": make_case(delta=0.9, exercises=("clip_low", "delta")),  # TRL accepts any δ > 0
    "clip_dual": make_case(dual_clip=2.0, entropy_coef=0.01, exercises=("clip_low", "clip_high", "dual_clip")),
    "clip_dual_no_entropy": make_case(dual_clip=2.0, exercises=("dual_clip",)),
    "clip_asymmetric_delta_dual": make_case(clip_low=0.15, clip_high=0.3, delta=3.0, dual_clip=1.8, ref=True,
                                        kl_estimator="k3", kl_coef=0.05, agg="seq_mean_token_mean",
                                        exercises=("clip_low", "clip_high", "dual_clip")),
    "clip_asym_delta_dual_token_sum": make_case(clip_low=0.1, clip_high=0.28, delta=3.0, dual_clip=1.8,
                                                  agg="seq_mean_token_sum",
                                                  exercises=("clip_low", "clip_high", "dual_clip")),
    "clip_log_ratio_clamp": make_case(log_ratio_clamp=0.8, exercises=("clip_low", "clip_high", "log_ratio_clamp")),
    "clip_k3_entropy": _c2(kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01),
    "clip_delta_t0_7": _c2(temperature=0.7, delta=1.3),
    "clip_dual_negative_entropy": _c2(dual_clip=1.5, entropy_coef=-0.02),
    "clip_asymmetric_bf16": _c2(dtype=torch.bfloat16, temperature=0.7, clip_low=0.1, clip_high=0.28),
    "clip_delta_dual_fp16": _c2(dtype=torch.float16, temperature=1.3, delta=1.4, dual_clip=2.0, kl_estimator="k1",
                                kl_coef=0.1),
    "clip_entropy": _c2(ref=False, entropy_coef=0.01),
    "clip_small_c": _c2(log_ratio_clamp=0.3, kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01),
    "two_tiles_seq_mean": _c2(vocab=700, agg="seq_mean_token_mean", kl_estimator="k3", kl_coef=0.05),  # 2 × 512
    "bf16_tau": make_case(dtype=torch.bfloat16, temperature=0.7, dual_clip=3.0, ref=True, kl_estimator="k3",
                      kl_coef=0.1, entropy_coef=0.01),
    "all_terms_t0_8": make_case(temperature=0.8, delta=2.5, dual_clip=2.0, ref=True, kl_estimator="k3", kl_coef=0.1,
                            kl_clamp=0.3, kl_bias_correction=True, entropy_coef=0.01, log_ratio_clamp=1.0),
    "cispo": make_case(objective="cispo", clip_low=0.2, clip_high=0.4, exercises=("clip_low", "clip_high")),
    "cispo_no_low": make_case(objective="cispo", clip_low=None, clip_high=0.3, exercises=("clip_high",)),
    "cispo_no_low_clamp": make_case(objective="cispo", clip_low=None, clip_high=0.3, log_ratio_clamp=0.8,
                                ref=True, kl_estimator="k1", kl_coef=0.1,
                                exercises=("clip_high", "log_ratio_clamp", "kl_log_ratio_clamp")),
    "cispo_log_ratio_clamp": make_case(objective="cispo", clip_low=0.1, clip_high=0.1, log_ratio_clamp=0.7,
                                   exercises=("log_ratio_clamp",)),
    "cispo_bf16_k2": _c2(dtype=torch.bfloat16, objective="cispo", clip_low=0.2, clip_high=0.3, kl_estimator="k2",
                         kl_coef=0.2),
    "fp16_tau": make_case(dtype=torch.float16, temperature=1.3, objective="cispo", clip_low=None, clip_high=0.2,
                      entropy_coef=0.005),
    "sapo": make_case(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, ref=True, kl_estimator="k3", kl_coef=0.05),
    "sapo_c2": _c2(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_estimator="k3", kl_coef=0.05),
    "dppo_tv": make_case(objective="dppo_tv", clip_low=0.05, clip_high=0.03, exercises=("clip_low", "clip_high")),
    "dppo_tv_wide": make_case(objective="dppo_tv", clip_low=0.15, clip_high=0.1),
    "dppo_tv_entropy": _c2(objective="dppo_tv", clip_low=0.15, clip_high=0.15, entropy_coef=0.01),
    "dppo_kl_cap": make_case(objective="dppo_kl", clip_low=0.05, clip_high=0.03, ratio_cap=1.5, entropy_coef=0.01,
                         exercises=("clip_low", "clip_high")),
    "dppo_kl_cap_bf16": _c2(dtype=torch.bfloat16, objective="dppo_kl", clip_low=0.05, clip_high=0.05, ratio_cap=1.5),
    "dro": make_case(objective="dro", dro_beta=0.3, ref=True, kl_estimator="k2", kl_coef=0.1),
    "dro_on_policy": make_case(objective="dro", dro_beta=0.3, old=False),
    "dro_beta_0_1": _c2(objective="dro", dro_beta=0.1, kl_estimator="k2", kl_coef=0.1),
    "dro_on_policy_beta_0_1": _c2(objective="dro", dro_beta=0.1, old=False),
    "topr": make_case(objective="topr", clip_low=None, clip_high=None, exercises=("clip_high",)),
    "topr_kl": make_case(objective="topr", clip_low=None, clip_high=None, ref=True, kl_estimator="k3", kl_coef=0.05,
                     exercises=("clip_high",)),
    "topr_clamp_kl": make_case(objective="topr", log_ratio_clamp=0.8, ref=True, kl_estimator="k1", kl_coef=0.1,
                           entropy_coef=0.01, exercises=("clip_high", "log_ratio_clamp")),
    "topr_k3_entropy": _c2(objective="topr", kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01),
    "topr_on_policy": make_case(objective="topr", old=False, entropy_coef=0.01),
    "topr_on_policy_bf16": _c2(dtype=torch.bfloat16, objective="topr", old=False),
    # GPPO: a token the clip holds keeps the gradient −β·bound·A (the β's scale its value too)
    "gppo": make_case(objective="gppo", clip_low=0.2, clip_high=0.28, exercises=("clip_low", "clip_high")),
    "gppo_betas_dual": make_case(objective="gppo", clip_low=0.15, clip_high=0.3, dual_clip=1.8, gppo_beta_low=0.75,
                                 gppo_beta_high=1.2, ref=True, kl_estimator="k3", kl_coef=0.05,
                                 agg="seq_mean_token_mean", exercises=("clip_low", "clip_high", "dual_clip")),
    "gppo_log_ratio_clamp": make_case(objective="gppo", gppo_beta_low=0.5, gppo_beta_high=2.0, log_ratio_clamp=0.8,
                                      entropy_coef=0.01, exercises=("clip_low", "clip_high", "log_ratio_clamp")),
    "gppo_bf16_k2": _c2(dtype=torch.bfloat16, temperature=0.7, objective="gppo", gppo_beta_low=0.75, kl_estimator="k2",
                        kl_coef=0.1),
    "gppo_on_policy": make_case(objective="gppo", old=False, dual_clip=3.0, entropy_coef=0.01),
    "reinforce": make_case(objective="reinforce", entropy_coef=0.01, agg="seq_mean_token_mean"),
    "reinforce_no_entropy": make_case(objective="reinforce", agg="seq_mean_token_mean"),
    "reinforce_entropy_c2": _c2(objective="reinforce", entropy_coef=0.01),
    "reinforce_on_policy_kl": make_case(objective="reinforce", old=False, ref=True, kl_estimator="k2", kl_coef=0.3),
    "reinforce_on_policy_k3": _c2(objective="reinforce", old=False, kl_estimator="k3", kl_coef=0.1),
    # KL estimators, clamps, bias correction
    **_kl_cases(),
    "kl_k1_bias_c20": make_case(ref=True, kl_estimator="k1", kl_coef=0.2, kl_bias_correction=True),
    "kl_k1_clamp_0_2": _c2(kl_estimator="k1", kl_coef=0.1, kl_clamp=0.2),
    "kl_k2_clamp_0_2": make_case(ref=True, kl_estimator="k2", kl_coef=0.05, kl_clamp=0.2, exercises=("kl_clamp",)),
    "kl_k2_bias_c2": _c2(kl_estimator="k2", kl_coef=0.1, kl_bias_correction=True),
    "kl_k3_clamp_bias_c20": make_case(ref=True, kl_estimator="k3", kl_coef=0.1, kl_clamp=0.1, kl_bias_correction=True,
                                  exercises=("kl_clamp",)),
    "kl_k3_clamp_bias_c2": _c2(kl_estimator="k3", kl_coef=0.3, kl_clamp=0.1, kl_bias_correction=True),
    "kl_k3_bias_c20": _c2(kl_estimator="k3", kl_coef=0.3, kl_bias_correction=True, log_ratio_clamp=20.0),
    "kl_abs_clamp_c0_5": make_case(ref=True, kl_estimator="abs", kl_coef=0.1, kl_clamp=0.3, log_ratio_clamp=0.5,
                               exercises=("kl_clamp", "kl_log_ratio_clamp")),
    "kl_low_var_kl_plus_bias_c0_5": make_case(ref=True, kl_estimator="low_var_kl+", kl_coef=0.1,
                                          kl_bias_correction=True, log_ratio_clamp=0.5,
                                          exercises=("log_ratio_clamp", "kl_log_ratio_clamp")),
    "kl_metric_only": make_case(ref=True, kl_estimator="k2", kl_coef=0.0),  # β = 0: the kl statistic is k3
    "kl_metric_only_entropy": _c2(kl_estimator="k2", kl_coef=0.0, entropy_coef=0.01),
    "log_ratio_clamp_k2": make_case(log_ratio_clamp=0.5, ref=True, kl_estimator="k2", kl_coef=0.1,
                                exercises=("log_ratio_clamp", "kl_log_ratio_clamp")),
    "on_policy": make_case(old=False, ref=True, kl_estimator="k3", kl_coef=0.1),
    "on_policy_kl_bias": make_case(old=False, ref=True, kl_estimator="k3", kl_coef=0.1, kl_bias_correction=True),
    "on_policy_kl_bias_c2": _c2(old=False, kl_estimator="k3", kl_coef=0.05, kl_bias_correction=True),
    # entropy; inputs left out (policy_token_loss: entropy=None is H = 0, adv=None is A = 0)
    "entropy_constant_agg": make_case(entropy_coef=0.01, agg="constant", norm_length=16),
    "entropy_negative_coef": make_case(entropy_coef=-0.02, agg="constant", norm_length=50),
    "entropy_negative_reinforce": make_case(objective="reinforce", entropy_coef=-0.02, ref=True, kl_estimator="k1",
                                        kl_coef=0.1),
    "entropy_none": make_case(entropy=False, entropy_coef=0.02, ref=True, kl_estimator="k1", kl_coef=0.1),
    "no_adv_terms": _terms_case(kl_estimator="k3", kl_coef=0.1, kl_clamp=0.2, kl_bias_correction=True,
                                log_ratio_clamp=1.0, entropy_coef=0.01, delta=2.0,
                                exercises=("kl_clamp", "log_ratio_clamp", "kl_log_ratio_clamp")),
    "no_adv_terms_on_policy_no_entropy": _terms_case(old=False, entropy=False, kl_estimator="k1", kl_coef=0.2,
                                                     entropy_coef=0.01),
    "no_adv_clip": make_case(adv=False, ref=True, kl_estimator="k2", kl_coef=0.1, dual_clip=2.0, entropy_coef=0.01),
    # CISPO's clip flags depend on w only: set at A = 0 too, while its surrogate is 0
    "no_adv_cispo": make_case(adv=False, objective="cispo", ref=True, kl_estimator="k1", kl_coef=0.1,
                          exercises=("clip_low", "clip_high")),
    "no_adv_no_ref": make_case(adv=False, objective="reinforce", entropy=False),
}



def registry_cases(covered) -> dict:
    """A case for each objective of the kernels' table that no case of `covered` (names of objectives) tests: its
    first token-ratio preset of the registry (`objectives.get(name).presets`; without one, the config's defaults),
    without the preset's KL term (the KL cases test those). So an objective added to the table and the registry is
    tested by every op and backend without a hand-written case. Clip-Cov and KL-Cov choose their tokens over the
    whole call first (`Objective.chooses_tokens`): test_covariance_choice.py tests them."""
    cases = {}
    for entry in P.OBJECTIVES:
        objective = objectives.get(entry.name)
        if entry.name in covered or objective.chooses_tokens:
            continue
        preset = next((f for f in objective.presets.values() if f["ratio"] == "token"), {})
        fields = {"objective": entry.name, **{k: v for k, v in preset.items() if k not in ("kl_estimator", "kl_coef")}}
        if fields.get("agg") == "constant":
            fields.setdefault("norm_length", 16)
        cases[f"preset_{entry.name}"] = make_case(**fields)
    return cases


CASES.update(registry_cases({case.config.objective for case in CASES.values()}))

# `surrogate_params`: the clip surrogate of a config with its KL and entropy terms left out.
_FULL = PolicyLossConfig(clip_low=0.1, clip_high=0.3, delta=2.0, kl_estimator="k3", kl_coef=0.1, entropy_coef=0.01)
CASES["surrogate_params_clip"] = Case(PolicyLossConfig(clip_low=0.1, clip_high=0.3, delta=2.0),
                                      surrogate_params(_FULL, "clip"), exercises=("clip_low", "clip_high", "delta"))

# Configs whose old_logp, ref_logp or advantages hold NaN: every objective, each KL estimator, clamp and the bias
# correction, δ, the dual clip and the log-ratio clamp. (min(w, δ) once took δ for a NaN w: grpo's loss was ±inf.)
NAN_CASES = {
    **{name: CASES[name] for name in ("clip", "bf16_tau", "log_ratio_clamp_k2", "kl_k3_clamp_bias_c20", "sapo",
                                      "dppo_kl_cap", "dro", "kl_metric_only")},
    "grpo": make_case(ref=True, kl_estimator="k3", kl_coef=0.04),
    "clip_delta_dual_k1_clamp_bias": make_case(delta=1.5, dual_clip=2.0, ref=True, kl_estimator="k1", kl_coef=0.1,
                                           kl_clamp=0.2, kl_bias_correction=True, entropy_coef=0.01),
    "clip_delta_dual_k3_clamp_bias_c2": _c2(delta=1.3, dual_clip=1.5, kl_estimator="k3", kl_coef=0.1, kl_clamp=0.2,
                                            kl_bias_correction=True, entropy_coef=0.01),
    "cispo_k3": make_case(objective="cispo", clip_low=0.2, clip_high=0.4, ref=True, kl_estimator="k3", kl_coef=0.1),
    "sapo_k3_clamp": make_case(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, ref=True, kl_estimator="k3",
                           kl_coef=0.05, kl_clamp=0.1),
    "sapo_k2_c2": _c2(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_estimator="k2", kl_coef=0.1),
    "dppo_tv_k1": make_case(objective="dppo_tv", clip_low=0.05, clip_high=0.03, ref=True, kl_estimator="k1",
                        kl_coef=0.1),
    "dppo_kl_cap_k2": make_case(objective="dppo_kl", clip_low=0.05, clip_high=0.03, ratio_cap=1.5, ref=True,
                            kl_estimator="k2", kl_coef=0.1),
    "dppo_kl_cap_k1_c2": _c2(objective="dppo_kl", clip_low=0.05, clip_high=0.05, ratio_cap=1.5, kl_estimator="k1",
                             kl_coef=0.1),
    "reinforce_k3_bias": make_case(objective="reinforce", ref=True, kl_estimator="k3", kl_coef=0.1,
                               kl_bias_correction=True, log_ratio_clamp=1.0),
    "gppo_dual_k1": make_case(objective="gppo", dual_clip=2.0, gppo_beta_low=0.8, gppo_beta_high=1.5, ref=True,
                              kl_estimator="k1", kl_coef=0.1),
}

# The branches `exercises` may name; between them the cases name every one.
BRANCHES = ("clip_low", "clip_high", "delta", "dual_clip", "log_ratio_clamp", "kl_log_ratio_clamp", "kl_clamp")


def fwd_cases():
    """The cases policy_token_fwd can express: it computes H itself (A = 0 it takes as zeros)."""
    return [name for name, case in CASES.items() if case.entropy]


def seed(name):
    return sum(map(ord, name))


# --------------------------------------------------------------------------------------------
# Backends


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    kernels: Any  # the module with policy_token_fwd / policy_token_loss
    device: str
    available: Tuple[bool, str]
    acc: torch.dtype  # of the per-token inputs and outputs (and of the forward's logits when fp64)
    fwd_shape: tuple  # (B, T, V) of policy_token_fwd's cases
    loss_shape: tuple  # (B, T) of policy_token_loss's cases
    fwd_tol: tuple  # (rtol, atol) of `close`: ℓ from logits adds fp32's ~1e-6 absolute error
    loss_tol: tuple  # the same values in and out: only the op's rounding
    nan_for_bad_targets: bool = False  # policy_token_fwd: a target outside [0, V) gives NaN, not an error
    marks: tuple = ()

    def param(self):
        return pytest.param(self, id=self.name, marks=[*self.marks, pytest.mark.skipif(not self.available[0],
                                                                                         reason=self.available[1])])

    @property
    def fp64(self):
        return self.acc == torch.float64


_FWD_FP32, _LOSS_FP32 = (1e-5, 1e-5), (2e-6, 5e-7)
_ON_CUDA = torch.cuda.is_available()
BACKENDS = [
    # fwd (4, 16, 301): V odd, a partial last vector step on the CPU, a misaligned row on CUDA
    Backend("cpu", cpu, "cpu", cpu.available(), torch.float32, (4, 16, 301), (6, 50), _FWD_FP32, _LOSS_FP32),
    Backend("cpu-fp64", cpu, "cpu", cpu.available(), torch.float64, (4, 16, 301), (6, 50), (1e-9, 1e-11),
            (1e-12, 1e-14)),
    # The interpreter is slow: 10 rows of V = 200 (one tile) for the forward, one program of 256 for the loss.
    Backend("triton", tk, "cuda" if _ON_CUDA else "cpu", _TRITON, torch.float32, (2, 5, 200), (5, 50),
            _FWD_FP32, _LOSS_FP32, nan_for_bad_targets=True),
    Backend("cuda", cuda, "cuda", cuda.available(), torch.float32, (4, 16, 301), (6, 50), _FWD_FP32, _LOSS_FP32,
            nan_for_bad_targets=True, marks=(pytest.mark.gpu,)),
]
BY_NAME = {b.name: b for b in BACKENDS}


def params(backends=BACKENDS):
    return [b.param() for b in backends]


def shape_params(op):
    """pytest params (acc, shape) of each distinct dtype and shape of the backends of `op` ("fwd" or "loss")."""
    pairs = dict.fromkeys((b.acc, getattr(b, f"{op}_shape")) for b in BACKENDS)
    return [pytest.param(acc, shape, id=("fp64-" if acc == torch.float64 else "fp32-") + "x".join(map(str, shape)))
            for acc, shape in pairs]


# Fewer tokens than this (the Triton interpreter's forward: 10) cannot put some, not all, of a case's tokens in
# each of its branches: there the union of the cases is checked instead (`missing_branches_of_all`).
MIN_TOKENS_PER_CASE = 50


def checks_branches_per_case(shape):
    return shape[0] * shape[1] >= MIN_TOKENS_PER_CASE


# --------------------------------------------------------------------------------------------
# Inputs and the spec


@dataclasses.dataclass
class Inputs:
    """(B, T) fp64 tensors holding values exactly representable in the op's dtype; the forward's logits."""
    mask: torch.Tensor
    weight: torch.Tensor
    logp: torch.Tensor  # the op's input, or ℓ of the logits in fp64
    entropy: Optional[torch.Tensor]  # the same
    adv: Optional[torch.Tensor]
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    logits: Optional[torch.Tensor] = None  # (N, V) in the op's dtype (policy_token_fwd)
    targets: Optional[torch.Tensor] = None
    lse_parts: Optional[torch.Tensor] = None  # (N, 2) of the logits in fp64


def draw_inputs(case: Case, acc: torch.dtype, seed: int, shape) -> Inputs:
    """Inputs of `case` for an op computing in `acc`: shape (B, T) gives ℓ and H (policy_token_loss),
    (B, T, V) logits (policy_token_fwd)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = case.config
    b, t = shape[:2]
    n = b * t
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = t  # a full row
    if b > 2:
        lengths[2] = 0  # and an empty one
    mask = (torch.arange(t)[None, :] < lengths[:, None]) & (torch.rand(b, t, generator=gen) > 0.1)  # and holes
    weight = aggregation_weights(mask, cfg.agg, norm_length=cfg.norm_length, dtype=torch.float64)
    logits = targets = lse_parts = None
    if len(shape) == 3:
        vocab = case.vocab or shape[2]
        dtype = torch.float64 if acc == torch.float64 else case.dtype
        logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2
        targets = torch.randint(0, vocab, (n,), generator=gen)
        targets[0], targets[1] = 0, vocab - 1  # both ends of a row
        # Targets raised by up to 8: ℓ from about −10 to near 0 (DPPO's bounds are on e^ℓ − e^ℓ_old).
        logits[torch.arange(n), targets] += torch.rand(n, generator=gen, dtype=torch.float64) * 8
        logits = logits.to(dtype)
        logp, entropy, lse_parts = torch_chunked.token_logprobs_fwd(logits.double(), targets, case.temperature, True)
        logp, entropy = logp.view(b, t), entropy.view(b, t)
    else:
        # ℓ ≤ −HALF_WIDTH, so that ℓ_old = ℓ − r ≤ 0 too: log-probs (DPPO's e^ℓ_old is a probability)
        logp = -HALF_WIDTH - torch.rand(b, t, generator=gen, dtype=torch.float64) * 5
        entropy = torch.rand(b, t, generator=gen, dtype=torch.float64) * 4 if case.entropy else None
    adv = None
    if case.adv:
        adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
        adv[0, :3] = 0.0  # A = 0: every branch of the clip objective ties
    c = cfg.log_ratio_clamp
    old = ref = None
    if case.old:
        bounds = [1 + cfg.clip_high if cfg.clip_high is not None else None, cfg.delta, cfg.dual_clip]
        if cfg.clip_low is not None and cfg.clip_low < 1:
            bounds.append(1 - cfg.clip_low)
        kinks = [-c, c] + [math.log(x) for x in bounds if x is not None]
        flat = logp.reshape(-1)
        # ... and ℓ_old ≤ 0 where ℓ comes from logits (r ≥ ℓ)
        r = uniform_away(gen, n, HALF_WIDTH, lambda r: close_to(r, kinks) | (r < flat))
        old = logp - r.view(b, t)
    if case.ref:
        def kl_kinks(d):
            near = close_to(d, [-c, c])
            if case.params.kl_estimator != KL_NONE and cfg.kl_clamp is not None:
                near |= close_to(kl_term(d, cfg.kl_estimator, c).abs(), [cfg.kl_clamp])
            return near

        ref = logp + uniform_away(gen, n, REF_HALF_WIDTH, kl_kinks).view(b, t)
    exact = lambda x: None if x is None else x.to(acc).double()  # noqa: E731
    if logits is None:
        logp, entropy = exact(logp), exact(entropy)
    return Inputs(mask, exact(weight), logp, entropy, exact(adv), exact(old), exact(ref), logits, targets, lse_parts)


@dataclasses.dataclass
class Spec:
    grad_logp: torch.Tensor  # (N,)
    grad_entropy: torch.Tensor  # (N,)
    stats: torch.Tensor  # (N, NUM_STATS)


def spec(case: Case, x: Inputs) -> Spec:
    """Torch autograd of rlkernels.losses in fp64 at ℓ and H of `x` (None: H = 0, A = 0)."""
    cfg = case.config
    shape = tuple(x.mask.shape)
    zeros = torch.zeros(shape, dtype=torch.float64)
    lp = x.logp.clone().requires_grad_()
    ent = (zeros if x.entropy is None else x.entropy).clone().requires_grad_()
    inputs = LossInputs.build(cfg, shape=shape, dtype=torch.float64, device=torch.device("cpu"), mask=x.mask,
                              advantages=zeros if x.adv is None else x.adv, old_logp=x.old, ref_logp=x.ref)
    b, ref_m, ent_m = inputs.masked(lp, ent, cfg)
    per_token, sur, k = per_token_loss(b, cfg, ref_m, ent_m)
    zero = torch.zeros((), dtype=torch.float64)
    weighted = torch.where(x.mask, per_token * x.weight, zero)
    g_logp, g_ent = torch.autograd.grad(weighted.sum(), (lp, ent), allow_unused=True)
    g_logp = torch.zeros_like(lp) if g_logp is None else g_logp
    g_ent = torch.zeros_like(ent) if g_ent is None else g_ent
    approx_kl = kl_estimate(b.old_logp, b.logp.detach(), "k3", cfg.log_ratio_clamp)
    cols = [weighted, sur.clipped_low, sur.clipped_high, sur.ratio, approx_kl, zeros if k is None else k, ent_m]
    stats = torch.where(x.mask[..., None], torch.stack([col.detach().double() for col in cols], -1), zero)
    return Spec(g_logp.reshape(-1), g_ent.reshape(-1), stats.reshape(-1, NUM_STATS))


def reached_branches(case: Case, x: Inputs, spec: Spec):
    """{branch: where each token takes it} of the branches `x` can reach."""
    cfg = case.config
    c = cfg.log_ratio_clamp
    w = spec.stats[:, RATIO]
    adv = torch.zeros_like(w) if x.adv is None else x.adv.reshape(-1)
    logp = x.logp.reshape(-1)
    reached = {"clip_low": spec.stats[:, CLIP_LOW].bool(), "clip_high": spec.stats[:, CLIP_HIGH].bool()}
    if cfg.objective == "clip":
        delta = cfg.delta if cfg.delta is not None else math.inf
        # u = −A·δ wins over k = −A·(1 + ε_high): the delta branch, no gradient
        reached["delta"] = (w > delta) & (adv < 0)
        surrogate = torch.maximum(-adv * w.clamp(max=delta), -adv * w.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
        reached["dual_clip"] = (adv < 0) & (surrogate > -(cfg.dual_clip or math.inf) * adv)
    if cfg.objective == "gppo":  # for A < 0: −β₁·(1 − ε_low)·A on a token held below the band, else −A·w
        lo = 1 - cfg.clip_low
        surrogate = -adv * torch.where((w < lo) & (adv < 0), cfg.gppo_beta_low * lo, w)
        reached["dual_clip"] = (adv < 0) & (surrogate > -(cfg.dual_clip or math.inf) * adv)
    if x.old is not None:
        reached["log_ratio_clamp"] = (logp - x.old.reshape(-1)).abs() > c
    if x.ref is not None:
        d = x.ref.reshape(-1) - logp
        reached["kl_log_ratio_clamp"] = d.abs() > c
        if cfg.kl_clamp is not None and cfg.kl_estimator is not None:
            reached["kl_clamp"] = kl_term(d, cfg.kl_estimator, c).abs() > cfg.kl_clamp
    m = x.mask.reshape(-1)
    return {name: r & m for name, r in reached.items()}


def missing_branches(case: Case, x: Inputs, spec: Spec):
    """The branches of `case.exercises` that no unmasked token reaches, or that all of them do."""
    reached, m = reached_branches(case, x, spec), x.mask.reshape(-1)
    return [name for name in case.exercises
            if name not in reached or not reached[name].any() or (reached[name] | ~m).all()]


def missing_branches_of_all(draws):
    """The branches of BRANCHES that no token of any of `draws` ((case, inputs, spec)) reaches."""
    hit = set()
    for case, x, s in draws:
        hit |= {name for name, r in reached_branches(case, x, s).items() if r.any()}
    return [name for name in BRANCHES if name not in hit]


def branch_gaps(names, acc, shape):
    """{case: its missing branches} at `shape` in `acc` ([""]: the union's, for shapes too small per case)."""
    draws = []
    for name in names:
        case = CASES[name]
        x = draw_inputs(case, acc, seed(name), shape)
        draws.append((case, x, spec(case, x)))
    if not checks_branches_per_case(shape):
        gaps = missing_branches_of_all(draws)
        return {"(all cases)": gaps} if gaps else {}
    return {name: gaps for name, (case, x, s) in zip(names, draws) if (gaps := missing_branches(case, x, s))}


# Padding of masked tokens: the op must not read it (the weight is 0 there, as the contract says).
PADDING = {"logp": math.nan, "entropy": math.inf, "adv": -math.inf, "old": -math.inf, "ref": math.nan}


def token_args(x: Inputs, acc, device, padding=PADDING, names=("logp", "entropy", "adv", "old", "ref")):
    """{name: flat per-token input in `acc` on `device`, its masked tokens padded} of `names` (None where absent)."""
    m = x.mask.reshape(-1)

    def token(name):
        t = getattr(x, name)
        return None if t is None else torch.where(m, t.reshape(-1), padding[name]).to(acc).to(device)

    return {name: token(name) for name in names}


def close(name, actual, expected, tol):
    """Each element within rtol of its value plus atol of the largest of its column: the inputs are
    the same values, so only the op's rounding (and, for the forward, fp32's ℓ) is allowed."""
    rtol, atol = tol
    scale = expected.abs().amax(0).clamp(min=1e-3) if expected.numel() else 1.0
    actual = actual.double().cpu()
    err = (actual - expected).abs()
    bound = rtol * expected.abs() + atol * scale
    assert not err.isnan().any(), f"{name}: NaN where the spec is {expected[err.isnan()][:5].tolist()}"
    if not err.numel():
        return
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), (f"{name}: max error / bound {(err / bound).max():.3g} at {worst} (got "
                                  f"{actual.reshape(-1)[worst].item()!r}, want {expected.reshape(-1)[worst].item()!r})")


def close_to_spec(grad_logp, grad_entropy, stats, s: Spec, tol, nans=False):
    """The op's gradients and statistics against the spec's (`nans`: NaN exactly where the spec's are)."""
    columns = [("grad_logp", grad_logp, s.grad_logp), ("grad_entropy", grad_entropy, s.grad_entropy)]
    columns += [(f"stats[:, {j}] ({col})", stats[:, j], s.stats[:, j]) for j, col in enumerate(STATS)]
    for col, actual, expected in columns:
        if nans:
            assert_like_spec_with_nans(col, actual, expected, lambda *a: close(*a, tol))
        else:
            close(col, actual, expected, tol)


# --------------------------------------------------------------------------------------------
# Drawing log-ratios away from the kinks of the token loss (the clip bounds, ±c, ±kl_clamp), where an
# fp32 kernel and the fp64 spec could take different branches.

KINK_MARGIN = 1e-3  # distance of every drawn value from a kink; fp32's error of ℓ is ~1e-6


def uniform_away(gen, n, half_width, near_kink):
    """n values uniform in [−half_width, half_width], each redrawn until `near_kink` is False."""
    draw = lambda k: (torch.rand(k, generator=gen, dtype=torch.float64) * 2 - 1) * half_width  # noqa: E731
    x = draw(n)
    while (redo := near_kink(x)).any():
        x[redo] = draw(int(redo.sum()))
    return x


def close_to(x, points):
    """Where x is within KINK_MARGIN of one of `points`."""
    if not points:
        return torch.zeros_like(x, dtype=torch.bool)
    return torch.stack([(x - p).abs() < KINK_MARGIN for p in points]).any(0)


def kl_term(delta, estimator, log_ratio_clamp):
    """The KL estimate of Δ = ℓ_ref − ℓ before its kl_clamp (the spec's, which clamps Δ where the estimator does)."""
    return kl_estimate(delta, torch.zeros_like(delta), estimator, log_ratio_clamp).detach()


# --------------------------------------------------------------------------------------------
# NaN in a per-token input: each output NaN exactly where the spec's is (torch's min, max and clamp keep a
# NaN; a gradient that a clamp stops is 0, even through a NaN factor).

def with_nans(t, mask):
    """A copy of `t` with NaN on every other token that `mask` keeps."""
    t = t.clone()
    t.view(-1)[torch.nonzero(mask.reshape(-1))[::2, 0]] = math.nan
    return t


def with_nan_fields(make_inputs):
    """`make_inputs()` once per field of ℓ_old, ℓ_ref and A that it has, with NaN on some unmasked tokens of that
    field (`with_nans`)."""
    for field in ("old", "ref", "adv"):
        x = make_inputs()
        if getattr(x, field) is not None:
            yield dataclasses.replace(x, **{field: with_nans(getattr(x, field), x.mask)})


def assert_same_nans(name, actual, expected):
    """`actual` is NaN where `expected` is and nowhere else."""
    actual = actual.detach().cpu()
    wrong = torch.nonzero((actual.isnan() != expected.isnan()).reshape(-1))[:5, 0].tolist()
    assert not wrong, (f"{name}: NaN-ness unlike the spec's at {wrong}: got {actual.reshape(-1)[wrong].tolist()}, "
                       f"want {expected.reshape(-1)[wrong].tolist()}")


def assert_like_spec_with_nans(name, actual, expected, close):
    """NaN exactly where the spec's `expected` is, the other values checked by `close(name, actual, expected)`
    with the NaN positions zeroed on both sides."""
    assert_same_nans(name, actual, expected)
    nan = expected.isnan()
    close(name, actual.detach().cpu().double().masked_fill(nan, 0), expected.masked_fill(nan, 0))


# Bad scalars of the token loss (TokenLossParams fields), each refused with an error naming it, by
# policy_token_fwd and policy_token_loss alike (the checks of csrc/include/rlkernels/token_loss_args.h).
BAD_LOSS_SCALARS = [
    ("objective", dict(objective=max(e.id for e in P.OBJECTIVES) + 1)),
    ("objective", dict(objective=1.5)),
    ("kl_estimator", dict(kl_estimator=max(e.id for e in P.KL_ESTIMATORS) + 1)),
    ("clip_low", dict(clip_low=math.nan)),
    ("clip_low", dict(clip_low=-0.1)),
    ("clip_high", dict(clip_high=math.nan)),
    ("clip_high", dict(clip_high=-1.0)),
    ("delta", dict(delta=math.nan)),
    ("delta", dict(delta=0.0)),
    ("dual_clip", dict(dual_clip=math.nan)),
    ("kl_coef", dict(kl_coef=math.nan)),
    ("kl_coef", dict(kl_coef=math.inf)),
    ("kl_coef", dict(kl_coef=-0.1)),
    ("kl_clamp", dict(kl_clamp=math.nan)),
    ("kl_clamp", dict(kl_clamp=0.0)),
    ("entropy_coef", dict(entropy_coef=math.nan)),
    ("log_ratio_clamp", dict(log_ratio_clamp=math.nan)),
    ("log_ratio_clamp", dict(log_ratio_clamp=0.0)),
    ("sapo_tau_pos", dict(sapo_tau_pos=0.0)),
    ("sapo_tau_neg", dict(sapo_tau_neg=math.nan)),
    ("ratio_cap", dict(ratio_cap=0.0)),
    ("dro_beta", dict(dro_beta=-0.1)),
    ("dro_beta", dict(dro_beta=math.inf)),
    ("gppo_beta_low", dict(gppo_beta_low=0.0)),
    ("gppo_beta_high", dict(gppo_beta_high=math.nan)),
    ("gppo_beta_high", dict(gppo_beta_high=math.inf)),
]


# --------------------------------------------------------------------------------------------
# Exact bounds: w exactly on 1 − ε_low, 1 + ε_high, δ or the dual clip c, and ℓ − ℓ_old exactly ±c, where the
# derivative is autograd's convention, not a limit: a clamp passes the gradient on its closed interval, min / max
# give half to each side of a tie (PPO's max(u, k) ties on the whole band, the dual clip's min at w = c), a flag
# is strict. The random cases above stay away from these points; these sit on them, and are checked against
# reference.py (values, gradients and flags), in the op's own dtype so that it sees the same w.


@dataclasses.dataclass(frozen=True)
class Boundary:
    fields: tuple  # the PolicyLossConfig's (name, value) pairs, agg token_mean
    log_ratio: Tuple[float, ...] = (0.0,)  # ℓ − ℓ_old of each row's tokens, exact in every dtype
    on_dual_clip: bool = False  # instead: w = dual_clip = v of `exp_point(3)`, in the op's dtype


_BOUNDARY_ADV = (-1.5, -0.5, 0.75, 2.0)  # each row's tokens: both signs of A on every point


def _boundary(log_ratio=(0.0,), on_dual_clip=False, **config):
    PolicyLossConfig(**config)  # valid
    return Boundary(tuple(config.items()), tuple(log_ratio), on_dual_clip)


# w = e^0 = 1 exactly on every backend: ε = 0 puts a bound there, δ = 1 the delta; for the dual clip
# (c > 1) the log-ratio is one whose e^r lies within 1e-3 ulp of a number v (exp_point), which every faithful exp
# rounds to: then w = v = c in the op too.
BOUNDARY_CASES = {
    "clip_w_on_low": _boundary(clip_low=0.0, clip_high=0.2),
    "clip_w_on_high": _boundary(clip_low=0.2, clip_high=0.0),
    "clip_w_on_delta": _boundary(clip_low=0.2, clip_high=0.2, delta=1.0),
    "clip_w_on_dual_clip": _boundary(on_dual_clip=True, clip_low=0.2, clip_high=0.2, dual_clip=3.0),
    "clip_r_on_log_ratio_clamp": _boundary((0.5, -0.5), clip_low=0.9, clip_high=1.0, log_ratio_clamp=0.5),
    "gppo_w_on_both": _boundary(objective="gppo", clip_low=0.0, clip_high=0.0),
    "gppo_w_on_dual_clip": _boundary(on_dual_clip=True, objective="gppo", clip_low=0.2, clip_high=0.2,
                                     dual_clip=3.0),
    "cispo_w_on_both": _boundary(objective="cispo", clip_low=0.0, clip_high=0.0),
    "topr_w_on_one": _boundary(objective="topr", clip_low=None, clip_high=None),
}


@functools.lru_cache(maxsize=None)
def exp_point(target: float, dtype: torch.dtype) -> Tuple[float, float]:
    """(r, v): r in `dtype` near log(target), with ℓ_old = −3 and ℓ = ℓ_old + r both exact there, whose e^r is
    within 1e-3 ulp of v in `dtype` (mpmath's e^r, 50 digits) and numpy's e^r is v. Tried at
    log(target·(1 + j·1e-6)): consecutive r
    would move e^r by a nearly constant fraction of an ulp."""
    import mpmath
    mpmath.mp.dps = 50
    ulp = torch.finfo(dtype).eps * 2  # of numbers in [2, 4)
    for j in range(100_000):
        r = float(torch.tensor(math.log(target * (1 + j * 1e-6)), dtype=dtype))
        if float(torch.tensor(r - 3.0, dtype=dtype)) != r - 3.0:
            continue
        exact = mpmath.exp(mpmath.mpf(r))
        v = float(torch.tensor(float(exact), dtype=torch.float64).to(dtype))
        # numpy's exp (the Triton interpreter's) is not faithful: it must round to v too
        if 2 <= v < 4 and abs(exact - v) < 1e-3 * ulp and float(numpy.exp(numpy.dtype(str(dtype)[6:]).type(r))) == v:
            return r, v
    raise AssertionError(f"no exp point near {target}")


def boundary_inputs(case: Boundary, dtype: torch.dtype):
    """(config, logp, old_logp, adv, mask) in `dtype`: one row per log-ratio, a token per advantage."""
    fields, r = dict(case.fields), list(case.log_ratio)
    if case.on_dual_clip:
        r, fields["dual_clip"] = exp_point(fields["dual_clip"], dtype)
        r = [r]
    config = PolicyLossConfig(agg="token_mean", **fields)
    old = torch.full((len(r), len(_BOUNDARY_ADV)), -3.0, dtype=dtype)
    logp = old + torch.tensor(r, dtype=dtype)[:, None]
    assert torch.equal(logp - old, torch.tensor(r, dtype=dtype)[:, None].expand_as(old)), "ℓ − ℓ_old not exact"
    adv = torch.tensor(_BOUNDARY_ADV, dtype=dtype).expand_as(old).clone()
    return config, logp, old, adv, torch.ones_like(old, dtype=torch.bool)


def with_edge_rows(logits):
    """A copy of (N, V) `logits` whose row 0 holds −inf entries, row 1 is all −inf and row 2 holds a NaN."""
    z = logits.clone()
    z[0, ::3] = -math.inf
    z[1] = -math.inf
    z[2, 5] = math.nan
    return z
