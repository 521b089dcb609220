"""setup.py's choice of a CUDA build (issue 33 item 1): with a CUDA torch and nvcc but no GPU to read an
architecture from and no TORCH_CUDA_ARCH_LIST, torch's own flag selection fails with a bare IndexError, so the
build goes CPU-only and says why; with an architecture list, or a visible GPU, it builds for those."""
import importlib.util
import os
import types

import pytest
import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("rlkernels_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the functions, builds nothing
    return module


def fake_torch(cuda_version="13.0", capabilities=()):
    """A torch of the given CUDA version (None: a CPU build) whose visible GPUs have these capabilities."""
    cuda = types.SimpleNamespace(device_count=lambda: len(capabilities),
                                 get_device_capability=lambda i: capabilities[i])
    return types.SimpleNamespace(version=types.SimpleNamespace(cuda=cuda_version), cuda=cuda)


NVCC = types.SimpleNamespace(CUDA_HOME=None)  # nvcc found on PATH (monkeypatched below) or not at all


def test_torch_itself_fails_without_an_architecture(monkeypatch):
    """The premise: no visible GPU and no TORCH_CUDA_ARCH_LIST is the IndexError the issue met."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(IndexError):
        cpp_extension._get_cuda_arch_flags()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert any("sm_90" in f for f in cpp_extension._get_cuda_arch_flags())


@pytest.mark.parametrize("arch_list", [None, "", "native"])
def test_no_gpu_and_no_arch_list_builds_cpu_only_saying_why(setup_py, monkeypatch, arch_list):
    monkeypatch.setattr(setup_py, "_nvcc", lambda ext: "/usr/local/cuda/bin/nvcc")
    env = {} if arch_list is None else {"TORCH_CUDA_ARCH_LIST": arch_list}
    with_cuda, note = setup_py._cuda_plan(fake_torch(), NVCC, True, env)
    assert not with_cuda
    assert "no GPU is visible" in note and "TORCH_CUDA_ARCH_LIST" in note


def test_an_arch_list_or_a_visible_gpu_builds_cuda(setup_py, monkeypatch):
    monkeypatch.setattr(setup_py, "_nvcc", lambda ext: "/usr/local/cuda/bin/nvcc")
    assert setup_py._cuda_plan(fake_torch(), NVCC, True, {"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}) == \
        (True, "with CUDA for GPU architectures 8.0;9.0")
    with_cuda, note = setup_py._cuda_plan(fake_torch(capabilities=[(9, 0), (8, 0), (9, 0)]), NVCC, True, {})
    assert with_cuda and note.endswith("8.0;9.0")


def test_other_reasons_for_no_cuda(setup_py, monkeypatch):
    monkeypatch.setattr(setup_py, "_nvcc", lambda ext: None)
    gpu = fake_torch(capabilities=[(9, 0)])
    assert setup_py._cuda_plan(gpu, NVCC, True, {})[1].startswith("no CUDA: this torch is a CUDA build but no nvcc")
    assert setup_py._cuda_plan(fake_torch(cuda_version=None), NVCC, True, {}) == (False, "no CUDA (a CPU build of torch)")
    assert setup_py._cuda_plan(gpu, NVCC, True, {"RLKERNELS_NO_CUDA": "1"}) == (False, "no CUDA (RLKERNELS_NO_CUDA=1)")


def test_an_install_without_the_extension_says_so(tmp_path):
    """The cpu backend's reason when rlkernels._C was never built (a pure-Python or isolated install): that, not
    Python's "partially initialized module ... circular import" of `from rlkernels import _C`."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(os.path.join(ROOT, "rlkernels"), tmp_path / "rlkernels",
                    ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    script = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
              "import rlkernels; print(rlkernels.backend_info()['cpu']['reason'])")  # the editable finder maps _C
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "circular" not in out.stdout and "this install has no compiled extension" in out.stdout, out.stdout
