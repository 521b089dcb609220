"""`rlkernels.presets.<name>(**overrides)`: the loss presets of docs/math.md §9 (defined in `losses/presets.py`)."""
from .losses.presets import (  # noqa: F401
    NAMES, cispo, clip_cov, dapo, dppo_kl, dppo_tv, dr_grpo, dro, fields, fspo, gepo, get, gmpo, gpg, grpo, gspo,
    gspo_token, kl_cov, luspo, ppo, sapo, snis, vespo,
)

__all__ = list(NAMES) + ["get", "fields", "NAMES"]
