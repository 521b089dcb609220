"""Drop-ins for training code outside rlkernels (DESIGN.md §1); never imported by the core."""
