"""Every public op × backend × path × usage pattern against its plain-PyTorch definition (usage_patterns.py holds
both registries; an op, backend, path or pattern joins there by one registration)."""
import pytest

from usage_patterns import cases, run

# the interpreter's split row (triton, two_pass=True): ~1 s a case
CASES = [pytest.param(op, pat, skip, id=f"{op.id}-{pat.id}",
                      marks=[pytest.mark.slow] if op.kw.get("backend") == "triton" and op.kw.get("two_pass") else [])
         for op, pat, skip in cases()]


@pytest.mark.parametrize("op,pat,skip", CASES)
def test_usage_pattern(op, pat, skip):
    if skip:
        pytest.skip(skip)
    run(op, pat)
