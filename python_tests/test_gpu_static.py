"""benchmarks.gpu_static: the GPU kernels compiled ahead of time for sm_80 / sm_90 without a GPU.

Fast: the default configuration of each Triton kernel (the streaming launch, default flags) for sm_90 in
fp32 and bf16, and the CUDA kernels for sm_90: no local memory (stack or spills), and 128-bit global loads
wherever a row is streamed. Slow: the whole sweep (`python -m benchmarks.gpu_static`), whose table is
printed past pytest's capture so that it lands in the CI log.

Each run is a subprocess: compiling needs the JIT kernels, and conftest.py has set TRITON_INTERPRET=1
(no CUDA here), under which the kernels of this process are decorated for the interpreter.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.gpu_static import Row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NVCC = shutil.which("nvcc") is not None


def _run(tmp_path, *args, timeout):
    """(process, rows) of `python -m benchmarks.gpu_static ARGS`."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_static", *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    rows = [Row(**r) for r in json.loads(out.read_text())] if out.exists() else []
    return proc, rows


def _check(proc, rows):
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert rows, f"no kernel was compiled:\n{log}"
    problems = [f"{r.kernel} {r.backend} {r.arch} {r.dtype} {r.config}: {p}" for r in rows for p in r.problems()]
    assert not problems, "\n".join(problems)
    assert proc.returncode == 0, log


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")),
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_NVCC, reason="nvcc is not on PATH")),
])
def test_default_configurations_stream_in_128_bit_loads_without_local_memory(tmp_path, backend):
    dtypes = ["fp32", "bf16"]
    proc, rows = _run(tmp_path, "--backend", backend, "--arch", "sm_90", "--dtype", *dtypes, "--quick",
                      "--jobs", "2", timeout=600)
    _check(proc, rows)
    # Every kernel in both dtypes, each a streaming one (its check includes the 128-bit loads).
    kernels = {r.kernel for r in rows}
    assert {(r.kernel, r.dtype) for r in rows} == {(k, d) for k in kernels for d in dtypes}
    assert all(r.streaming and r.arch == "sm_90" and r.backend == backend for r in rows)


@pytest.mark.slow  # 218 Triton variants and the CUDA kernels for two archs: ~5 min on 2 cores
@pytest.mark.skipif(not (HAS_TRITON or HAS_NVCC), reason="neither triton nor nvcc")
def test_full_sweep(tmp_path, capsys):
    proc, rows = _run(tmp_path, timeout=1800)
    with capsys.disabled():  # the table, past pytest's capture, into the CI log
        print("\n" + proc.stdout, flush=True)
    _check(proc, rows)
    assert {r.arch for r in rows} == {"sm_80", "sm_90"}
    assert {r.dtype for r in rows} >= {"fp32", "bf16", "fp16"}
