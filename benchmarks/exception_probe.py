"""Each kind of argument error of the compiled extension, in a process of its own: raised as the class it
should be, naming the argument, or the process killed.

On the first H200 run (benchmarks/RESULTS.md) tests died with SIGSEGV where `rlkernels._C` threw an argument
error from its own code; csrc/include/rlkernels/checks.h says how it raises now. Each case calls a backend's
kernel wrapper (today's signatures, through `rlkernels.kernels.cpu` / `.cuda`) and checks the exception's class
and that its message starts with the argument's name, so a call that no longer binds fails here too. The
processes run side by side (each imports torch and rlkernels, a few seconds):

    python -m benchmarks.exception_probe
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SETUP = """
import dataclasses, math, torch
from rlkernels.kernels import cpu, cuda
from rlkernels.losses import PolicyLossConfig, presets
from rlkernels.ops.kernel_params import covariance_choice_params, token_loss_params
PARAMS = token_loss_params(PolicyLossConfig(kl_estimator="k3", kl_coef=0.1))
KL_COV = covariance_choice_params(presets.kl_cov())

def inputs(device="cpu", n=4, vocab=10):
    z, y, one = torch.randn(n, vocab), torch.zeros(n, dtype=torch.long), torch.ones(n)
    mask = torch.ones(n, dtype=torch.bool)
    return [t.to(device) for t in (z, y, mask, one, one, one - 3, one - 3, one)]

def fwd(k, z, y, mask, weight, adv, old, ref, is_weights, **params):
    return k.policy_token_fwd(z, y, mask, weight, adv, old, ref, is_weights, 1.0, dataclasses.replace(PARAMS, **params))

def loss(k, logp, mask, weight, adv, old, **params):
    return k.policy_token_loss(logp, None, mask, weight, adv, old, None, dataclasses.replace(PARAMS, **params))

z, y, mask, one, adv, old, ref, w = inputs()
"""

# (what, the call, the exception class, the argument its message names)
CASES = [
    ("cpu: 4-D logits", "cpu.token_logprobs_fwd(z[None, None], y, 1.0, True)", "ValueError", "logits"),
    ("cpu: integer logits", "cpu.token_logprobs_fwd(z.long(), y, 1.0, True)", "TypeError", "logits"),
    ("cpu: target out of range", "cpu.token_logprobs_fwd(z, y + 30, 1.0, True)", "ValueError", "targets"),
    ("cpu: out overlapping the logits", "s = torch.randn(50)\n"
     "cpu.token_logprobs_bwd(s[:40].view(4, 10), y, torch.zeros(4, 2), one, one, None, 1.0, out=s[5:45].view(4, 10))",
     "ValueError", "out"),
    ("cpu: float mask", "fwd(cpu, z, y, one, one, adv, old, ref, w)", "TypeError", "mask"),
    ("cpu: negative clip_low", "fwd(cpu, z, y, mask, one, adv, old, ref, w, clip_low=-1.0)", "ValueError", "clip_low"),
    ("cpu: fp64 weight for fp32 log-probs", "loss(cpu, old, mask, one.double(), adv, old)", "TypeError", "weight"),
    ("cpu: short adv", "loss(cpu, old, mask, one, adv[:2], old)", "ValueError", "adv"),
    ("cpu: fraction 0", "cpu.covariance_choice(old, adv, None, mask, None, dataclasses.replace(KL_COV, fraction=0.0))",
     "ValueError", "fraction"),
    ("cpu: an error after two caught ones",
     "for _ in range(2):\n    try: cpu.token_logprobs_fwd(z[None, None], y, 1.0, True)\n    except ValueError: pass\n"
     "cpu.token_logprobs_fwd(z[None, None], y, 1.0, True)", "ValueError", "logits"),
    ("cuda: float64 logits", "cuda.token_logprobs_fwd(z.cuda().double(), y.cuda(), 1.0, True)", "TypeError", "logits"),
    ("cuda: targets on the CPU", "cuda.token_logprobs_fwd(z.cuda(), y, 1.0, True)", "ValueError", "targets"),
    ("cuda: mask on the CPU", "fwd(cuda, *inputs('cuda')[:2], mask, *inputs('cuda')[3:])", "ValueError", "mask"),
    ("cuda: delta 0", "fwd(cuda, *inputs('cuda'), delta=0.0)", "ValueError", "delta"),
    ("cuda: fp64 log-probs", "loss(cuda, *[t.cuda() for t in (old.double(), mask, one, adv, old)])", "TypeError",
     "logp"),
    ("cuda: an error after two caught ones",
     "for _ in range(2):\n    try: cuda.token_logprobs_fwd(z.cuda().double(), y.cuda(), 1.0, True)\n"
     "    except TypeError: pass\ncuda.token_logprobs_fwd(z.cuda().double(), y.cuda(), 1.0, True)",
     "TypeError", "logits"),
]

# Run in the child: the call must raise `error` with a message that starts with `name:`.
CHECK = """
try:
{call}
except {error} as e:
    assert str(e).startswith("{name}:"), f"the message does not start with '{name}:': {{e}}"
else:
    raise AssertionError("no exception")
"""


def program(call: str, error: str, name: str) -> str:
    """The child's code for one case."""
    body = "\n".join("    " + line for line in call.splitlines())
    return SETUP + CHECK.format(call=body, error=error, name=name)


def _run(case):
    _, call, error, name = case
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", program(call, error, name)],
                          capture_output=True, text=True)


def main() -> int:
    import torch

    skipped = [case for case in CASES if case[0].startswith("cuda") and not torch.cuda.is_available()]
    for what, *_ in skipped:
        print(f"{what}: skipped (no CUDA)")
    cases = [case for case in CASES if case not in skipped]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        procs = list(pool.map(_run, cases))
    failed = 0
    for (what, _, error, name), proc in zip(cases, procs):
        last = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        if proc.returncode < 0 or "Segmentation fault" in proc.stderr:
            print(f"{what}: CRASHED (signal {-proc.returncode}): {last}")
        elif proc.returncode != 0:
            print(f"{what}: WRONG (expected {error} naming {name}): {last}")
        else:
            print(f"{what}: raised {error}")
        failed += proc.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
