"""Every public op × backend × path × usage pattern against its plain-PyTorch definition (usage_patterns.py holds
both registries; an op, backend, path or pattern joins there by one registration)."""
import pytest

from usage_patterns import cases, run

# the interpreter's split row (triton, two_pass=True): ~1 s a case, so CI runs a sample of the patterns (a plain
# leaf, a slice with each kind of hook and of autograd.grad, scaled and accumulated gradients) and the rest is
# `exhaustive`
SPLIT_ROW_SAMPLE = ("view[leaf]", "view[slice]", "hook[slice-tensor_hook-after]", "hook[slice-retain_grad-before]",
                    "hook[slice-node_hook-after]", "autograd_grad[slice-wrt_both]", "incoming[scaled-slice]",
                    "incoming[accumulated-leaf]", "incoming[retain_graph-slice]", "inplace", "nonfinite[nan]",
                    "bad_targets[V]")


def _marks(op, pat):
    if op.kw.get("backend") == "triton" and op.kw.get("two_pass"):
        return [pytest.mark.slow] if pat.id in SPLIT_ROW_SAMPLE else [pytest.mark.exhaustive]
    return []


CASES = [pytest.param(op, pat, skip, id=f"{op.id}-{pat.id}", marks=_marks(op, pat)) for op, pat, skip in cases()]


@pytest.mark.parametrize("op,pat,skip", CASES)
def test_usage_pattern(op, pat, skip):
    if skip:
        pytest.skip(skip)
    run(op, pat)
