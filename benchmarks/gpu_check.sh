#!/usr/bin/env bash
# One command for a GPU machine (docs/design.md §9), under 8 minutes: build, run the gpu tests,
# benchmark. torch is preinstalled there; --no-build-isolation builds against it.
# Arguments are passed to benchmarks.report (e.g. --vocabs 151936 --providers eager rlkernels-triton).
set -euo pipefail
cd "$(dirname "$0")/.."

python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
# The extension with csrc/cuda/ (setup.py adds it when torch is a CUDA build and nvcc exists),
# for the GPU(s) present unless TORCH_CUDA_ARCH_LIST says otherwise. If that build fails (say,
# nvcc and torch disagree on the CUDA major version), the CPU-only build keeps the rest running.
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "gpu_check: nvcc not on PATH: no cuda backend"
if ! pip install -v --no-build-isolation -e . > /tmp/rlkernels_build.log 2>&1; then
  tail -n 40 /tmp/rlkernels_build.log
  echo "gpu_check: the CUDA build failed (log above); building without CUDA"
  RLKERNELS_NO_CUDA=1 pip install --no-build-isolation -e . 2>&1 | tail -n 3
fi
grep -m1 "rlkernels: building" /tmp/rlkernels_build.log || true
python -c 'import rlkernels, pprint; pprint.pprint(rlkernels.backend_info())'

# Tests marked gpu, and the kernel-contract tests whose cases run on CUDA when a device is present
# (the fused loss kernels of every backend against losses/); a failure (or a missing cuda backend)
# is reported but the benchmark still runs.
status=0
python -c 'import rlkernels; assert rlkernels.backend_info()["cuda"]["available"]' \
  || { echo "gpu_check: the cuda backend is not available (reason above); its tests are skipped"; status=1; }
timeout 150 python -m pytest -q -m gpu python_tests || status=$?
timeout 120 python -m pytest -q python_tests/test_policy_token_kernel.py python_tests/test_triton_policy_token.py \
  python_tests/test_triton_fused.py python_tests/test_triton_kernels.py || status=$?

# The device machine has no network: Liger's rows run only if liger-kernel is already installed
# there (the report lists them under "Not measured" otherwise). A trimmed grid fits the budget.
timeout 270 python -m benchmarks.report --budget-s 220 --vocabs 32768 151936 --ns 2048 8192 "$@" || status=$?
exit "$status"
