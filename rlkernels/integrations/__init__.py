"""Drop-ins for training code outside rlkernels (docs/design.md §10); never imported by the core."""

# the loss names that select a preset of `rlkernels.presets` (a user's included): verl's loss_mode, TRL's loss_type
PRESET_PREFIX = "rlkernels_"
