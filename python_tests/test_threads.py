"""The first calls of the ops from several threads at once (each in a fresh process, where the
ops are not registered yet): no crash, and every thread gets the single-threaded result."""
import os
import subprocess
import sys

import pytest
import torch

import rlkernels

BACKENDS = [b for b in ("cpu", "torch") if rlkernels.backend_info()[b]["available"]]
# Triton only on a GPU: its CPU interpreter (our tests' Triton) is not thread-safe itself (it
# patches triton.language while a kernel runs), whatever rlkernels does.
if torch.cuda.is_available():
    BACKENDS += [b for b in ("triton", "cuda") if rlkernels.backend_info()[b]["available"]]

SCRIPT = r"""
import sys, threading, torch, rlkernels
from rlkernels import presets
backend = sys.argv[1]
g = torch.Generator().manual_seed(0)
dev = "cuda" if backend in ("triton", "cuda") else "cpu"
x = torch.randn(4, 5, 33, generator=g).to(dev)
y = torch.randint(0, 33, (4, 5), generator=g).to(dev)
mask = torch.ones(4, 5, dtype=torch.bool, device=dev)
adv = torch.randn(4, generator=g).to(dev)
barrier = threading.Barrier(8)
results, errors = [None] * 8, []

def work(i):
    try:
        barrier.wait()
        logits = x.clone().requires_grad_(True)
        lp = rlkernels.token_logprobs(logits, y, backend=backend)
        out = rlkernels.fused_policy_loss(logits, y, adv, mask, presets.dapo(), backend=backend)
        out.loss.backward()
        results[i] = (lp.detach(), out.loss.detach(), logits.grad)
    except BaseException as e:  # reported below, with the thread's number
        errors.append(f"thread {i}: {type(e).__name__}: {e}")

threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
for r in results[1:]:
    for a, b in zip(r, results[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
print("ok")
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_calls_from_eight_threads(backend):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, backend], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
