"""Drop-ins for training code outside rlkernels (docs/design.md §10); never imported by the core."""
