#!/usr/bin/env bash
# One command for a lent GPU machine (docs/design.md §9) that answers the open questions within a 10-minute
# command, with no network. Stages in order of value, each under its own time limit (LIMIT below, in
# seconds; their sum fits DEADLINE, which python_tests/test_gpu_check.py checks); a failing or cut stage does
# not stop the next (the exit status reports it), and everything goes under the output folder:
#   setup     install the wheels brought in $RLK_WHEELS (liger-kernel), print the versions
#   build     the extension with csrc/cuda/ (a CPU-only build if that fails)
#   tests     a correctness subset on the device chosen by value (the per-token kernel contracts first, then
#             the Triton occupancy check of the device's own Triton), in its own process group that the stage
#             ends (no xdist worker outlives it); JUnit XML (written even when cut: SIGINT) and a failure summary
#             (benchmarks/junit_summary.py, from the XML or the -v log)
#   twopass   the CUDA two-pass kernel (sm_90 clusters) against the 3-pass kernels and the reference
#             (python_tests/test_two_pass_cuda.py), then its resident clusters checked (3 blocks per SM) and
#             both timed beside Liger and the Triton backend at N = 8192, V = 151936, bf16 GRPO fwd+bwd,
#             contiguous and logits[:, :-1]; the verdict against issue 38's goal (<= 1.30 ms) below the
#             contiguous row (benchmarks/two_pass.py)
#   probe     mm(bf16, bf16, out_dtype=float32), the GEMM the hidden-state path takes (its value checked),
#             and which hidden-state design ran (benchmarks/head_probe.py)
#   head      the benchmark's grpo_linear and grpo_sliced, N = 8192 (T = 512), V = 151936, H = 4096, bf16,
#             fwd+bwd then fwd; rlkernels-cuda / -triton with Liger, eager and torch.compile beside
#             (rlkernels-torch is not timed on CUDA: benchmarks/providers.py)
#   sliced64  grpo_sliced at B = 64 × T = 128 (the slice path's launches per sequence)
#   sass      the SASS of the Triton kernels this machine compiled for the benchmark (benchmarks/device_sass.py)
#   counts    the traffic model with launches and host time per call (row by row); every preset's launches
#             and syncs
# Every stage prints (or writes: benchmarks.report's <name>.rows.jsonl) each row as it finishes: a cut loses a row.
#   rest      grpo and token_logprobs from contiguous logits, in whatever time is left
# Without a CUDA device it prints one line (the plan) and exits 0: a dry run. `--plan` prints the stages and
# their limits. Other arguments go to every benchmarks.report call (e.g. --reps 5).
#   RLK_OUT=dir     output folder (default benchmarks/results/gpu_check)
#   RLK_TAR=file    also pack the output folder into this tarball after every stage (a machine that returns
#                   few files: the tarball of the stages done survives a kill)
#   RLK_WHEELS=dir  wheels to install first (default .whl)
#   RLK_STAGES="a b" only these stages (a second run with the device time left: RLK_STAGES="setup build head")
#
# Liger-Kernel, brought as a wheel (the machine has no network). liger-kernel 0.8.5 ran on the lent H200
# (torch 2.11, Triton 3.6: benchmarks/RESULTS.md); it is pure Python (py3-none-any) and needs only torch and
# triton, both there. Fetched here, into the git-ignored .whl/ (.gitignore):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       -d .whl liger-kernel==0.8.5
# The folder is ignored, so a copy of the tracked files leaves it behind: bring it along with the checkout
# (a device tool that sends the working tree: name `.whl` among the paths it carries). Installed here by
#   pip install --no-index --no-deps --target /tmp/rlk_wheels .whl/*.whl   (then on PYTHONPATH)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1  # a stage cut at its limit keeps what it printed

ORDER=(setup build tests twopass probe head sliced64 sass counts rest)
declare -A LIMIT=([setup]=20 [build]=140 [tests]=90 [twopass]=70 [probe]=25 [head]=140 [sliced64]=25 [sass]=15
                  [counts]=35 [rest]=10)
DEADLINE=570  # seconds: a 10-minute command less the time to pack the output and end
plan() {
  local total=0 s
  for s in "${ORDER[@]}"; do total=$((total + LIMIT[$s])); printf '%s %s s, ' "$s" "${LIMIT[$s]}"; done
  printf 'total %s s; deadline %s s' "$total" "$DEADLINE"
}
if [ "${1:-}" = "--plan" ]; then plan; echo; exit 0; fi

PY=$(command -v python3 || command -v python)
why=$("$PY" -c 'import torch
print("" if torch.cuda.is_available() else f"torch {torch.__version__} sees no CUDA device")' 2>/dev/null) \
  || why="$PY cannot import torch ($("$PY" -c 'import torch' 2>&1 | tail -n 1))"
if [ -n "$why" ]; then
  echo "gpu_check: dry run, nothing done: $why; on a GPU it runs $(plan)"
  exit 0
fi

out=${RLK_OUT:-benchmarks/results/gpu_check}
wheels=${RLK_WHEELS:-.whl}
mkdir -p "$out"
status=0
pack() { [ -z "${RLK_TAR:-}" ] || tar czf "$RLK_TAR" -C "$out" . 2>/dev/null || true; }
trap pack EXIT
lim=0
# in_group LIMIT CMD...: CMD in a session and process group of its own, SIGINT to the whole group at LIMIT seconds
# (pytest writes its XML), SIGKILL to what is left of it 10 s later and once CMD ends: workers that outlive their
# controller would keep the device busy through the timing stages. CMD starts through Python's os.setsid with
# SIGINT at its default (a background command of a script ignores it, and pytest would never hear the limit).
# Its status is CMD's; in_group_cut is 1 when the limit was reached.
in_group() {
  local limit=$1 pid timer start=$SECONDS rc
  shift
  "$PY" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.setsid()
os.execvp(sys.argv[1], sys.argv[1:])' "$@" &
  pid=$!
  setsid bash -c 'sleep "$1"; kill -INT -- "-$2" 2>/dev/null; sleep 10; kill -KILL -- "-$2" 2>/dev/null' _ \
    "$limit" "$pid" &
  timer=$!
  wait "$pid"
  rc=$?
  kill -- "-$timer" 2>/dev/null
  kill -KILL -- "-$pid" 2>/dev/null
  in_group_cut=$((SECONDS - start >= limit ? 1 : 0))
  return "$rc"
}
in_group_cut=0
# begin NAME: pack what the last stage wrote, print the header, set $lim (this stage's limit, or what is
# left of the deadline if less; the last stage takes all that is left); 1 when no time is left or the stage
# is not in $RLK_STAGES.
begin() {
  [ -z "${RLK_STAGES:-}" ] || [[ " $RLK_STAGES " == *" $1 "* ]] || return 1
  pack
  local left=$((DEADLINE - SECONDS))
  if [ "$1" = rest ] || [ "$left" -lt "${LIMIT[$1]}" ]; then lim=$left; else lim=${LIMIT[$1]}; fi
  echo; echo "=== gpu_check: $1 (t=${SECONDS}s, limit ${lim}s)"
  if [ "$lim" -lt 5 ]; then echo "gpu_check: $1 skipped: no time left"; status=1; return 1; fi
}
# benchmarks.report at the issue's size within $lim: it starts no case after 3/5 of it (the last case, the
# machine's limits measured again, the plots and the files fit in the rest); arguments: its own, then the script's.
report() {
  timeout "$lim" "$PY" -m benchmarks.report --budget-s $((lim * 3 / 5)) --vocabs 151936 --ns 8192 --n 8192 \
    --vocab 151936 --hidden 4096 --dtype bf16 --modes fwd+bwd fwd --out "$out" "$@" "${EXTRA[@]}" || status=1
}
EXTRA=("$@")
# what the benchmark stages compile (kept for a second run on the same machine), read by the sass stage
export TRITON_CACHE_DIR=/tmp/rlk_triton_bench
machine=$("$PY" -c 'import torch, re; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')

if begin setup; then
  if compgen -G "$wheels/*.whl" >/dev/null; then
    if timeout "$lim" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rlk_wheels "$wheels"/*.whl; then
      export PYTHONPATH=/tmp/rlk_wheels${PYTHONPATH:+:$PYTHONPATH}
    else
      echo "gpu_check: installing $wheels/*.whl failed"; status=1
    fi
  else
    echo "gpu_check: no $wheels/*.whl: no Liger rows (how to bring it: this script's header)"
  fi
  "$PY" -c 'import torch, triton; from importlib import metadata as m
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed"
print("torch", torch.__version__, "| triton", triton.__version__, "| liger-kernel", v("liger-kernel"), "|",
      torch.cuda.get_device_name(), "| machine", "'"$machine"'")' | tee "$out/versions.txt"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$out/versions.txt"
fi

if begin build; then
  # setup.py adds csrc/cuda/ when torch is a CUDA build and nvcc exists, for the GPU(s) present unless
  # TORCH_CUDA_ARCH_LIST says otherwise. If that fails (nvcc and torch on different CUDA majors, say), the
  # CPU-only build keeps the rest running.
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "gpu_check: nvcc not on PATH: no cuda backend"
  if ! timeout "$lim" "$PY" -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1; then
    tail -n 30 "$out/build.log"
    echo "gpu_check: the CUDA build failed (log above); building without CUDA"
    status=1
    RLKERNELS_NO_CUDA=1 timeout $((DEADLINE - SECONDS > 5 ? DEADLINE - SECONDS : 5)) \
      "$PY" -m pip install --no-build-isolation --no-deps -e . >> "$out/build.log" 2>&1 || tail -n 3 "$out/build.log"
  fi
  grep -m1 "rlkernels: building" "$out/build.log" || true
  "$PY" -c 'import rlkernels
for name, info in rlkernels.backend_info().items():
    print(f"backend {name}: {info}")
assert rlkernels.backend_info()["cuda"]["available"], "the cuda backend is not available"' || status=1
fi

if begin tests; then
  # Files in order of value, the device's backends (cuda, triton) and the gpu-marked tests: with xdist handing out
  # tests in collection order, a cut loses the last files. The per-token contracts first (the token loss in the
  # forward and alone, every objective: ~190 tests each; token_logprobs, the op of every step: ~230), then the
  # Triton kernels' occupancy under this machine's own Triton (issue 38), slices, precision, the compiled path:
  # 769 tests collected here (4 fewer files than before: the fused presets, the hidden-state path and the covariance choice
  # are CI's on CPU and the later stages' here). On the device the time is the Triton compiles of the distinct
  # variants (one per objective and flag set, ~1-2 s each, spread over the workers) more than the tests' own
  # (benchmarks/RESULTS.md, 2026-12-07).
  files=()
  for f in test_policy_token_fwd test_policy_token_loss test_kernel_contract test_gpu_ready test_gpu_static \
           test_slice_grad test_precision test_compile; do
    [ -e "python_tests/$f.py" ] && files+=("python_tests/$f.py")
  done
  opts=()
  "$PY" -c 'import xdist' 2>/dev/null && opts+=(-n 12)
  "$PY" -c 'import pytest_timeout' 2>/dev/null && opts+=(--timeout 60)
  TRITON_CACHE_DIR=/tmp/rlk_triton_tests in_group $((lim > 15 ? lim - 10 : 5)) \
    "$PY" -m pytest -v -rfE -p no:cacheprovider --continue-on-collection-errors "${opts[@]}" \
    -k "cuda or triton or gpu" --junitxml="$out/tests.xml" "${files[@]}" > "$out/tests.log" 2>&1
  rc=$?
  [ "$in_group_cut" -eq 1 ] && echo "gpu_check: tests cut at ${lim}s (rc $rc): the summary holds those that ran"
  "$PY" -m benchmarks.junit_summary "$out/tests.xml" "$out/tests.log" | tee "$out/tests_summary.txt" | head -n 60
  [ "$rc" -eq 0 ] || status=1
fi

if begin twopass; then
  # correctness first (at most half the limit; skipped below sm_90), then the timing in what is left
  end=$((SECONDS + lim))
  TRITON_CACHE_DIR=/tmp/rlk_triton_tests timeout -s INT -k 5 $((lim / 2)) "$PY" -m pytest -q -rfE \
    -p no:cacheprovider --junitxml="$out/two_pass_tests.xml" python_tests/test_two_pass_cuda.py \
    > "$out/two_pass_tests.log" 2>&1 || status=1
  tail -n 15 "$out/two_pass_tests.log"
  timeout $((end - SECONDS > 5 ? end - SECONDS : 5)) "$PY" -m benchmarks.two_pass --device cuda 2>&1 \
    | tee "$out/two_pass.md" || status=1
fi

if begin probe; then
  timeout "$lim" "$PY" -m benchmarks.head_probe 2>&1 | tee "$out/head_probe.txt" || status=1
fi

if begin head; then
  report --ops grpo_linear grpo_sliced --name "$machine"
fi

if begin sliced64; then
  report --ops grpo_sliced --seq-len 128 --modes fwd+bwd --name "$machine-sliced-b64"
fi

if begin sass; then
  timeout "$lim" "$PY" -m benchmarks.device_sass "$TRITON_CACHE_DIR" --json "$out/device_sass.json" \
    | tee "$out/device_sass.md" || status=1
fi

if begin counts; then
  # the traffic model's table first (launches and host time per call of the cuda and triton backends at the
  # benchmark's size beside the bytes), then every preset's launch counts, the backends sharing what is left
  end=$((SECONDS + lim))
  timeout $((lim * 3 / 5)) "$PY" -m benchmarks.traffic 2>&1 | tee "$out/traffic.txt" || status=1
  : > "$out/launches.txt"
  n=2
  for backend in cuda triton; do
    share=$(( (end - SECONDS) / n )); n=$((n - 1))
    echo "--- launches and syncs per call, backend $backend (limit ${share}s)" | tee -a "$out/launches.txt"
    timeout $((share > 5 ? share : 5)) "$PY" -m benchmarks.launches --device cuda --backend "$backend" 2>&1 \
      | tee -a "$out/launches.txt" || status=1
  done
fi

if begin rest; then
  report --ops grpo token_logprobs --name "$machine-rest"
fi

pack
echo; echo "=== gpu_check: done at t=${SECONDS}s, status $status; output in $out"
exit "$status"
