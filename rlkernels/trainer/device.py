"""Where the trainer runs and at what precision: `--device`, `--dtype` and the process group backend.

Precision (mixed precision, the usual recipe): the weights and the optimizer state stay float32
(the master copy, which checkpoints and the Hugging Face export hold); with `--dtype bfloat16` the
forward passes (warm-up, generation, scoring, the update's trunk) run under `torch.autocast`, and
the loss head gets the hidden states and the lm_head weight (or the logits) in bfloat16, which the
rlkernels ops accumulate in float32. float16 is refused: its gradients underflow without loss
scaling, which the trainer does not do.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import torch
import torch.distributed as dist

DEVICES = "auto, cpu, cuda or cuda:N"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _available() -> str:
    """What this machine offers, for error messages."""
    if not torch.cuda.is_available():
        why = "a CPU-only torch build" if torch.version.cuda is None else "no CUDA device visible"
        return f"only cpu ({why})"
    n = torch.cuda.device_count()
    return "cpu and " + ", ".join(f"cuda:{i}" for i in range(n))


def check(spec: str, dtype: str) -> None:
    """Raise a ValueError naming the flag when `--device` / `--dtype` cannot run on this machine."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", spec):
        raise ValueError(f"--device: expected {DEVICES}, got {spec!r}")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: CUDA is not available here; this machine has {_available()} "
                             f"(use --device cpu, or auto)")
        if ":" in spec and int(spec[5:]) >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: no such device; this machine has {_available()}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "float16":
        raise ValueError("--dtype float16: not supported (float16 gradients underflow without loss scaling, "
                         "which the trainer does not do); use bfloat16, or float32 where bfloat16 is missing")


def resolve_device(spec: str, local_rank: int = 0, world: int = 1) -> torch.device:
    """The device of `--device` for this process: under torchrun, `cuda` means cuda:LOCAL_RANK."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if ":" in spec and world > 1:  # every rank on one GPU: NCCL refuses, or the ranks fight for memory
        raise ValueError(f"--device {spec}: with {world} processes each rank takes cuda:LOCAL_RANK; "
                         f"use --device cuda (or auto)")
    index = int(spec[5:]) if ":" in spec else local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: rank {local_rank} needs cuda:{index}, and this machine has {_available()}")
    return torch.device("cuda", index)


def _bf16_ok(device: torch.device) -> bool:
    """Whether `device` (the current CUDA device, see `process_device`) computes in bfloat16."""
    if device.type != "cuda":
        return True  # CPU autocast runs bfloat16 everywhere (emulated where the CPU lacks it)
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """The compute dtype of `--dtype` on `device`: auto is bfloat16 on a GPU that has it, else float32."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" and _bf16_ok(device) else torch.float32
    if spec == "bfloat16" and not _bf16_ok(device):
        raise ValueError(f"--dtype bfloat16: {device} ({torch.cuda.get_device_name(device)}) has no bfloat16; "
                         f"use --dtype float32")
    return getattr(torch, spec)


def backend(device: torch.device) -> str:
    """The process group backend for ranks on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclasses.dataclass(frozen=True)
class Placement:
    """The resolved device and compute dtype of a run."""

    device: torch.device
    dtype: torch.dtype

    def autocast(self):
        """The context the forward passes run in: autocast below float32, nothing at float32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def describe(self) -> dict:
        """What a run folder records: device, dtype and the process group backend (None: one process)."""
        group = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."), "backend": group}


def process_device(spec: str, world: int = 1) -> torch.device:
    """The device of this process (LOCAL_RANK from torchrun), made the current CUDA device."""
    device = resolve_device(spec, int(os.environ.get("LOCAL_RANK", 0)), world)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and all_gather_object use the current device
    return device


def placement(device_spec: str, dtype_spec: str, world: int = 1) -> Placement:
    """The Placement of this process."""
    device = process_device(device_spec, world)
    return Placement(device, resolve_dtype(dtype_spec, device))

