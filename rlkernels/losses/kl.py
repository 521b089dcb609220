"""KL estimators of docs/math.md §6, with Δ = ℓ_ref − ℓ (Schulman's k1, k2, k3)."""
from __future__ import annotations

import torch


def kl_estimate(ref_logp: torch.Tensor, logp: torch.Tensor, estimator: str, log_ratio_clamp: float) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π; gradients w.r.t. ℓ are 1, −Δ, 1 − e^Δ."""
    delta = (ref_logp - logp).clamp(-log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        # expm1 keeps k3 ≥ 0 and accurate for small Δ, where e^Δ − 1 − Δ cancels.
        return torch.expm1(delta) - delta
    raise ValueError(f"kl_estimator: expected 'k1', 'k2' or 'k3', got {estimator!r}")
