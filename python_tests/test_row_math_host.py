"""csrc/tests/test_row_math.cpp: the shared per-row header (csrc/include/rlkernels/row_math.h) against
a long-double two-pass reference, in float and double, built with the host C++ compiler (the CPU
extension's flags: -ffp-contract=off) and run. Skipped when no C++ compiler is on PATH."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")
def test_row_math_header_on_the_host(tmp_path):
    exe = str(tmp_path / "test_row_math")
    build = subprocess.run([CXX, "-O2", "-std=c++17", "-ffp-contract=off", "-I", os.path.join(ROOT, "csrc", "include"),
                            os.path.join(ROOT, "csrc", "tests", "test_row_math.cpp"), "-o", exe],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-6000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-6000:]
