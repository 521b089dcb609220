"""Options of the pytest-benchmark suite: `pytest benchmarks --benchmark-only [--bench-n 8192 ...]`."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: idle OpenMP threads sleep

import torch  # noqa: E402

from benchmarks.report import DEFAULTS  # noqa: E402


def pytest_addoption(parser):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = DEFAULTS[device]
    group = parser.getgroup("rlkernels benchmarks")
    group.addoption("--bench-device", default=device)
    group.addoption("--bench-n", type=int, default=d["n"], help="tokens (B·T)")
    group.addoption("--bench-vocab", type=int, default=d["vocab"])
    group.addoption("--bench-dtype", default=d["dtype"], choices=["fp32", "bf16", "fp16"])
    group.addoption("--bench-hidden", type=int, default=d["hidden"], help="H of grpo_linear")
