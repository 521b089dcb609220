#!/usr/bin/env bash
# One command for a GPU machine (DESIGN.md §6), under 8 minutes: build, run the gpu tests,
# benchmark. torch is preinstalled there; --no-build-isolation builds against it.
# Arguments are passed to bench_gpu.py (e.g. --vocab 151936 --no-compile).
set -euo pipefail
cd "$(dirname "$0")/.."

python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
pip install --no-build-isolation -e . 2>&1 | tail -n 3
python -c 'import rlkernels, pprint; pprint.pprint(rlkernels.backend_info())'

# Tests marked gpu; a failure is reported but the benchmark still runs.
status=0
timeout 180 python -m pytest -q -m gpu python_tests || status=$?

timeout 330 python benchmarks/bench_gpu.py --budget-s 270 "$@"
exit "$status"
