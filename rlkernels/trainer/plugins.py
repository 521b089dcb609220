"""`--plugin FILE.py|package.module`: the user's code imported before the config is checked, so that what it
registers (an objective with `rlkernels.register_objective`, a preset with `presets.register`) is a valid --algo.

Each plugin runs once per process: a resumed run's config names its plugins again, and registering a name twice is
an error of `presets.register`."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

_LOADED = {}  # the real path of a file, or a module's name -> the module


def import_source(where: str):
    """The module of `where`, a path ending in .py (run as a module of its file's name) or an importable module
    name (looked up beside the run too, as TRL's scripts do). Raises what the import raises."""
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ImportError(f"no such file {where!r}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(where)


def load(specs) -> None:
    """Import each plugin of `--plugin` once; errors name the flag and the plugin."""
    for spec in specs:
        key = os.path.realpath(spec) if spec.endswith(".py") else spec
        if key in _LOADED:
            continue
        if spec.endswith(".py") and not os.path.isfile(spec):
            raise ValueError(f"--plugin: no such file {spec!r} (expected a Python file, path/to/file.py, or an "
                             f"importable module)")
        try:
            _LOADED[key] = import_source(spec)
        except SyntaxError as e:
            raise ValueError(f"--plugin {spec}: {e.filename}, line {e.lineno}: {e.msg}") from None
        except ModuleNotFoundError as e:
            if e.name == spec.split(".")[0] or e.name == spec:
                raise ValueError(f"--plugin: no module named {spec!r} (expected a Python file, path/to/file.py, "
                                 f"or an importable module)") from None
            raise ValueError(f"--plugin {spec}: importing it raised ModuleNotFoundError ({e})") from None
        except Exception as e:  # the plugin raised while it ran: its own error, named
            raise ValueError(f"--plugin {spec}: importing it raised {type(e).__name__} ({e})") from None
