import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # shared input builders (loss_inputs.py)

# @triton.jit picks interpreter or compiled mode when a kernel is decorated, so the interpreter
# must be chosen before any test imports rlkernels' Triton kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
