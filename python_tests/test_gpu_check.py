"""benchmarks/gpu_check.sh without a GPU: its stages fit the lent machine's 10-minute command, a machine without
CUDA gets one line and nothing done, the test stage's failures survive a cut (benchmarks/junit_summary.py),
the SASS of a Triton cache is read as gpu_static reads it (benchmarks/device_sass.py), and the benchmark's
order and providers are the script's (grpo_linear, grpo_sliced first; no rlkernels-torch on CUDA)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
COMMAND_S = 600  # one command on the lent machine
PACK_AND_KILL_S = 25  # what the end needs past the deadline: the tarball, a stage's SIGKILL grace


def _bash(*args, env=None, timeout=60):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def _plan():
    out = _bash("--plan").stdout.strip()
    stages = [(name, int(s)) for name, s in re.findall(r"(\w+) (\d+) s,", out)]
    deadline = int(re.search(r"deadline (\d+) s", out).group(1))
    return stages, deadline


def test_stages_fit_one_command():
    stages, deadline = _plan()
    assert sum(s for _, s in stages) <= deadline <= COMMAND_S - PACK_AND_KILL_S, stages
    names = [n for n, _ in stages]
    # the order of value: build before anything runs on the device, the correctness subset first, then the CUDA
    # two-pass kernel's checks and timing, the benchmark's hidden-state and sliced rows before the rest
    assert names[:4] == ["setup", "build", "tests", "twopass"] and names[-1] == "rest", names
    assert names.index("head") < names.index("sliced64") < names.index("rest")
    body = open(SCRIPT).read()
    assert [m for m in re.findall(r"^if begin (\w+);", body, re.M)] == names  # every stage planned runs, in order


def test_bash_syntax_and_shellcheck():
    assert subprocess.run(["bash", "-n", SCRIPT], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        proc = subprocess.run([shellcheck, "-x", SCRIPT], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the script for real")
def test_dry_run_without_cuda_is_one_line(tmp_path):
    out = tmp_path / "out"
    proc = _bash(env={"RLK_OUT": str(out), "RLK_TAR": str(tmp_path / "all.tgz"),
                      "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: dry run, nothing done: ") and "sees no CUDA" in lines[0]
    assert "total" in lines[0] and not out.exists() and not (tmp_path / "all.tgz").exists()


CUT_TESTS = '''
import os, time
def test_passes():
    pass
def test_fails():
    assert 1 == 2, "one is not two"
def test_hangs():
    open(os.environ["HANG_MARKER"], "w").close()
    time.sleep(600)
'''


def _sigint_at_default():
    # As gpu_check.sh's in_group does: a test run started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_a_cut_test_run_still_names_its_failures(tmp_path, how):
    """As the tests stage runs pytest: SIGINT at the limit writes the XML; a SIGKILL leaves the -v log."""
    (tmp_path / "test_cut.py").write_text(CUT_TESTS)
    marker, xml, log = tmp_path / "hanging", tmp_path / "tests.xml", tmp_path / "tests.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"HANG_MARKER": str(marker)}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
                                 f"--junitxml={xml}", "test_cut.py"], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=_sigint_at_default)
        deadline = time.time() + 120
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        proc.send_signal(how)
        proc.wait(timeout=60)
    assert xml.exists() == (how == signal.SIGINT)
    summary = subprocess.run([sys.executable, "-m", "benchmarks.junit_summary", str(xml), str(log)], cwd=ROOT,
                             capture_output=True, text=True)
    assert summary.returncode == 1
    assert re.search(r"FAILED \S*test_fails(: AssertionError: one is not two)?$", summary.stdout, re.M), summary.stdout
    counts = "1 failed, 1 interrupted, 1 passed" if how == signal.SIGINT else "1 failed, 1 passed"
    assert "test_passes" not in summary.stdout and summary.stdout.startswith(f"tests: {counts} ("), summary.stdout


def test_junit_summary_with_nothing_to_read(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.junit_summary", str(tmp_path / "none.xml")], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout.startswith("tests: nothing to read")


def _no_interpreter_env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


COMPILE_ONE = '''
import json, sys
from benchmarks import gpu_static as g
g._init_worker(sys.argv[1])
(job,) = [j for j in g.triton_jobs(["sm_90"], ["bf16"], quick=True)
          if j.kernel == "_policy_token_fwd_kernel" and j.config.startswith("V=151936 ")]
print(json.dumps(g.compile_triton(job, g.find_cuobjdump()).to_json()))
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")
def test_device_sass_reads_a_triton_cache_as_gpu_static_compiles_it(tmp_path):
    """gpu_static compiles one streaming variant into a fresh cache (its ptxas report: registers); device_sass
    reads the cache (cuobjdump -res-usage, the cubin's SASS, the logits' type from the .ttir)."""
    from benchmarks import gpu_static

    if gpu_static.find_cuobjdump() is None:
        pytest.skip("no cuobjdump")
    cache = tmp_path / "cache"
    compiled = subprocess.run([sys.executable, "-c", COMPILE_ONE, str(cache)], cwd=ROOT, capture_output=True,
                              text=True, env=_no_interpreter_env(), timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    want = json.loads(compiled.stdout.splitlines()[-1])
    read = subprocess.run([sys.executable, "-m", "benchmarks.device_sass", str(cache), "--json",
                           str(tmp_path / "rows.json")], cwd=ROOT, capture_output=True, text=True,
                          env=_no_interpreter_env(), timeout=300)
    assert read.returncode == 0, read.stdout + read.stderr[-2000:]
    (got,) = json.loads((tmp_path / "rows.json").read_text())
    assert (got["kernel"], got["arch"], got["dtype"]) == ("_policy_token_fwd_kernel", "sm_90", "bf16")
    for key in ("registers", "threads_per_sm", "loads_128", "widest_load"):
        assert got[key] == want[key], (key, got, want)
    assert got["stack_bytes"] == want["stack_bytes"] and got["local_bytes"] == 0
    assert got["instructions_per_element"] == pytest.approx(want["instructions_per_element"])
    assert "| _policy_token_fwd_kernel | sm_90 | bf16 |" in read.stdout and "| ok |" in read.stdout


def test_report_runs_every_ops_first_mode_before_the_next():
    """gpu_check's head stage: --modes fwd+bwd fwd --ops grpo_linear grpo_sliced; a budget cut loses fwd rows."""
    from benchmarks import report

    args = report.parse_args(["--quick", "--device", "cpu", "--ops", "grpo_linear", "grpo_sliced", "--modes",
                              "fwd+bwd", "fwd", "--vocabs", "512", "--ns", "64", "--n", "64", "--vocab", "512"])
    order = [(c.mode, c.op) for c in report.cases(args)]
    assert order == [("fwd+bwd", "grpo_linear"), ("fwd+bwd", "grpo_sliced"), ("fwd", "grpo_linear"),
                     ("fwd", "grpo_sliced")]


def test_the_torch_backend_is_not_timed_on_cuda():
    from benchmarks import providers

    torch_provider = next(p for p in providers.all_providers() if p.name == "rlkernels-torch")
    assert "not timed on CUDA" in torch_provider.unavailable(torch.device("cuda"), "grpo")
    assert torch_provider.unavailable(torch.device("cpu"), "grpo") is None


def test_head_probe_reads_the_design_from_the_gemms():
    """On CPU (the GPU's choices aside): row chunks forced by chunk_size show as such, with their ∂W GEMMs."""
    from benchmarks import head_probe

    line = head_probe.run_variant(256, 1000, 64, torch.float32, torch.device("cpu"), chunk_size=64)
    assert line.startswith("row chunks: 64 rows × 1000 columns, 4 chunk(s); ")
    assert "∂W GEMMs (operands→output) {'float32→float32': 4}" in line and re.search(r"extra peak -?\d", line)
    # a vocabulary-blocked call: logits (N, c < V) first, ∂W rows (c, H) per block, ∂hidden (N, H)
    blocks = [("mm", (256, 400), torch.bfloat16, torch.bfloat16), ("mm", (256, 400), torch.bfloat16, torch.bfloat16),
              ("mm", (400, 64), torch.bfloat16, torch.bfloat16), ("addmm", (256, 64), torch.bfloat16, torch.float32),
              ("mm", (256, 200), torch.bfloat16, torch.bfloat16), ("mm", (200, 64), torch.bfloat16, torch.bfloat16)]
    assert head_probe.design(blocks, 256, 600, 64).startswith("vocabulary blocks: 256 rows × 400 columns; 6 GEMMs")
    assert "{'bfloat16→bfloat16': 2}" in head_probe.design(blocks, 256, 600, 64)


WORKER_TREE = '''
import os, subprocess, sys, time
# a controller with a worker (as xdist's): the worker ignores SIGINT, as a worker in a kernel would not answer it
worker = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                           "time.sleep(300)"])
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(300)
'''


def test_in_group_ends_the_whole_group_at_its_limit(tmp_path):
    """The tests stage's pytest runs in its own process group, and the stage ends all of it: a controller cut at
    the limit leaves no worker behind (`timeout`, as before, signalled the controller only)."""
    body = open(SCRIPT).read()
    function = body[body.index("in_group() {"):body.index("\nin_group_cut=0\n")]
    (tmp_path / "tree.py").write_text(WORKER_TREE)
    pid_file = tmp_path / "worker.pid"
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", f'PY="{sys.executable}"\n' + function + f'\nin_group 2 "$PY" tree.py {pid_file}; '
                           'echo "rc $? cut $in_group_cut"'], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    # the controller heard SIGINT at 2 s (KeyboardInterrupt), not the SIGKILL (rc 137) 10 s later
    rc, _, cut = proc.stdout.split()[-3:]
    assert time.monotonic() - start < 8 and rc != "137" and cut == "1", proc.stdout + proc.stderr
    assert "KeyboardInterrupt" in proc.stderr
    worker = int(pid_file.read_text())
    time.sleep(0.5)
    with open(f"/proc/{worker}/stat") if os.path.exists(f"/proc/{worker}") else open(os.devnull) as f:
        state = f.read().split()[2:3]
    assert state in ([], ["Z"]), f"worker {worker} outlived its group: {state}"
