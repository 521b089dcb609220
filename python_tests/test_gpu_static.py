"""benchmarks.gpu_static: the GPU kernels compiled ahead of time for sm_80 / sm_90 without a GPU.

Fast: the default configuration of each Triton kernel (the streaming launch, default flags, and the same
with rows of odd length) for sm_90 in fp32 and bf16, and the CUDA kernels for sm_90: no local memory
(stack or spills), 128-bit global loads wherever a row is streamed, and issue 23's limits on the row
kernels (resident threads per SM, instructions per logit): a static check, no timing. The elementwise
kernels (policy_token_loss: per-token scalars, no logits) are there too, once each (dtype `-`), checked
for local memory only. Slow: the whole sweep
(`python -m benchmarks.gpu_static`), whose table is printed past pytest's capture so that it lands in
the CI log.

Triton versions: the registers are those of the Triton that compiles (issue 38: Triton 3.6, the lent H200's,
gave the no-entropy forward 61 registers where 3.9 gives 40). gpu_check's tests stage runs this file with the
device's Triton; here RLK_TRITON_PYTHONS (interpreters of virtual environments with another Triton and torch,
space-separated: benchmarks/RESULTS.md says how one was made) adds their rows to the same check.

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
ELEMENTWISE = {"triton": {"_policy_token_loss_kernel", "_covariance_choice_kernel", "_scale_grad_kernel"},
               "cuda": {"policy_token_loss_kernel", "covariance_choice_kernel"}}
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NVCC = shutil.which("nvcc") is not None
OTHER_TRITONS = os.environ.get("RLK_TRITON_PYTHONS", "").split()


def _run(tmp_path, *args, timeout):
    """(process, rows) of `python -m benchmarks.gpu_static ARGS`."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_static", *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    rows = [Row.from_json(r) for r in json.loads(out.read_text())] if out.exists() else []
    return proc, rows


def _check(proc, rows):
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert rows, f"no kernel was compiled:\n{log}"
    problems = [f"{r.kernel} {r.backend} {r.arch} {r.dtype} {r.config}: {p}" for r in rows for p in r.problems()]
    assert not problems, "\n".join(problems)
    assert proc.returncode == 0, log


DTYPES = ["fp32", "bf16"]


@pytest.fixture(scope="module", params=[
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")),
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_NVCC, reason="nvcc is not on PATH")),
])
def quick(request, tmp_path_factory):
    """(backend, process, rows) of the --quick run for sm_90 in fp32 and bf16 (once per backend)."""
    backend = request.param
    proc, rows = _run(tmp_path_factory.mktemp(backend), "--backend", backend, "--arch", "sm_90", "--dtype", *DTYPES,
                      "--quick", "--jobs", "2", timeout=600)
    return backend, proc, rows


def test_default_configurations_stream_in_128_bit_loads_without_local_memory(quick):
    backend, proc, rows = quick
    _check(proc, rows)
    assert all(r.arch == "sm_90" and r.backend == backend for r in rows)
    # Every row kernel in both dtypes, each a streaming one (its check includes the 128-bit loads).
    row_kernels = [r for r in rows if not r.elementwise]
    kernels = {r.kernel for r in row_kernels}
    assert {(r.kernel, r.dtype) for r in row_kernels} == {(k, d) for k in kernels for d in DTYPES}
    assert all(r.streaming for r in row_kernels)
    # Rows of odd length (not 16-byte aligned) keep their 128-bit loads in Triton too.
    if backend == "triton":
        assert {(r.kernel, r.dtype) for r in row_kernels if "V=151937 " in r.config} == {
            (k, d) for k in kernels for d in DTYPES}
    # The elementwise kernels once each, in the table, without the 128-bit load requirement.
    elementwise = [r for r in rows if r.elementwise]
    assert sorted(r.kernel for r in elementwise) == sorted(ELEMENTWISE[backend])
    assert all(r.dtype == "-" and not r.streaming for r in elementwise)
    for r in elementwise:  # the backend column names the Triton that compiled a Triton row
        assert f"| {r.kernel} | {backend}{' ' + r.triton if r.triton else ''} | sm_90 | - |" in proc.stdout


# Issue 23, on sm_90 with bf16 rows of V = 151936 and no cap: each forward and backward row kernel holds
# 1536 threads per SM; a Triton forward takes at most 12 instructions per logit, a backward 16.
# The split row (two_pass=True) reads and writes the row: held to the forward's 12, counted on its gradient loop.
ROW_KERNELS = {"triton": {"_token_logprobs_fwd_kernel": 12, "_policy_token_fwd_kernel": 12,
                          "_token_logprobs_bwd_kernel": 16, "_split_row_kernel": 12},
               "cuda": {"fwd_kernel": None, "bwd_kernel": None}}


def test_row_kernels_at_full_occupancy_within_the_instruction_budget(quick):
    backend, proc, rows = quick
    if backend == "triton":
        limited = [r for r in rows if r.dtype == "bf16" and "V=151936 " in r.config and "HAS_CAP=0" in r.config]
    else:  # V = 151936 takes 512 threads a row
        limited = [r for r in rows if r.dtype == "bf16" and "kThreads=512 " in r.config and "kCap=false" in r.config]
    assert {r.kernel for r in limited} == set(ROW_KERNELS[backend]), proc.stdout[-3000:]
    if backend == "triton":  # both values of the flags that change the row loop: each variant is held to the limits
        assert {f for r in limited for f in ("NEED_ENTROPY=0", "NEED_ENTROPY=1", "HAS_H=0", "HAS_H=1")
                if f + " " in r.config} == {"NEED_ENTROPY=0", "NEED_ENTROPY=1", "HAS_H=0", "HAS_H=1"}
    for r in limited:
        assert not r.capped and r.limits() is not None  # gpu_static holds them to the same limits
        assert r.threads_per_sm >= 1536, f"{r.kernel} {r.config}: {r.registers} registers, {r.threads_per_sm} threads/SM"
        budget = ROW_KERNELS[backend][r.kernel]
        if budget is not None:
            assert r.instructions_per_element <= budget, f"{r.kernel} {r.config}: {r.instructions_per_element}"


@pytest.mark.skipif(not (HAS_TRITON and OTHER_TRITONS), reason="RLK_TRITON_PYTHONS names no other Triton")
def test_every_triton_version_streams_at_full_occupancy(tmp_path):
    """The streaming variants of 16-bit rows compiled by this Triton and by each other one: the same variants, each
    meeting the limits (the no-entropy forward's 61 registers under Triton 3.6 failed here)."""
    proc, rows = _run(tmp_path, "--backend", "triton", "--arch", "sm_90", "--dtype", "bf16", "fp16", "--quick",
                      "--jobs", "2", "--triton-python", *OTHER_TRITONS, timeout=600)
    _check(proc, rows)
    variants = {}
    for r in rows:
        variants.setdefault(r.triton, set()).add((r.kernel, r.dtype, r.config))
    assert len(variants) >= 2, sorted(variants)  # this Triton's and another's
    first, *others = variants.values()
    assert all(v == first for v in others)
    assert any("NEED_ENTROPY=0 " in config for _, _, config in first)


# Every variant, one arch a run (the whole sweep: 596 kernels, ~4 min on 2 cores), as exhaustive tests (conftest.py:
# RLKERNELS_EXHAUSTIVE=1, or on a GPU): CI checks the default configurations of every kernel on every run (above),
# and the sweep took 105 s of a CI run that had reached 21 minutes; benchmarks/results/gpu_static.md is the two
# arches together, rerun when a kernel changes.
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.skipif(not (HAS_TRITON or HAS_NVCC), reason="neither triton nor nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_full_sweep(tmp_path, capsys, arch):
    proc, rows = _run(tmp_path, "--arch", arch, timeout=1800)
    with capsys.disabled():  # the table, past pytest's capture, into the CI log
        print("\n" + proc.stdout, flush=True)
    _check(proc, rows)
    assert {r.arch for r in rows} == {arch}
    assert {r.dtype for r in rows} >= {"fp32", "bf16", "fp16"}
    compiled = {b for b, has in (("triton", HAS_TRITON), ("cuda", HAS_NVCC)) if has}
    assert {r.kernel for r in rows if r.elementwise} == {k for b in compiled for k in ELEMENTWISE[b]}


def _flaky_compile(job, cuobjdump):
    """A stand-in for compile_triton: job "flaky" fails on its first try (a marker file remembers it across worker
    processes), "broken" always, "killed" takes its worker down once (the whole pool breaks), the others pass."""
    marker = os.path.join(cuobjdump, job.config)
    if job.config == "broken" or (job.config in ("flaky", "killed") and not os.path.exists(marker)):
        open(marker, "w").close()
        if job.config == "killed":
            os._exit(1)
        raise RuntimeError(f"{job.config} failed")
    return job.config


def test_sweep_survives_a_transient_failure(tmp_path, monkeypatch):
    """One job failing once (or killing its worker) is retried; one failing twice is reported, the rest kept."""
    from types import SimpleNamespace

    from benchmarks import gpu_static

    monkeypatch.setattr(gpu_static, "compile_triton", _flaky_compile)
    jobs = [SimpleNamespace(kernel="k", arch="sm_90", dtype="bf16", config=c)
            for c in ("a", "flaky", "b", "broken", "killed", "c")]
    rows, failed = gpu_static.triton_rows(jobs, str(tmp_path), workers=2)
    assert rows == ["a", "flaky", "b", "killed", "c"]
    assert [(job.config, "broken failed" in str(error)) for job, error in failed] == [("broken", True)]


def test_the_two_pass_cluster_kernel_holds_a_row_at_full_occupancy(quick):
    """The CUDA two-pass kernel at V = 151936 on sm_90: a bf16 row in 4 blocks and an fp32 row in 8, 75968 bytes of
    a row per block, 3 blocks of 512 threads per SM with it, no local memory, 128-bit loads and stores."""
    backend, proc, rows = quick
    if backend != "cuda":
        pytest.skip("a CUDA kernel")
    two_pass = [r for r in rows if r.kernel == "two_pass_kernel"]
    assert {(r.dtype, r.config) for r in two_pass} == {(d, f"kCap={c}") for d in DTYPES for c in ("false", "true")}
    for r in two_pass:
        assert (r.cluster, r.dynamic_shared) == ({"bf16": 4, "fp32": 8}[r.dtype], 75968), r
        assert r.threads_per_sm == 1536 and r.block == 512 and not r.problems(), r
        assert r.loads_128 and r.stores_128, r
    assert "Cluster kernels at V = 151936" in proc.stdout
    assert "| two_pass_kernel | sm_90 | bf16 | kCap=false |" in proc.stdout
