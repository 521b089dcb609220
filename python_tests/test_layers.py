"""The layer rules of docs/design.md §1, checked on the import statements of the package's sources.

Every `import` and `from … import` counts, at module level or inside a function, so that a lazy import
cannot hide an upward edge.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
import sysconfig

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "rlkernels"

# each layer of design.md §1 by the modules (or packages) it is made of
LAYERS = {
    "helpers": ("_checks", "_groups", "_dtypes", "_token_loss_table"),
    "reference": ("reference",),
    "kernels": ("kernels", "_C"),
    "losses": ("losses",),
    "advantages": ("advantages", "sampling", "_group_advantages", "_token_advantages"),
    "ops": ("ops", "_backend"),
    "api": ("",),  # rlkernels/__init__.py, the public names
    "integrations": ("integrations",),
    "trainer": ("trainer", "train"),
    "apps": ("cli", "demo", "__main__", "_peak_memory", "_pyplot"),
}

# the layers each layer may import from rlkernels (itself included)
MAY_IMPORT = {
    "helpers": {"helpers"},
    "reference": set(),
    "kernels": {"kernels", "helpers"},
    "losses": {"losses", "helpers"},
    "advantages": {"advantages", "helpers"},
    "ops": {"ops", "kernels", "losses", "helpers"},
    "api": {"api", "ops", "losses", "advantages", "helpers"},
    "integrations": {"integrations", "api", "ops", "losses", "helpers"},
}
CORE = ("helpers", "reference", "kernels", "losses", "advantages", "ops", "api")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    return name == "_C" or base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _bound(package: str) -> set[str]:
    """The names a package's __init__.py binds by importing them from its submodules (`from . import x` binds
    the submodule x itself)."""
    init = PACKAGE.joinpath(*package.split("."), "__init__.py") if package else PACKAGE / "__init__.py"
    if not init.exists():
        return set()
    return {a.asname or a.name for node in ast.parse(init.read_text()).body if isinstance(node, ast.ImportFrom)
            and node.module for a in node.names}


def _imports(path: pathlib.Path) -> set[str]:
    """The rlkernels modules `path` imports, relative to the package ("" for the package itself)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + ([node.module] if node.module else [])
                module = ".".join(["rlkernels"] + base)
            else:
                module = node.module
            # `from m import x` imports the submodule m.x where m's __init__ does not bind x itself
            targets = [f"{module}.{a.name}" if _is_module(f"{module}.{a.name}".partition(".")[2])
                       and a.name not in _bound(module.partition(".")[2]) else module for a in node.names]
        else:
            continue
        found |= {t.partition(".")[2] for t in targets if t == "rlkernels" or t.startswith("rlkernels.")}
    return found


def _layer(module: str) -> str:
    for layer, members in LAYERS.items():
        if any(module == m or (m and module.startswith(m + ".")) for m in members):
            return layer
    raise AssertionError(f"rlkernels.{module} is in no layer of docs/design.md §1; add it to LAYERS and the table")


SOURCES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {_module_name(p): _imports(p) for p in SOURCES}


def _by_layer(layer: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in GRAPH.items() if _layer(m) == layer}


def test_every_module_is_in_a_layer():
    for module, deps in GRAPH.items():
        _layer(module)
        for dep in deps:
            assert _is_module(dep), f"rlkernels.{module} imports rlkernels.{dep}, which does not exist"
            _layer(dep)


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_layer_imports_only_what_design_allows(layer):
    bad = {f"rlkernels.{m or '__init__'} imports rlkernels.{d}"
           for m, deps in _by_layer(layer).items() for d in deps if _layer(d) not in MAY_IMPORT[layer]}
    assert not bad, sorted(bad)


def _stdlib(name: str) -> bool:
    if name in sys.builtin_module_names:
        return True
    origin = importlib.util.find_spec(name).origin or ""
    return origin.startswith(sysconfig.get_paths()["stdlib"]) and "-packages" not in origin


def test_reference_imports_only_torch():
    outside = set()
    for node in ast.walk(ast.parse((PACKAGE / "reference.py").read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            outside |= {n for n in names if n.split(".")[0] not in ("torch", "__future__")
                        and not _stdlib(n.split(".")[0])}
    assert not outside, outside


def test_nothing_imports_reference():
    assert not {m for m, deps in GRAPH.items() if "reference" in deps}


def test_core_never_imports_trainer_or_integrations():
    for layer in CORE:
        for module, deps in _by_layer(layer).items():
            assert not {d for d in deps if _layer(d) in ("trainer", "integrations", "apps")}, module


@pytest.mark.parametrize("layer", ["ops", "integrations"])
def test_losses_are_used_through_their_declared_api(layer):
    """ops/ and the integrations take from losses/ its public names (the registries `presets` and `objectives`
    among them) and `losses.spec`, nothing past them."""
    public = ("losses", "losses.presets", "losses.objectives", "losses.spec")
    past = {f"rlkernels.{m} imports rlkernels.{d}" for m, deps in _by_layer(layer).items() for d in deps
            if _layer(d) == "losses" and d not in public}
    assert not past, sorted(past)


def test_trainer_reads_models_only_through_integrations_transformers():
    for module, deps in _by_layer("trainer").items():
        assert {d for d in deps if _layer(d) == "integrations"} <= {"integrations.transformers"}, module
        assert "cli" not in deps and "demo" not in deps, module


def _is_package(name: str) -> bool:
    return name == "" or (PACKAGE.joinpath(*name.split(".")) / "__init__.py").exists()


def test_no_import_circle_between_modules():
    """No two modules import each other, directly or through others (every import counts, TYPE_CHECKING and lazy
    ones too): a circle is a design that has not decided which module owns what. A package's __init__, which
    re-exports its modules, is not a node."""
    graph = {m: {d for d in deps if not _is_package(d)} for m, deps in GRAPH.items() if not _is_package(m)}
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph.get(module, set())):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " → ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
