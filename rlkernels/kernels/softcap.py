"""A backend's kernels with a final-logit cap bound, so that the ops above pass it once (docs/design.md §2)."""
from __future__ import annotations

from typing import Optional

from . import Kernels


class SoftCapped:
    """`Kernels` whose passes over logits read every logit z as c·tanh(z/c); the ops on log-probs
    (`policy_token_loss`, `covariance_choice`) and `scale_grad_` read no logits and are the backend's own."""

    def __init__(self, kernels: Kernels, softcap: float):
        self.kernels, self.softcap = kernels, softcap

    def supports(self, op: str) -> Optional[str]:
        return self.kernels.supports(op)

    def token_logprobs_fwd(self, *args, **kwargs):
        return self.kernels.token_logprobs_fwd(*args, softcap=self.softcap, **kwargs)

    def token_logprobs_bwd(self, *args, **kwargs):
        return self.kernels.token_logprobs_bwd(*args, softcap=self.softcap, **kwargs)

    def policy_token_fwd(self, *args, **kwargs):
        return self.kernels.policy_token_fwd(*args, softcap=self.softcap, **kwargs)

    def policy_token_fwd_grad(self, *args, **kwargs):
        return self.kernels.policy_token_fwd_grad(*args, softcap=self.softcap, **kwargs)

    def scale_grad_(self, *args, **kwargs):
        return self.kernels.scale_grad_(*args, **kwargs)

    def policy_token_loss(self, *args, **kwargs):
        return self.kernels.policy_token_loss(*args, **kwargs)

    def covariance_choice(self, *args, **kwargs):
        return self.kernels.covariance_choice(*args, **kwargs)


def with_softcap(kernels: Kernels, softcap: float) -> Kernels:
    """`kernels` whose passes over logits apply the cap `softcap` (0.0: `kernels` themselves)."""
    return SoftCapped(kernels, softcap) if softcap else kernels
