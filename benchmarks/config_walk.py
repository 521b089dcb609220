"""How far the trainer's `Config` and its parts travel from `trainer/loop.py:train` (issue 32 item 6, issue 40 item
12), counted on the sources with `ast`: `python -m benchmarks.config_walk [--files] [--values]`.

A *config expression* is, inside one function:
  * a name `cfg` or `config` (the trainer's names for it) unless assigned from something else there, or a
    parameter annotated `Config`;
  * an attribute `.cfg` of anything (`run.cfg`, `self.cfg`): the run object carrying the config;
  * a *part*: a bundle of config fields made by `trainer/config_parts.py` (its classes, or what its functions
    return), as the attribute it is stored in (`run.sampling`, `run.optim`: the name and attribute that an
    assignment stores it in), or a parameter annotated with a part's class;
  * a name assigned from a config expression (`cfg = run.cfg`, `part, rank = run.sampling, run.rank`, a
    conditional, `dataclasses.replace` / `merge_resume` of one);
  * a parameter, whatever its name, of a function that some call hands a config expression to, also through a
    function that forwards its `*args` to a function it is given (`sharding.gathered(root, fn, *args)`).
A single setting's value handed on (`device.placement(cfg.device, ...)`) is a plain argument: its read is counted
where it is taken, not followed further; `--values` follows the values too, as issue 40 counted its "stops" (then
only the functions, files and back-ups mean something: a value's own methods, `spec.startswith`, count as reads).
The loss's `PolicyLossConfig` is the losses layer's own input, not followed either.

Calls are resolved through each module's imports (a method by its name in every class of these files); the walk
follows them from `trainer/loop.py:train`. Counted over rlkernels/trainer/*.py, rlkernels/train.py and cli.py, and
shown apart for the config's home (run_config.py, settings.py, settings_docs.py, trl_names.py, nesting.py: its
  own declaration, parsing and validation):
  * stops: reads (attribute reads through a config expression, `getattr(cfg, name)`) + hand-ons (calls that pass
    a config expression on as an argument);
  * functions and files holding a config expression;
  * back up the layers: hand-ons from a module into one of a higher layer, the layers being the import order
    (a module is one layer above the highest module of these files it imports, as docs/design.md §1 orders the
    package's layers; python_tests/test_layers.py keeps the imports free of circles).
"""
from __future__ import annotations

import argparse
import ast
import pathlib
from typing import Dict, List, NamedTuple, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rlkernels"
CONFIG_HOME = ("trainer.run_config", "trainer.settings", "trainer.settings_docs", "trainer.trl_names", "trainer.nesting")
PARTS = "trainer.config_parts"
START = ("trainer.loop", "train")
NAMES = ("cfg", "config")
WHOLE_CONFIG_CALLS = ("replace", "merge_resume")  # calls that return the config they are given, changed
FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


class FileWalk(NamedTuple):
    reads: int
    hand_ons: int
    functions: int
    fields: frozenset  # the settings read there (the attribute names read through a config expression)
    where: frozenset = frozenset()  # the names of those functions

    @property
    def stops(self) -> int:
        return self.reads + self.hand_ons


def source_files() -> list:
    return sorted((PACKAGE / "trainer").glob("*.py")) + [PACKAGE / "train.py", PACKAGE / "cli.py"]


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


class Module:
    """One source file: its functions (a class's methods as `Class.name`), and what its imported names are."""

    def __init__(self, name: str, tree: ast.Module, known: set):
        self.name, self.tree = name, tree
        self.modules, self.names = {}, {}  # alias -> module; name -> (module, name)
        self.external = set()  # the names it imports from elsewhere (torch, os): no method of these files
        package = name.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.external |= {a.asname or a.name.split(".")[0] for a in node.names}
            if isinstance(node, ast.ImportFrom):
                base = ((package[:len(package) - node.level + 1] if node.level else [])
                        + (node.module.split(".") if node.module else []))
                if not node.level:
                    if base[:1] != ["rlkernels"]:
                        self.external |= {a.asname or a.name for a in node.names}
                        continue
                    base = base[1:]
                for a in node.names:
                    sub = ".".join(base + [a.name])
                    if sub in known:
                        self.modules[a.asname or a.name] = sub
                    elif ".".join(base) in known:
                        self.names[a.asname or a.name] = (".".join(base), a.name)
        self.functions, self.classes = {}, {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.functions[f"{node.name}.{item.name}"] = item

    def imported(self) -> set:
        return set(self.modules.values()) | {m for m, _ in self.names.values()}


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` outside its nested functions and classes (each function is a scope of its own)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, FUNCTION + (ast.ClassDef,)):
            stack.extend(ast.iter_child_nodes(node))


def _nested(scope: ast.AST):
    """The functions defined directly in `scope` (run when it runs), methods of its classes included."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, FUNCTION):
            yield node
        else:
            stack.extend(ast.iter_child_nodes(node))


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _parameters(fn) -> list:
    a = fn.args
    return [arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs]


def _annotation(arg: ast.arg) -> str:
    return ast.unparse(arg.annotation).split(".")[-1].strip("'\"") if arg.annotation is not None else ""


def _forwarded(fn) -> Optional[int]:
    """The index of the parameter that `fn` calls with its own *args (`fn(*args, **kwargs)`), if it does."""
    if isinstance(fn, ast.Lambda) or fn.args.vararg is None:
        return None
    params = _parameters(fn)
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in params and
                any(isinstance(a, ast.Starred) for a in node.args)):
            return params.index(node.func.id)
    return None


class Program:
    """The files, their layers, the parts' names, and the call resolution between them."""

    def __init__(self, sources: Dict[str, str], parts: bool = True, values: bool = False):
        self.values = values  # follow each setting's value too (`device.placement(cfg.device)`: its parameter)
        known = set(sources) | {m.rpartition(".")[0] for m in sources}
        self.modules = {name: Module(name, ast.parse(text), known) for name, text in sources.items()}
        self.fn_module = {fn: m for m in self.modules.values() for fn in m.functions.values()}
        for m in self.modules.values():  # nested functions belong to their module too
            for node in ast.walk(m.tree):
                if isinstance(node, FUNCTION):
                    self.fn_module.setdefault(node, m)
        self.methods, self.owner = {}, {}  # method name -> methods; method -> its class's name
        for m in self.modules.values():
            for qual, fn in m.functions.items():
                if "." in qual:
                    self.methods.setdefault(qual.split(".")[1], []).append(fn)
                    self.owner[fn] = qual.split(".")[0]
        self.properties = {name for name, fns in self.methods.items()
                           if any(ast.unparse(d) == "property" for fn in fns for d in fn.decorator_list)}
        parts = self.modules.get(PARTS) if parts else None  # parts=False: the whole Config alone
        self.part_classes = set(parts.classes) if parts else set()
        self.part_makers = ({f"{PARTS}.{n}" for n in parts.functions if "." not in n} |
                            {f"{PARTS}.{c}" for c in parts.classes}) if parts else set()
        self.part_attrs = self._part_attributes()
        self._levels = {}

    # -- resolution -------------------------------------------------------------------------------------------
    def _lookup(self, module: str, name: str) -> list:
        m = self.modules.get(module)
        if m is None:
            return []
        if name in m.classes:
            init = m.functions.get(f"{name}.__init__")
            return [init] if init is not None else []
        fn = m.functions.get(name)
        return [fn] if fn is not None else []

    def qualified(self, module: Module, func: ast.expr) -> Optional[str]:
        """`module.name` of a function or class that `func` names through the module's own names or imports."""
        if isinstance(func, ast.Name):
            if func.id in module.functions or func.id in module.classes:
                return f"{module.name}.{func.id}"
            if func.id in module.names:
                return ".".join(module.names[func.id])
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in module.modules:
            return f"{module.modules[func.value.id]}.{func.attr}"
        return None

    def resolve(self, module: Module, func: ast.expr) -> list:
        """The functions of these files that a call of `func` in `module` may run."""
        qual = self.qualified(module, func)
        if qual is not None:
            mod, _, name = qual.rpartition(".")
            return self._lookup(mod, name)
        if isinstance(func, ast.Attribute) and not self.is_module_name(module, func.value):
            return self.methods.get(func.attr, [])
        return []

    @staticmethod
    def is_module_name(module: Module, e: ast.expr) -> bool:
        return isinstance(e, ast.Name) and (e.id in module.modules or e.id in module.external)

    def _part_attributes(self) -> set:
        """(name, attribute) of the attributes that hold a part: targets of assignments from a part's maker
        (`run.optim = take(...)`: ("run", "optim")), so that another object's attribute of that name is not one."""
        attrs = set()
        for m in self.modules.values():
            for node in ast.walk(m.tree):
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    for t, v in _pairs(target, node.value):
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and
                                isinstance(v, ast.Call) and self.makes_part(m, v)):
                            attrs.add((t.value.id, t.attr))
        return attrs

    def makes_part(self, module: Module, call: ast.Call) -> bool:
        qual = self.qualified(module, call.func)
        return qual in self.part_makers and not qual.endswith(".attach")

    def module_of(self, fn) -> Module:
        return self.fn_module[fn]

    def level(self, name: str) -> int:
        """One layer above the highest of these files that `name` imports (0: it imports none of them)."""
        if name not in self._levels:
            self._levels[name] = 0  # the imports have no circles (test_layers); this only stops a broken tree
            deps = [d for d in self.modules[name].imported() if d in self.modules and d != name]
            self._levels[name] = 1 + max(map(self.level, deps)) if deps else 0
        return self._levels[name]


def _pairs(target, value):
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return list(zip(target.elts, value.elts))
    return [(target, value)]


class ScopeWalk(NamedTuple):
    reads: int
    hand_ons: int
    fields: frozenset
    seen: bool
    handed: list  # (callee, its parameter, the module handing it on, the callee's module, the forwarder or None)
    calls: list  # FunctionDefs this scope may run
    names: frozenset  # the names holding a config expression here (a nested function sees them too)


def walk_scope(program: Program, scope, given=(), enclosing=frozenset()) -> ScopeWalk:
    """The config expressions of one function; `given`: its parameters that a caller hands a config expression to;
    `enclosing`: the names holding one in the function it is defined in (a closure reads them)."""
    module = program.module_of(scope)
    a = scope.args
    params = {arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs}
    names, other = set(given) | (set(enclosing) - params), set()
    # in a method, `self` is what the class's instances are called elsewhere (Run's `self.logs` is `run.logs`)
    holder = {"self": program.owner[scope].lower()} if scope in program.owner else {}
    for arg in a.posonlyargs + a.args + a.kwonlyargs:
        if arg.arg in NAMES or _annotation(arg) == "Config" or _annotation(arg) in program.part_classes:
            names.add(arg.arg)

    def is_config(e) -> bool:
        if isinstance(e, ast.Name):
            return e.id in names or (e.id in NAMES and e.id not in other)
        if isinstance(e, ast.Attribute):
            return e.attr == "cfg" or (isinstance(e.value, ast.Name) and (holder.get(e.value.id, e.value.id), e.attr)
                                       in program.part_attrs) or (program.values and is_config(e.value))
        if isinstance(e, ast.IfExp):
            return is_config(e.body) or is_config(e.orelse)
        if isinstance(e, ast.Call):
            return ((_call_name(e) in WHOLE_CONFIG_CALLS and any(is_config(x) for x in e.args)) or
                    program.makes_part(module, e))
        return False

    nodes = list(_own_nodes(scope))
    # a `config` made here from something else (a transformers LlamaConfig) is not the run's
    other |= {t.id for n in nodes if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name) and t.id in NAMES and t.id not in names and not is_config(n.value)}
    changed = True
    while changed:  # names assigned from config expressions, to a fixed point (assignments in any order)
        changed = False
        for node in nodes:
            if (program.values and isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                    and node.target.id not in names and is_config(node.iter)):
                names.add(node.target.id)
                changed = True
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for t, v in _pairs(target, node.value):
                        if isinstance(t, ast.Name) and t.id not in names and is_config(v):
                            names.add(t.id)
                            changed = True
    reads = hand_ons = 0
    fields, handed, calls = set(), [], []
    for node in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and is_config(node.value):
            reads += 1
            fields.add(node.attr)
        if isinstance(node, ast.Attribute) and node.attr in program.properties:
            calls += program.methods[node.attr]  # a property runs when it is read
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            calls += program.resolve(module, node)  # a function handed on as a value runs later
        if not isinstance(node, ast.Call):
            continue
        callees = program.resolve(module, node.func)
        calls += callees
        if _call_name(node) == "getattr" and node.args and is_config(node.args[0]):
            reads += 1
            continue
        if _call_name(node) in WHOLE_CONFIG_CALLS or program.makes_part(module, node) and not any(
                is_config(x) for x in list(node.args) + [k.value for k in node.keywords]):
            continue
        args = list(node.args) + [k.value for k in node.keywords]
        hand_ons += sum(is_config(x) for x in args)
        for callee in callees:
            handed += _bind(program, module, callee, node, is_config)
    seen = any(is_config(n) for n in nodes if isinstance(n, ast.expr))
    return ScopeWalk(reads, hand_ons, frozenset(fields), seen, handed, calls, frozenset(names))


def _bind(program: Program, module: Module, callee, call: ast.Call, is_config) -> list:
    """(callee, parameter, from module, to module) for each config expression `call` hands to `callee`; through a
    forwarder, to the function it forwards to, from the forwarder's module."""
    params = _parameters(callee)
    skip = int(params[:1] in (["self"], ["cls"]))
    out = []
    to = program.module_of(callee).name
    for i, x in enumerate(call.args):
        if is_config(x) and i + skip < len(params):
            out.append((callee, params[i + skip], module.name, to, None))
    for k in call.keywords:
        if is_config(k.value) and k.arg in params:
            out.append((callee, k.arg, module.name, to, None))
    fwd = _forwarded(callee)
    if fwd is not None and fwd - skip < len(call.args):
        for target in program.resolve(module, call.args[fwd - skip]):
            t_params = _parameters(target)
            rest = call.args[fwd - skip + 1:]
            for i, x in enumerate(rest):
                if is_config(x) and i < len(t_params):
                    out.append((target, t_params[i], to, program.module_of(target).name, callee))
            for k in call.keywords:
                if is_config(k.value) and k.arg in t_params:
                    out.append((target, k.arg, to, program.module_of(target).name, callee))
    return out


class Report(NamedTuple):
    files: Dict[str, FileWalk]
    back_ups: List[str]  # "from -> to (callee)" of each hand-on back up the layers


def analyse(program: Program) -> Report:
    """The walk from START, to a fixed point of the parameters handed the config."""
    start = program.modules[START[0]].functions[START[1]]
    given: Dict[object, set] = {}
    while True:
        reached, stack, results = set(), [(start, frozenset())], {}
        while stack:
            fn, enclosing = stack.pop()
            if fn in reached:
                continue
            reached.add(fn)
            results[fn] = w = walk_scope(program, fn, given.get(fn, ()), enclosing)
            stack += [(c, frozenset()) for c in w.calls if c not in reached] + [(n, w.names) for n in _nested(fn)]
        grown = False
        for w in results.values():
            for callee, param, *_ in w.handed:
                if param not in given.setdefault(callee, set()):
                    given[callee].add(param)
                    grown = True
        if not grown:
            break
    files, back_ups, forwarders = {}, [], {}

    def add(module: str, fn, reads: int, hand_ons: int, fields=frozenset()):
        f = files.get(module, FileWalk(0, 0, 0, frozenset()))
        files[module] = FileWalk(f.reads + reads, f.hand_ons + hand_ons, f.functions + 1, f.fields | fields,
                                 f.where | {getattr(fn, "name", "lambda")})

    for fn, w in results.items():
        if w.seen:
            add(program.module_of(fn).name, fn, w.reads, w.hand_ons, w.fields)
        for callee, param, src, dst, via in w.handed:
            if via is not None:  # the forwarder hands it on: a stop of its own
                forwarders.setdefault(via, []).append(src)
            if program.level(dst) > program.level(src):
                back_ups.append(f"{src} → {dst}.{callee.name}({param})")
    for via, handed in forwarders.items():
        add(program.module_of(via).name, via, 0, len(handed))
    return Report(files, sorted(back_ups))


def walk(sources: Optional[Dict[str, str]] = None, parts: bool = True, values: bool = False) -> Report:
    """The walk of the Config and its parts (`parts=False`: of the whole Config alone) over `sources` ({module
    name relative to rlkernels: its text}; the package's files by default)."""
    if sources is None:
        sources = {_module_name(p): p.read_text(encoding="utf-8") for p in source_files()}
    return analyse(Program(sources, parts, values))


def _line(label: str, files: Dict[str, FileWalk]) -> str:
    fw = files.values()
    return (f"{label}: {sum(w.stops for w in fw)} stops ({sum(w.reads for w in fw)} reads + "
            f"{sum(w.hand_ons for w in fw)} hand-ons) in {sum(w.functions for w in fw)} functions of "
            f"{len(files)} files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="one line per file, and each hand-on back up")
    parser.add_argument("--values", action="store_true", help="also the walk that follows each setting's value")
    args = parser.parse_args()
    report = walk()
    if args.files:
        for name, w in sorted(report.files.items()):
            print(f"{name:<28} {w.reads:4d} reads {w.hand_ons:3d} hand-ons {w.functions:3d} functions "
                  f"{len(w.fields):3d} settings")
        for line in report.back_ups:
            print(f"back up: {line}")
    home = {k: v for k, v in report.files.items() if k in CONFIG_HOME}
    print(_line("the Config and its parts from loop.train", report.files))
    print(_line(f"  of which in the config's own home ({', '.join(m.split('.')[-1] for m in CONFIG_HOME)})", home))
    print(f"  {len(report.back_ups)} hand-ons back up the layers; startup.py reads "
          f"{len(report.files.get('trainer.startup', FileWalk(0, 0, 0, frozenset())).fields)} settings")
    whole = walk(parts=False).files
    print(_line("the whole Config alone", whole))
    if args.values:
        values = walk(values=True)
        print(f"following each setting's value too: {sum(w.functions for w in values.files.values())} functions of "
              f"{len(values.files)} files, {len(values.back_ups)} hand-ons back up the layers")


if __name__ == "__main__":
    main()
