"""`rlkernels.presets.<name>(**overrides)`: the loss presets of docs/math.md §9 (defined in `losses/presets.py`)."""
from .losses.presets import NAMES, cispo, dapo, dr_grpo, fspo, gepo, get, gmpo, grpo, gspo, gspo_token, ppo, snis  # noqa: F401

__all__ = list(NAMES) + ["get", "NAMES"]
