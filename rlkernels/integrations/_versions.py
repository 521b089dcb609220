"""The peer releases each integration is tested against (python_tests/test_integration_*.py), checked
when the integration is imported: older releases lack what it calls, newer ones may compute their
losses differently than the mapping assumes."""
from __future__ import annotations

import importlib.metadata
import warnings

from packaging.version import Version

TESTED = {"trl": ("1.16.0", "1.17"), "verl": ("0.9.1", "0.10")}  # [lowest, first untested)


def check(package: str) -> None:
    """ImportError below the tested range, a warning above it, each naming the range."""
    low, high = TESTED[package]
    found = Version(importlib.metadata.version(package))
    tested = f"{package}>={low},<{high}"
    if found < Version(low):
        raise ImportError(f"rlkernels.integrations.{package} needs {tested} (tested), found {package} {found}; "
                          f"pip install '{tested}'")
    if found >= Version(high):
        warnings.warn(f"rlkernels.integrations.{package} is tested with {tested}, found {package} {found}: the "
                      f"losses it maps may have changed there", stacklevel=3)
