"""The compiled extension throws no C++ exception from its own code (csrc/include/rlkernels/checks.h says why):
every error goes through TORCH_CHECK, which throws inside libc10. Read off its machine code: no call of
__cxa_throw. Skipped without objdump or without the extension."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

import rlkernels

OBJDUMP = shutil.which("objdump")


@pytest.mark.skipif(OBJDUMP is None, reason="objdump is not on PATH")
def test_extension_has_no_throw_of_its_own():
    libraries = glob.glob(os.path.join(os.path.dirname(rlkernels.__file__), "_C*.so"))
    if not libraries:
        pytest.skip("rlkernels._C is not built")
    asm = subprocess.run([OBJDUMP, "-d", "-C", "--no-show-raw-insn", libraries[0]], capture_output=True, text=True,
                         check=True).stdout
    throwing, function = set(), None
    for line in asm.splitlines():
        if header := re.match(r"[0-9a-f]+ <(.*)>:$", line):
            function = header.group(1)
        elif "call" in line and "__cxa_throw" in line:
            throwing.add(function)
    assert not throwing, f"__cxa_throw called in {sorted(throwing)}"
