"""The CUDA sources with nvcc, whether or not this machine has a GPU or a CUDA torch.

* Every csrc/cuda/*.cu compiles for A100 (sm_80) and H100/H200 (sm_90) with the flags of the real
  build (torch's nvcc flags, -O3). ptxas's register / spill / shared-memory report of every kernel
  is printed past pytest's output capture, so that it lands in the CI log.
* csrc/tests/test_row_pass.cu, the kernels' per-row code run lane by lane on the host against a
  double-precision reference, and the per-token policy loss they end with, is built and run: the
  CUDA kernels' logic is tested without a GPU. So is csrc/tests/test_cluster_row.cu, the two-pass cluster
  kernel's phases run block by block and lane by lane, with the barriers between them.
* csrc/cuda/bindings.cpp, the torch side of the CUDA ops, type-checks against torch's headers.

Skipped when nvcc is not on PATH. About 40 s of CPU (sm_80 and sm_90 in one nvcc run, 10 s per arch),
spread over two cores.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.gpu_static import gencode, nvcc_flags, ptxas_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
ARCHS = ["sm_80", "sm_90"]
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def _compile(source, out_dir):
    """One nvcc run for every arch (the host side and front end once, the archs on two threads)."""
    obj = os.path.join(out_dir, f"{os.path.basename(source)}.o")
    cmd = [NVCC, "-c", *gencode(ARCHS), "--threads", "2", *nvcc_flags(), source, "-o", obj]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return cmd, proc


HOST_TESTS = ("test_row_pass", "test_cluster_row")  # csrc/tests/*.cu built as host programs


def _build_host_test(name, out_dir):
    exe = os.path.join(out_dir, name)
    cmd = [NVCC, "-O2", "-std=c++17", "-I", os.path.join(ROOT, "csrc", "include"), "-I", os.path.join(ROOT, "csrc", "cuda"),
           os.path.join(ROOT, "csrc", "tests", f"{name}.cu"), "-o", exe]
    return exe, subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """All the nvcc runs of this file at once: {source: (cmd, proc)} and {host test: (exe, proc)}."""
    out_dir = str(tmp_path_factory.mktemp("nvcc"))
    with ThreadPoolExecutor(max_workers=len(SOURCES) + len(HOST_TESTS)) as pool:
        hosts = {name: pool.submit(_build_host_test, name, out_dir) for name in HOST_TESTS}
        results = list(pool.map(lambda src: _compile(src, out_dir), SOURCES))
        return dict(zip(SOURCES, results)), {name: h.result() for name, h in hosts.items()}


@pytest.mark.parametrize("name", HOST_TESTS)
def test_kernel_code_on_the_host(builds, name):
    exe, proc = builds[1][name]
    assert proc.returncode == 0, f"{name}.cu does not compile:\n{proc.stderr[-6000:]}"
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.skipif(not SOURCES, reason="no csrc/cuda/*.cu")
def test_every_cu_file_compiles_for_sm80_and_sm90(builds, capsys):
    sources, results = list(builds[0]), list(builds[0].values())

    log = ["", f"nvcc ptxas report ({NVCC}):",
           f"{'file':<20} {'arch':<6} {'kernel':<56} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8} {'smem':>5}"]
    failures = []
    for src, (cmd, proc) in zip(sources, results):
        name = os.path.basename(src)
        if proc.returncode != 0:
            failures.append(f"{name} failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
            continue
        for ln in proc.stderr.splitlines():
            if "warning" in ln.lower():
                log.append(f"{name} WARNING: {ln}")
        reported = {row[1] for row in ptxas_report(proc.stderr)}
        if reported != set(ARCHS):
            failures.append(f"{name}: ptxas reported {sorted(reported)}, expected {ARCHS}")
        for kernel, k_arch, regs, stack, st, ld, smem in ptxas_report(proc.stderr):
            log.append(f"{name:<20} {k_arch:<6} {kernel:<56} {regs:>4} {stack:>5} {st:>8} {ld:>8} {smem:>5}")
    with capsys.disabled():  # past pytest's capture (fd-level too): in the CI log with or without -s
        print("\n".join(log), flush=True)
    assert not failures, "\n\n".join(failures)


def test_cuda_bindings_type_check_against_torch_headers(tmp_path):
    """csrc/cuda/bindings.cpp (the torch side of the CUDA ops) is compiled only in a CUDA build, which this
    machine cannot make: a CPU torch wheel lacks the generated c10/cuda/impl/cuda_cmake_macros.h (build
    macros only). With an empty stand-in for it, g++ -fsyntax-only checks the bindings against torch's and
    the CUDA runtime's headers and the launchers' declarations: a changed op signature fails here, not on a GPU."""
    from torch.utils import cpp_extension

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-fsyntax-only", f"-I{tmp_path}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), *_nvcc_includes(),
           "-I", os.path.join(ROOT, "csrc", "include"), "-I", os.path.join(ROOT, "csrc", "cuda"),
           os.path.join(ROOT, "csrc", "cuda", "bindings.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-6000:]}"


def _nvcc_includes():
    """The CUDA toolkit's include flags, as nvcc gives them to the host compiler (`nvcc --dryrun`)."""
    dry = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True, timeout=60)
    found = [re.match(r"#\$ (?:SYSTEM_)?INCLUDES=(.*)", line) for line in dry.stderr.splitlines()]
    return [flag for m in found if m for flag in shlex.split(m.group(1))]
