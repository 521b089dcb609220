"""pytest-benchmark suite: `pytest benchmarks --benchmark-only` times every provider of every op
(workloads.py, providers.py) at one size (conftest.py options), forward and forward + backward.
Each case first checks that the provider computes what eager computes; the extra peak memory
and the bytes/FLOPs the op must move are stored in the benchmark's extra_info.
For the sweeps over V and N, the plots and the roofline, use `python -m benchmarks.report`."""
import pytest
import torch

from benchmarks import measure
from benchmarks.providers import all_providers, check_agrees_with_eager, prepare
from benchmarks.workloads import MODES, OPS, Case

PROVIDERS = {p.name: p for p in all_providers()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("op", OPS)
def test_benchmark(benchmark, request, op, provider, mode):
    opt = request.config.getoption
    device = torch.device(opt("--bench-device"))
    provider = PROVIDERS[provider]
    if op not in provider.ops:
        pytest.skip(f"{provider.name} has no {op}")
    reason = provider.unavailable(device, op)
    if reason:
        pytest.skip(reason)
    case = Case(op, opt("--bench-n"), opt("--bench-vocab"), opt("--bench-dtype"), mode,
                hidden=opt("--bench-hidden") if op == "grpo_linear" else 0)
    check_agrees_with_eager(Case(op, 256, 2048, "fp32", mode, hidden=64, seq_len=128), provider, device)

    step, leaves, _ = prepare(case, provider, device)

    def clear_grads():
        for x in leaves:
            x.grad = None

    def run():
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.extra_info.update(bytes_moved=case.bytes_moved(), flops=case.flops(),
                                extra_peak_mb=measure.extra_peak_bytes(step, leaves, device) / 2**20)
    benchmark.pedantic(run, setup=clear_grads, rounds=3 if device.type == "cpu" else 20, warmup_rounds=1)
