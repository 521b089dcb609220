import os

# Idle OpenMP threads sleep instead of spinning: the tests start several processes (gloo ranks,
# benchmarks) on few cores, where spinning threads slowed calls 10-50×. Must precede torch's import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A fresh torch.compile cache per test session: inductor's cache key does not cover the fake
# implementations of custom ops, so graphs compiled against an older kernel contract would be reused.
import tempfile  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="rlkernels_inductor_"))

import pytest  # noqa: E402
import torch  # noqa: E402


# @triton.jit picks interpreter or compiled mode when a kernel is decorated, so the interpreter
# must be chosen before any test imports rlkernels' Triton kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`exhaustive` sweeps run where they are cheap (a GPU) or when asked: under the interpreter CI runs their sample."""
    if os.environ.get("RLKERNELS_EXHAUSTIVE") == "1" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="an exhaustive sweep: RLKERNELS_EXHAUSTIVE=1 runs it")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def restore_verl(monkeypatch):
    """Whatever a test patches in verl's fused-kernel path (`register(fused_kernels=True)` does) is put back afterwards."""
    torch_functional = pytest.importorskip("verl.utils.experimental.torch_functional")
    kernel = pytest.importorskip("verl.utils.kernel.linear_cross_entropy")
    monkeypatch.setattr(kernel, "linear_cross_entropy", kernel.linear_cross_entropy)
    monkeypatch.setattr(torch_functional, "FusedLinearForPPO", torch_functional.FusedLinearForPPO)
