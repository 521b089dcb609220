#!/usr/bin/env bash
# One command for a GPU machine (docs/design.md §9), under 8 minutes: build, test the kernels on the
# device, benchmark, count launches and syncs there. torch is preinstalled there; --no-build-isolation
# builds against it. Each stage has its own time limit, cut to what is left of the 8 minutes
# (`limit`), and a failing stage does not stop the next (the exit status reports it), so one run
# always brings back the benchmark.
#   RLK_OUT=dir   where the report goes (default benchmarks/results)
# Arguments are passed to benchmarks.report (e.g. --providers eager rlkernels-triton).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${RLK_OUT:-benchmarks/results}
PY=$(command -v python3 || command -v python)
mkdir -p "$out"
status=0
stage() { echo; echo "=== gpu_check: $1 (t=${SECONDS}s)"; }
DEADLINE=470  # seconds: 8 minutes, less the time to print the end
limit() { local left=$((DEADLINE - SECONDS)); echo $(( left < $1 ? (left > 5 ? left : 5) : $1 )); }

$PY -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true

stage "build"
# The extension with csrc/cuda/ (setup.py adds it when torch is a CUDA build and nvcc exists),
# for the GPU(s) present unless TORCH_CUDA_ARCH_LIST says otherwise. If that build fails (say,
# nvcc and torch disagree on the CUDA major version), the CPU-only build keeps the rest running.
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "gpu_check: nvcc not on PATH: no cuda backend"
if ! timeout "$(limit 240)" $PY -m pip install -v --no-build-isolation --no-deps -e . > /tmp/rlkernels_build.log 2>&1; then
  tail -n 40 /tmp/rlkernels_build.log
  echo "gpu_check: the CUDA build failed (log above); building without CUDA"
  status=1
  RLKERNELS_NO_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -n 3
fi
grep -m1 "rlkernels: building" /tmp/rlkernels_build.log || true
$PY -c 'import rlkernels, pprint; pprint.pprint(rlkernels.backend_info())'
$PY -c 'import rlkernels; assert rlkernels.backend_info()["cuda"]["available"]' \
  || { echo "gpu_check: the cuda backend is not available (reason above); its tests are skipped"; status=1; }

stage "tests"
# The kernel-contract tests run their cases on CUDA when a device is present (every backend against
# losses/), plus the tests marked gpu. pytest-xdist spreads them when it is installed.
parallel=$($PY -c 'import xdist' 2>/dev/null && echo "-n 8" || true)
# test_gpu_ready: a CUDA-graph capture of a loss step; test_linear_head: the bf16 hidden-state path.
timeout "$(limit 150)" $PY -m pytest -q -p no:cacheprovider $parallel \
  python_tests/test_kernel_contract.py python_tests/test_policy_token_fwd.py python_tests/test_policy_token_loss.py \
  python_tests/test_triton_fused.py python_tests/test_compile.py \
  python_tests/test_threads.py python_tests/test_precision.py python_tests/test_edge_inputs.py \
  python_tests/test_token_logprobs.py python_tests/test_linear_path.py python_tests/test_covariance_choice.py \
  python_tests/test_gpu_ready.py python_tests/test_traffic.py python_tests/test_linear_head.py || status=1

stage "crash triage"
# On the first H200 run six tests killed their process (SIGSEGV) where the extension raises an argument
# error. Each kind of error in its own process, its exception class and message asserted:
timeout "$(limit 60)" $PY -m benchmarks.exception_probe || status=1

stage "benchmark report"
# N = 8192, V = 151936, H = 4096, bf16: token_logprobs, GRPO from contiguous and sliced logits, GRPO from
# hidden states; every provider that runs here (Liger only if liger-kernel is installed on the machine,
# which has no network), with the traffic model's H200 time beside each rlkernels row.
timeout "$(limit 200)" $PY -m benchmarks.report --budget-s "$(limit 170)" --vocabs 151936 --ns 8192 --n 8192 \
  --vocab 151936 --hidden 4096 --dtype bf16 --ops token_logprobs grpo grpo_sliced grpo_linear --out "$out" "$@" \
  || status=1
$PY -m benchmarks.traffic || status=1

stage "launches and host syncs on the device"
for backend in cuda triton; do
  echo "--- backend $backend"
  timeout "$(limit 45)" $PY -m benchmarks.launches --device cuda --backend "$backend" || status=1
done
stage "done, status $status"
exit "$status"
