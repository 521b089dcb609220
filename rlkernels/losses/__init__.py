"""The RL objectives over per-token log-probs (docs/math.md §3-§12): plain PyTorch, one config type."""
from . import objectives, presets  # the registries: objectives.get/names, presets.get/NAMES
from .config import PolicyLossConfig
from .objectives import register_objective, unregister_objective
from .policy_loss import LossOutput, policy_loss
from .rollout_correction import rollout_is_weights, rollout_rejection_mask
from .value_loss import value_loss

__all__ = ["PolicyLossConfig", "register_objective", "unregister_objective", "LossOutput", "policy_loss", "value_loss",
           "objectives", "presets", "rollout_is_weights", "rollout_rejection_mask"]
