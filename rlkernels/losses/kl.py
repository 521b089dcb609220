"""KL estimators of docs/math.md §6, with Δ = ℓ_ref − ℓ: Schulman's k1, k2, k3 of Δ clamped to ±c (the fused
kernels' three), and verl's `kl_penalty` options under verl's names, each as verl computes it."""
from __future__ import annotations

import torch

BASE_ESTIMATORS = ("k1", "k2", "k3", "kl", "mse", "abs", "low_var_kl")
# verl's names, whose "+" form is the value with the gradient of ½(ℓ − ℓ_ref)² (straight-through)
STRAIGHT_THROUGH = ("kl+", "mse+", "abs+", "low_var_kl+")
# verl's low_var_kl clamps its k3 to ±10 (value and gradient)
LOW_VAR_KL_BOUND = 10.0


def _value(delta: torch.Tensor, estimator: str, c: float) -> torch.Tensor:
    # verl's k1, k2 and |Δ|: Δ is not exponentiated, so not clamped
    if estimator == "kl":
        return -delta
    if estimator == "mse":
        return 0.5 * delta.square()
    if estimator == "abs":
        return delta.abs()
    delta = delta.clamp(-c, c)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    k3 = torch.expm1(delta) - delta  # expm1 keeps k3 ≥ 0 and accurate for small Δ, where e^Δ − 1 − Δ cancels
    return k3 if estimator == "k3" else k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def kl_estimate(ref_logp: torch.Tensor, logp: torch.Tensor, estimator: str, log_ratio_clamp: float) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (docs/math.md §6); a "+" form keeps its base's value
    and takes the gradient of ½(ℓ − ℓ_ref)², unclamped: −Δ."""
    if estimator not in BASE_ESTIMATORS + STRAIGHT_THROUGH:
        raise ValueError(f"kl_estimator: expected one of {BASE_ESTIMATORS + STRAIGHT_THROUGH}, got {estimator!r}")
    value = _value(ref_logp - logp, estimator.rstrip("+"), log_ratio_clamp)
    if not estimator.endswith("+"):
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()
