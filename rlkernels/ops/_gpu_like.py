"""Whether the hidden-state path takes a GPU's choices for a tensor (chunk rows, the ∂W GEMM with an fp32
result, the conversion that scales as it casts): CUDA tensors, and fake ones while benchmarks/traffic.py
models a GPU's traffic on fake CPU tensors (`MODEL_GPU`)."""
from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

MODEL_GPU = False  # set by benchmarks/traffic.py for the duration of its model


def gpu_like(t: Tensor) -> bool:
    return t.is_cuda or (MODEL_GPU and is_fake(t))
