"""Without triton (a core dependency no more: CPU machines do not use it), the triton backend's reason says how to
get it."""
import sys

from rlkernels import _backend


def test_missing_triton_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(_backend, "_status", {})
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` fails as when it is not installed
    for name in [m for m in sys.modules if m.startswith("rlkernels.kernels.triton")]:
        monkeypatch.delitem(sys.modules, name)
    info = _backend.backend_info()["triton"]
    assert not info["available"] and "pip install triton" in info["reason"], info
