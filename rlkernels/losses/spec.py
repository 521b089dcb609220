"""The spec's pieces that `ops/` and the integrations may use beyond the public names of `losses/`.

A fused step evaluates part of a loss with kernels and the rest with these functions, so both agree
with `policy_loss` by construction. python_tests/test_layers.py fails on an import past this module.
"""
from . import objectives
from .aggregation import aggregate, aggregation_weights, masked_mean
from .inputs import LossInputs, takes_loss_args
from .metrics import metrics_from_sums
from .policy_loss import evaluate, high_entropy_tokens, per_token_loss, separate_entropy_bonus, surrogate_weights
from .surrogates import cispo_weight, clip_cov_tokens, gepo_log_expectation, snis_advantage, vespo_weight

__all__ = ["objectives", "aggregate", "aggregation_weights", "masked_mean", "LossInputs", "metrics_from_sums", "evaluate",
           "high_entropy_tokens", "per_token_loss", "separate_entropy_bonus", "surrogate_weights",
           "cispo_weight", "clip_cov_tokens", "gepo_log_expectation", "snis_advantage", "vespo_weight", "takes_loss_args"]
