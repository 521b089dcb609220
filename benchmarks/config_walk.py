"""How far the trainer's whole `Config` travels (issue 32 item 6), counted on the sources with `ast`:
`python -m benchmarks.config_walk [--files]`.

A *config expression* is, inside one function (or a module's top level):
  * a name `cfg` or `config` (the trainer's names for it) unless assigned from something else there, or a
    parameter annotated `Config`;
  * an attribute `.cfg` of anything (`run.cfg`, `self.cfg`): the run object carrying the config;
  * a name assigned from a config expression (`cfg = run.cfg`, `cfg, rank = run.cfg, run.rank`, a conditional
    or `dataclasses.replace` / `merge_resume` of one);
  * a parameter, whatever its name, of a function of these files that some call hands a config expression to
    (found by the function's name; a class's name calls its __init__).
Counted over the trainer's files (rlkernels/trainer/*.py but the config's own modules, which parse, validate and
merge it, plus rlkernels/train.py and cli.py):
  * files: those holding any config expression;
  * reads: attribute reads through a config expression (`cfg.steps`, `run.cfg.out`, `getattr(cfg, name)`);
  * hand-ons: calls that pass a config expression on as an argument (the config travelling further).
"""
from __future__ import annotations

import argparse
import ast
import pathlib
from typing import Dict, Iterable, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
# where the config is made: parsed, validated, merged on --resume (a walk there is the config's own business)
CONFIG_HOME = ("run_config.py", "trl_names.py", "nesting.py")
NAMES = ("cfg", "config")
WHOLE_CONFIG_CALLS = ("replace", "merge_resume")  # calls that return the config they are given, changed


class Walk(NamedTuple):
    reads: int
    hand_ons: int


def trainer_files() -> list:
    trainer = sorted(p for p in (ROOT / "rlkernels" / "trainer").glob("*.py") if p.name not in CONFIG_HOME)
    return trainer + [ROOT / "rlkernels" / "train.py", ROOT / "rlkernels" / "cli.py"]


def _annotation_is_config(arg: ast.arg) -> bool:
    ann = arg.annotation
    return ann is not None and (ast.unparse(ann).split(".")[-1].strip("'\"") == "Config")


def _scopes(tree: ast.AST) -> Iterable[ast.AST]:
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield node


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` outside its nested functions (each function is a scope of its own)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _parameters(fn) -> list:
    a = fn.args
    return [arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs]


def _walk_scope(scope: ast.AST, given=(), handed=None) -> Walk:
    """The Walk of one scope; `given`: parameters a caller hands the config to (whatever their names); `handed`, if
    a list: gets (callee name, the parameter position or keyword) of each call that hands it on."""
    names, other = set(given), set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs:
            if arg.arg in NAMES or _annotation_is_config(arg):
                names.add(arg.arg)

    def is_config(e) -> bool:
        if isinstance(e, ast.Name):
            return e.id in names or (e.id in NAMES and e.id not in other)
        if isinstance(e, ast.Attribute):
            return e.attr == "cfg"
        if isinstance(e, ast.IfExp):
            return is_config(e.body) or is_config(e.orelse)
        if isinstance(e, ast.Call):
            return _call_name(e) in WHOLE_CONFIG_CALLS and any(is_config(x) for x in e.args)
        return False

    nodes = list(_own_nodes(scope))
    # a `config` made here from something else (a transformers LlamaConfig) is not the run's
    other |= {t.id for n in nodes if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name) and t.id in NAMES and t.id not in names and not is_config(n.value)}
    changed = True
    while changed:  # names assigned from config expressions, to a fixed point (assignments in any order)
        changed = False
        for node in nodes:
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and
                         isinstance(node.value, ast.Tuple) else [(target, node.value)])
                for t, v in pairs:
                    if isinstance(t, ast.Name) and t.id not in names and is_config(v):
                        names.add(t.id)
                        changed = True
    reads = hand_ons = 0
    for node in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and is_config(node.value):
            reads += 1
        elif isinstance(node, ast.Call):
            args = list(node.args) + [k.value for k in node.keywords]
            if _call_name(node) == "getattr" and node.args and is_config(node.args[0]):
                reads += 1
            elif _call_name(node) not in WHOLE_CONFIG_CALLS:
                hand_ons += sum(is_config(x) for x in args)
                if handed is not None:
                    handed += [(_call_name(node), i) for i, x in enumerate(node.args) if is_config(x)]
                    handed += [(_call_name(node), k.arg) for k in node.keywords if is_config(k.value)]
    seen = any(is_config(n) for n in nodes if isinstance(n, ast.expr))
    return Walk(reads, hand_ons) if seen else Walk(-1, 0)


def _functions(tree) -> dict:
    """{name: FunctionDef} of a module's functions, and of its classes' methods (a class's name: its __init__)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[node.name if item.name == "__init__" else item.name] = item
    return out


def _walk_tree(tree, given: dict, handed=None) -> Walk:
    """(attribute reads through the config, calls handing it on) in one module; reads -1: no config there.
    `given`: {function: parameters} that callers elsewhere hand the config to."""
    found = [w for w in (_walk_scope(scope, given.get(scope, ()), handed) for scope in _scopes(tree))
             if w.reads >= 0]
    if not found:
        return Walk(-1, 0)
    return Walk(sum(w.reads for w in found), sum(w.hand_ons for w in found))


def _handed_to(trees) -> dict:
    """{FunctionDef: its parameters that some call in `trees` hands the config to}, whatever their names, so that
    a renamed parameter hides nothing (a function is found by its name alone: a name defined twice counts twice)."""
    defined = {}
    for tree in trees:
        for name, fn in _functions(tree).items():
            defined.setdefault(name, []).append(fn)
    given = {}
    while True:  # to a fixed point: a function handed the config may hand it on in turn
        handed = []
        for tree in trees:
            _walk_tree(tree, given, handed)
        grown = False
        for callee, where in handed:
            for fn in defined.get(callee, []):
                params = _parameters(fn)
                if isinstance(where, int):
                    where += params[:1] in (["self"], ["cls"])
                    where = params[where] if where < len(params) else None
                if where in params and where not in given.setdefault(fn, set()):
                    given[fn].add(where)
                    grown = True
        if not grown:
            return given


def walk() -> Dict[str, Walk]:
    """{file (relative to the repository): its Walk} for the files the config reaches."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in trainer_files()}
    given = _handed_to(list(trees.values()))
    out = {}
    for path, tree in trees.items():
        w = _walk_tree(tree, given)
        if w.reads >= 0:
            out[str(path.relative_to(ROOT))] = w
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="one line per file")
    files = walk()
    if parser.parse_args().files:
        for name, w in sorted(files.items()):
            print(f"{name:<40} {w.reads:4d} reads {w.hand_ons:3d} hand-ons")
    print(f"the whole Config reaches {len(files)} files: {sum(w.reads for w in files.values())} attribute reads, "
          f"{sum(w.hand_ons for w in files.values())} calls hand it on")


if __name__ == "__main__":
    main()
