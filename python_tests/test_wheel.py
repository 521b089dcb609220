"""The wheel (issue 25): `pip wheel --no-build-isolation` builds it, it holds the compiled extension and the console
script and requires no triton, and `pip install` of it into a fresh environment that has torch gives a working
`rlkernels._C`. The build reuses the objects of the editable install (setup.py's fixed object folder), and the
fresh environment reaches this one's packages through a .pth file: no second compile, no download."""
import json
import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from doc_blocks import ROOT

pytestmark = pytest.mark.slow


def _run(*args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, " ".join(map(str, args)) + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if os.environ.get("RLKERNELS_NO_EXTENSION") == "1":
        pytest.skip("RLKERNELS_NO_EXTENSION=1: a pure-Python install")
    dist = tmp_path_factory.mktemp("dist")
    proc = _run(sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", str(ROOT), "-w", str(dist))
    wheels = list(dist.glob("rlkernels-*.whl"))
    assert len(wheels) == 1
    return wheels[0], proc.stdout + proc.stderr


def test_the_build_says_what_it_compiles_and_how_long(wheel):
    lines = [line.strip() for line in wheel[1].splitlines() if "rlkernels: compiling the extension" in line]
    assert len(lines) == 1 and " files, " in lines[0] and "about " in lines[0], lines


def test_the_wheel_holds_the_extension_and_the_console_script(wheel):
    with zipfile.ZipFile(wheel[0]) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert any(n.startswith("rlkernels/_C") and n.endswith((".so", ".pyd")) for n in names)
    assert not any(n.startswith(("benchmarks/", "python_tests/")) for n in names)
    assert "rlkernels = rlkernels.cli:main" in entry_points
    triton = [line for line in meta.splitlines() if line.startswith("Requires-Dist: triton")]
    assert triton and all("extra ==" in line for line in triton), triton  # only in extras


def test_pip_install_into_a_fresh_environment_with_torch(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = str(venv / "bin" / "python")
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    # torch and the other requirements from this environment (a .pth line adds a path; its own .pth files,
    # the editable install of rlkernels among them, are not read)
    with open(os.path.join(purelib, "this-env.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-index", str(wheel[0]))
    # rlkernels._C is a torch extension: backend_info imports torch, then it (`import rlkernels` alone imports
    # neither, so that the command line starts without torch)
    probe = ("import json, rlkernels; info = rlkernels.backend_info()['cpu']; "
             "print(json.dumps({'file': rlkernels.__file__, 'cpu': info['available'], 'reason': info['reason']}))")
    got = json.loads(_run(python, "-c", probe, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(venv)) and got["cpu"] and "compiled extension rlkernels._C" in got["reason"], got
    assert "rlkernels train" in _run(str(venv / "bin" / "rlkernels"), "--help", cwd=tmp_path).stdout
