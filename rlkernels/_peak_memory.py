"""Peak resident memory of this process since a reset (Linux), for the demo and benchmarks.

Writing 5 to /proc/self/clear_refs resets the kernel's high-water mark (VmHWM), so the peak of
one operation can be read in a process that has already imported torch and built its inputs.
"""
from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Reset the high-water mark; returns the current resident size in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_since(start: int) -> int:
    """Bytes by which the peak resident size since `reset_peak()` exceeded `start`."""
    return _status_kib("VmHWM") * 1024 - start
