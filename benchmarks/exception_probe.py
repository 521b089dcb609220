"""Which argument errors of the compiled extension raise, and which kill the process.

On the first H200 run (benchmarks/RESULTS.md) tests died with SIGSEGV where `rlkernels._C` raises an
argument error, while one TORCH_CHECK from the CUDA binding raised cleanly. Each case below runs in
its own process, so one crash does not hide the others:

    python -m benchmarks.exception_probe
"""
from __future__ import annotations

import subprocess
import sys

SETUP = """
import torch, rlkernels._C
fwd = torch.ops.rlkernels_C.token_logprobs_fwd
z, y = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
inf, one, mask = float("inf"), torch.ones(4), torch.ones(4, dtype=torch.bool)
policy = lambda mask, clip_low: torch.ops.rlkernels_C.policy_token_fwd(
    z, y, mask, one, one, None, None, None, 1.0, 0, clip_low, 0.2, inf, inf, 0, 0.0, inf, False, 0.0, 20.0)
"""

# (what is thrown, where, the call)
CASES = [
    ("TORCH_CHECK, CPU binding, logits 3-D", "fwd(z[None], y, 1.0, True)"),
    ("TORCH_CHECK_VALUE, CPU binding, target out of range", "fwd(z, y + 30, 1.0, True)"),
    ("TORCH_CHECK_TYPE, CPU binding, float mask", "policy(one, 0.2)"),
    ("TORCH_CHECK_VALUE, CPU binding, negative clip_low", "policy(mask, -1.0)"),
    ("two exceptions in one process, CPU binding",
     "for _ in range(2):\n    try: fwd(z[None], y, 1.0, True)\n    except RuntimeError: pass\n"
     "fwd(z[None], y, 1.0, True)"),
    ("TORCH_CHECK, CUDA binding, float64 logits", "fwd(z.cuda().double(), y.cuda(), 1.0, True)"),
    ("two exceptions in one process, CUDA binding",
     "for _ in range(2):\n    try: fwd(z.cuda().double(), y.cuda(), 1.0, True)\n    except RuntimeError: pass\n"
     "fwd(z.cuda().double(), y.cuda(), 1.0, True)"),
    ("TORCH_CHECK, CUDA binding, targets on the CPU", "fwd(z.cuda(), y, 1.0, True)"),
]


def main() -> int:
    import torch

    crashed = 0
    for what, call in CASES:
        if "cuda" in call and not torch.cuda.is_available():
            print(f"{what}: skipped (no CUDA)")
            continue
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SETUP + call],
                              capture_output=True, text=True)
        last = (proc.stderr.strip().splitlines() or [""])[-1][:160]
        if proc.returncode < 0 or "Segmentation fault" in proc.stderr:
            crashed += 1
            print(f"{what}: CRASHED (signal {-proc.returncode}): {last}")
        else:
            print(f"{what}: raised ({last})")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
