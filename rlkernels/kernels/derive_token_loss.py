"""∂s/∂ℓ of each objective's formula in the table (rlkernels/_token_loss_table.py, `Entry.formula`), derived with
sympy, and the formula and its derivative printed as Triton and as C++ (gen_token_loss_header writes both files).

Only the generator imports this module (sympy is a build-time tool, the kernels never import it).

A formula is lines `name = expression` in Python syntax; `s` is the surrogate, `flag_low` / `flag_high` (booleans,
default false) the clip statistics, other names are intermediates, printed as named locals where the generated code
uses them. It may read ℓ (`logp`), ℓ_old (`old_logp`), A (`adv`), w = e^r with r = clamp(ℓ − ℓ_old, ±c) (`w`),
the unclamped d = ℓ − ℓ_old (`d`), Clip-Cov's and KL-Cov's `chosen`, and the table's parameters by name; and
`sg` (stop-gradient), `clamp`, `minimum`, `maximum`, `where`, `select` (a boolean where), `mask` (a boolean as 0/1,
a factor: NaN stays NaN), `sigmoid`, `exp`, `log`, `Abs`, `Ne`. The derivative follows torch's autograd rules,
which the spec (losses/) is differentiated by: clamp passes the gradient on its closed interval; minimum / maximum
pass it to the smaller / larger argument, half to each on a tie (torch.minimum's rule, which reference.py and verl's
dual clip have; a bound that must pass all of it is a clamp, as δ's) and to both where either is NaN; `where`
passes it to the branch it takes; a gradient a clamp or a `where` stops is 0, even through a NaN factor. w's gradient reaches ℓ as `through_w` does: times w where the
clamp of r passes (`r_passes`), else 0.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import sympy as sp
from sympy.logic.boolalg import Boolean, BooleanFunction

from . import token_loss_params as P

INPUTS = ("logp", "old_logp", "adv", "w", "d", "chosen")
CONSTANTS = {"BERNOULLI_EPS": 1e-8}  # named, so that sympy keeps 1 − p + 1e-8 apart (1 + 1e-8 is 1 in fp32)
R_PASSES = sp.Symbol("r_passes")


class sg(sp.Function):
    """stop-gradient: its argument's value, no gradient."""


class clamp(sp.Function):
    pass


class minimum(sp.Function):
    pass


class maximum(sp.Function):
    pass


class sigmoid(sp.Function):
    pass


class mask(sp.Function):
    """A condition as 0.0 / 1.0, a factor (0·NaN stays NaN, unlike `where`)."""


class select(BooleanFunction):
    """where(c, a, b) of booleans, as the kernels' select: unlike (c ∧ a) ∨ (¬c ∧ b) it needs no negation, which
    sympy would rewrite as the opposite comparison (wrong for NaN)."""

    @classmethod
    def eval(cls, *args):
        return None


class ordered(BooleanFunction):
    """Neither argument is NaN (sympy takes a < b or a ≥ b for true, so the kernels' NaN branch needs its own name)."""

    @classmethod
    def eval(cls, *args):
        return None


def where(cond, a, b):
    return sp.Piecewise((a, cond), (b, True))


NAMESPACE = dict(sg=sg, clamp=clamp, minimum=minimum, maximum=maximum, sigmoid=sigmoid, mask=mask, select=select,
                 where=where, exp=sp.exp, log=sp.log, Abs=sp.Abs, Ne=sp.Ne)


def symbols() -> Dict[str, sp.Symbol]:
    names = INPUTS + tuple(p.name for p in P.PARAMS) + tuple(CONSTANTS)
    return {name: sp.Symbol(name, real=True) for name in names}


@dataclasses.dataclass
class Derived:
    """An objective's formula, ready to print: its named intermediates in order (name, value), and s, ∂s/∂ℓ and the
    flags in terms of them."""
    locals: List[Tuple[str, sp.Basic]]
    s: sp.Expr
    ds: sp.Expr
    flag_low: sp.Basic
    flag_high: sp.Basic


def is_boolean(e) -> bool:
    """A condition (a Symbol is a Boolean to sympy: a real one is not)."""
    return isinstance(e, Boolean) and not (isinstance(e, sp.Symbol) and e.is_real)


def parse(formula: str) -> List[Tuple[sp.Symbol, sp.Basic]]:
    """The formula's lines as (name, value), each value in terms of the inputs and the earlier names."""
    names = dict(symbols(), **NAMESPACE)
    lines = []
    for line in filter(str.strip, formula.splitlines()):
        name, _, text = (part.strip() for part in line.partition("="))
        assert name.isidentifier() and name not in names, f"{line!r}: a new name, then `=`"
        value = sp.sympify(eval(text, {"__builtins__": {}}, names))  # the table's own text, not input
        names[name] = sp.Symbol(name) if is_boolean(value) else sp.Symbol(name, real=True)
        lines.append((names[name], value))
    return lines


def _scale(k, e):
    """k·e with k taken into each branch of a select: a gradient the select stops stays 0 (reverse mode's order)."""
    if k == 1:
        return e
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*[(_scale(k, v), c) for v, c in e.args])
    if isinstance(e, sp.Add):
        return sp.Add(*[_scale(k, a) for a in e.args])
    return k * e


class _Derivative:
    """∂/∂ℓ of expressions of the inputs and a formula's names (`derivatives`: each name's, inlined)."""

    def __init__(self):
        self.of_name: Dict[sp.Symbol, sp.Basic] = {}
        self.w = symbols()["w"]

    def __call__(self, e):
        if isinstance(e, (sp.Number, sp.NumberSymbol)) or is_boolean(e):
            return sp.Integer(0)
        if isinstance(e, sp.Symbol):
            if e in self.of_name:
                return self.of_name[e]
            return {"logp": sp.Integer(1), "d": sp.Integer(1),
                    "w": sp.Piecewise((self.w, R_PASSES), (0, True))}.get(e.name, sp.Integer(0))
        if isinstance(e, (sg, mask)):
            return sp.Integer(0)
        if isinstance(e, sp.Add):
            return sp.Add(*[self(a) for a in e.args])
        if isinstance(e, sp.Mul):
            return sp.Add(*[_scale(sp.Mul(*e.args[:i], *e.args[i + 1:]), self(a)) for i, a in enumerate(e.args)])
        if isinstance(e, sp.Pow):
            base, n = e.args
            assert self(n) == 0, f"{e}: a variable exponent"
            return _scale(n * base ** (n - 1), self(base))
        if isinstance(e, sp.exp):
            return _scale(e, self(e.args[0]))
        if isinstance(e, sp.log):
            return _scale(1 / e.args[0], self(e.args[0]))
        if isinstance(e, sigmoid):
            return _scale(e * (1 - e), self(e.args[0]))
        if isinstance(e, sp.Abs):  # torch's sign, 0 at 0 (and at NaN, as the hand kernels had it)
            a, da = e.args[0], self(e.args[0])
            return sp.Piecewise((da, a > 0), (_scale(-1, da), a < 0), (0, True))
        if isinstance(e, clamp):
            a, lo, hi = e.args
            assert self(lo) == 0 and self(hi) == 0, f"{e}: a clamp's bounds are constants"
            return sp.Piecewise((self(a), (a >= lo) & (a <= hi)), (0, True))
        if isinstance(e, (minimum, maximum)):
            a, b = e.args
            a_wins, b_wins = (a < b, b < a) if isinstance(e, minimum) else (a > b, b > a)
            return sp.Piecewise((self(b), b_wins), (self(a), a_wins), ((self(a) + self(b)) / 2, ordered(a, b)),
                                (self(a) + self(b), True))
        if isinstance(e, sp.Piecewise):
            return sp.Piecewise(*[(self(value), cond) for value, cond in e.args])
        raise TypeError(f"no derivative rule for {type(e).__name__}: {e}")


def _merge(e):
    """A sum of selects on the same conditions as one select of the sums (each simplified)."""
    if isinstance(e, sp.Add):
        parts = [a for a in e.args if isinstance(a, sp.Piecewise)]
        if len(parts) > 1 and len({tuple(c for _, c in a.args) for a in parts}) == 1:
            rest = sp.Add(*[a for a in e.args if not isinstance(a, sp.Piecewise)])
            return sp.Piecewise(*[(sp.factor_terms(sum(a.args[i][0] for a in parts) + rest), c)
                                  for i, (_, c) in enumerate(parts[0].args)])
    return e


def _unstop(e):
    """The value of sg(x) is x."""
    return e.replace(lambda a: isinstance(a, sg), lambda a: a.args[0])


def derive(formula: str) -> Derived:
    lines = parse(formula)
    values = {n.name: v for n, v in lines}
    assert "s" in values, "a formula defines s"
    derivative = _Derivative()
    to_name = {}  # each name's value (its sg as values) by the name, so that derivatives read the names
    for name, value in lines:
        derivative.of_name[name] = _merge(_unstop(derivative(value))).xreplace(to_name)
        to_name[_unstop(value).xreplace(to_name)] = name
    outputs = dict(s=values["s"], ds=derivative.of_name[sp.Symbol("s", real=True)],
                   flag_low=values.get("flag_low", sp.false), flag_high=values.get("flag_high", sp.false))
    # The derivative's repeated parts, named after the names they are the derivatives of where they are (d_ppo).
    names_of = {v: f"d_{n.name}" for n, v in derivative.of_name.items() if not isinstance(v, (sp.Number, sp.Symbol))}
    pairs, (ds,) = sp.cse([outputs["ds"]], symbols=sp.numbered_symbols("g"), optimizations=None)
    renames, expanded, local_ds = {}, {}, []
    for symbol, value in pairs:
        full = value.xreplace(expanded)
        expanded[symbol] = full
        value = value.xreplace(renames)
        if isinstance(value, sp.Mul) and len(value.args) == 2 and value.args[0] == -1 or value.is_Atom:
            renames[symbol] = value  # −x needs no name
            continue
        renames[symbol] = sp.Symbol(names_of.get(full, symbol.name), real=True)
        local_ds.append((renames[symbol], value))
    outputs["ds"] = ds.xreplace(renames)
    outputs = {k: _unstop(v) for k, v in outputs.items()}
    named = [(n, _unstop(v)) for n, v in lines if n.name not in outputs] + local_ds
    used, todo = set(), list(outputs.values())
    while todo:
        expr = todo.pop()
        for symbol in expr.free_symbols - used:
            used.add(symbol)
            todo += [v for n, v in named if n == symbol]
    return Derived([(n.name, v) for n, v in named if n in used], outputs["s"], outputs["ds"], outputs["flag_low"],
                   outputs["flag_high"])


# --- printing ------------------------------------------------------------------------------------------------------


class Printer:
    """Triton or C++ text of an expression. Subclasses name the operations."""
    params = {p.name for p in P.PARAMS}

    def __call__(self, e, prec=0) -> str:
        text, own = self._print(e)
        return f"({text})" if own < prec else text

    def _print(self, e):  # (text, precedence: 0 select, 1 or, 2 and, 3 comparison, 4 sum, 5 product, 6 unary, 7 atom)
        if isinstance(e, sp.Symbol):
            if e.name in CONSTANTS:
                return self.number(CONSTANTS[e.name]), 7
            return (self.param(e.name) if e.name in self.params else e.name), 7
        if e is sp.true or e is sp.false:
            return self.boolean(e is sp.true), 7
        if isinstance(e, sp.Number):
            if e < 0:
                return "-" + self(-e, 7), 6
            return self.number(float(e)), 7
        if isinstance(e, sp.Add):
            # a positive number first, a negative term after the others, a named constant last: 1 − p + ε
            constants = {sp.Symbol(c, real=True) for c in CONSTANTS}
            terms = sorted(e.args, key=lambda t: 3 if t.free_symbols & constants else 0 if t.is_Number and t > 0
                           else 2 if t.could_extract_minus_sign() else 1)
            text = self(terms[0], 4)
            for t in terms[1:]:
                text += f" - {self(-t, 5)}" if t.could_extract_minus_sign() else f" + {self(t, 5)}"
            return text, 4
        if isinstance(e, sp.Mul):
            coeff, rest = e.as_coeff_Mul()
            if coeff < 0:  # −(a·b) = (−a)·b exactly
                return "-" + self(-e, 5), 5
            num, den = [], []
            for f in sp.Mul.make_args(rest):
                if isinstance(f, sp.Pow) and f.exp.is_negative:
                    den.append(f.base ** -f.exp)
                else:
                    num.append(f)
            num = ([] if coeff == 1 else [coeff]) + num
            text = " * ".join(self(f, 5) for f in num) if num else self.number(1.0)
            for f in den:
                text += f" / {self(f, 6)}"
            return text, 5
        if isinstance(e, sp.Pow):
            base, n = e.args
            if n == 2:
                b = self(base, 6)
                return f"{b} * {b}", 5
            if n == -1:
                return f"{self.number(1.0)} / {self(base, 6)}", 5
            raise TypeError(f"no printing of the power {e}")
        if isinstance(e, sp.Piecewise):
            (value, cond), rest = e.args[0], e.args[1:]
            if cond is sp.true:
                return self._print(value)
            other = sp.Piecewise(*rest) if rest else sp.nan
            return self.where(self(cond, 1), self(value, 1), self(other)), self.where_precedence
        if isinstance(e, ordered):
            a, b = (self(v, 3) for v in e.args)
            return self.both(f"{a} == {a}", f"{b} == {b}"), 2 if self.cpp else 5
        if isinstance(e, select):
            return self.where(*(self(a) for a in e.args)), self.where_precedence
        if isinstance(e, sp.And):
            return (" && ".join(self(a, 3) for a in self._order(e.args)) if self.cpp else
                    " & ".join(self(a, 7) for a in self._order(e.args))), 2 if self.cpp else 5
        if isinstance(e, sp.Or):
            return (" || ".join(self(a, 3) for a in self._order(e.args)) if self.cpp else
                    " | ".join(self(a, 7) for a in self._order(e.args))), 1 if self.cpp else 4
        if isinstance(e, sp.Not):
            return ("!" if self.cpp else "~") + self(e.args[0], 7), 6
        if isinstance(e, sp.core.relational.Relational):
            lhs, rhs = e.args
            return f"{self(lhs, 4)} {e.rel_op} {self(rhs, 4)}", 3
        if isinstance(e, mask):
            return self.mask(self(e.args[0])), 7
        if isinstance(e, sp.Abs):
            return self.call("abs", e.args[0]), 7
        if isinstance(e, (sp.exp, sp.log, sigmoid, clamp, minimum, maximum)):
            return self.call(type(e).__name__, *e.args), 7
        raise TypeError(f"no printing of {type(e).__name__}: {e}")

    @staticmethod
    def _order(args):
        return sorted(args, key=sp.default_sort_key)


class TritonPrinter(Printer):
    cpp = False
    where_precedence = 7  # a call
    names = dict(exp="tl.exp", log="tl.log", abs="tl.abs", sigmoid="sigmoid", clamp="clamp", minimum="minimum",
                 maximum="maximum")

    def param(self, name):
        return f"params[{name.upper()}]"

    def boolean(self, value):
        return "True" if value else "False"

    def number(self, x):
        return repr(x)

    def where(self, c, a, b):
        return f"tl.where({c}, {a}, {b})"

    def both(self, a, b):
        return f"({a}) & ({b})"

    def mask(self, c):
        return f"tl.where({c}, 1.0, 0.0)"

    def call(self, name, *args):
        return f"{self.names[name]}({', '.join(self(a) for a in args)})"


class CppPrinter(Printer):
    cpp = True
    where_precedence = 0  # the ternary
    names = dict(exp="exp_", log="log_", abs="abs_", sigmoid="sigmoid_", clamp="clamp_", minimum="min_",
                 maximum="max_")

    def param(self, name):
        return f"p.{name}"

    def boolean(self, value):
        return "true" if value else "false"

    def number(self, x):
        return f"T({int(x)})" if x.is_integer() else f"T({x!r})"

    def where(self, c, a, b):
        return f"{c} ? {a} : {b}"

    def both(self, a, b):
        return f"{a} && {b}"

    def mask(self, c):
        return f"T({c})"

    def call(self, name, *args):
        return f"{self.names[name]}({', '.join(self(a) for a in args)})"



# --- the generated files -------------------------------------------------------------------------------------------

TRITON_FILE = ("rlkernels", "kernels", "triton", "token_loss_surrogates.py")
CPP_FILE = ("csrc", "include", "rlkernels", "token_loss_surrogates.h")
GENERATED = ("GENERATED by `python -m rlkernels.kernels.gen_token_loss_header` from the formulas of the table of "
             "objectives, rlkernels/_token_loss_table.py. Do not edit: change the formula and run that; "
             "python_tests/test_token_loss_table.py fails when this is not what the table gives.")


def _inputs(derived: Derived) -> List[str]:
    """The inputs a formula reads, in the order of INPUTS, then r_passes."""
    used = set()
    for e in [derived.s, derived.ds, derived.flag_low, derived.flag_high] + [v for _, v in derived.locals]:
        used |= {a.name for a in e.free_symbols}
    return [n for n in INPUTS if n in used] + (["r_passes"] if "r_passes" in used else [])


def _wrap(text: str, indent: str, prefix: str) -> List[str]:
    import textwrap
    return textwrap.wrap(text, 120 - len(indent) - len(prefix), initial_indent=indent + prefix,
                         subsequent_indent=indent + prefix)


def _derived():
    return [(e, derive(e.formula)) for e in sorted(P.OBJECTIVES, key=lambda e: e.id)]


def render_triton(derived=None) -> str:
    t = TritonPrinter()
    lines = ['"""' + GENERATED, "",
             "Each objective's (s, ∂s/∂ℓ, clip_low, clip_high), flags as 0/1; `surrogate` picks the objective's.",
             "g0, g1, ...: parts of the derivative used more than once; d_x: the derivative of x.", '"""', "",
             "import triton", "import triton.language as tl", "",
             "from .. import token_loss_params as P",
             "from .token_math import clamp, maximum, minimum, sigmoid  # noqa: F401 (the formulas' functions)", "",
             "globals().update({name: tl.constexpr(value) for name, value in P.triton_constants().items()})"]
    calls = []
    for entry, d in derived or _derived():
        args = _inputs(d)
        name = f"surrogate_{P.upper_name(entry.name).lower()}"
        lines += ["", "", "@triton.jit", f"def {name}({', '.join(args + ['params'])}):"]
        lines += _wrap(entry.doc, "    ", "# ")
        for local, value in d.locals:
            lines.append(f"    {local} = {t(value)}")
        flag = lambda f: "0.0" if f is sp.false else f"tl.where({t(f)}, 1.0, 0.0)"  # noqa: E731
        lines += [f"    s = {t(d.s)}", f"    ds = {t(d.ds)}",
                  f"    return s, ds, {flag(d.flag_low)}, {flag(d.flag_high)}"]
        calls.append((P.upper_name(entry.name), name, args))
    lines += ["", "", "@triton.jit",
              "def surrogate(logp, old_logp, adv, w, d, chosen, r_passes, params, OBJECTIVE: tl.constexpr):",
              '    """(s, ∂s/∂ℓ, clip_low, clip_high) of the objective OBJECTIVE."""']
    for i, (constant, name, args) in enumerate(calls):
        keyword = "if" if i == 0 else "elif"
        lines += [f"    {keyword} OBJECTIVE == {constant}:",
                  f"        s, ds, clip_low, clip_high = {name}({', '.join(args + ['params'])})"]
    lines += ["    return s, ds, clip_low, clip_high"]
    return "\n".join(lines) + "\n"


def render_cpp(derived=None) -> str:
    c = CppPrinter()
    lines = [*_wrap(GENERATED, "", "// "),
             "// Each objective's surrogate s, ∂s/∂ℓ and clip flags; `surrogate` picks the objective's. g0, g1, ...:",
             "// parts of the derivative used more than once; d_x: the derivative of x. Included by token_loss.h,",
             "// after the functions the formulas call (clamp_, min_, max_, sigmoid_, abs_). No torch includes.",
             "#pragma once", "", '#include "rlkernels/row_math.h"', '#include "rlkernels/token_loss_table.h"', "",
             "namespace rlk {", "", "template <typename T>", "struct Surrogate {", "  T s, ds;",
             "  bool clip_low, clip_high;", "};"]
    types = dict(r_passes="bool")
    calls = []
    for entry, d in derived or _derived():
        args = _inputs(d)
        name = f"surrogate_{P.upper_name(entry.name).lower()}"
        reads_p = any(line.count("p.") for line in [c(d.s), c(d.ds)] + [c(v) for _, v in d.locals])
        params = ", ".join([f"{types.get(a, 'T')} {a}" for a in args]
                           + ["const TokenLossParams<T>& " + ("p" if reads_p else "/*p*/")])
        lines += ["", *_wrap(entry.doc, "", "// "), "template <typename T>",
                  f"RLK_HOST_DEVICE inline Surrogate<T> {name}({params}) {{"]
        for local, value in d.locals:
            kind = "bool" if is_boolean(value) else "T"
            lines.append(f"  const {kind} {local} = {c(value)};")
        lines += [f"  const T s = {c(d.s)};", f"  const T ds = {c(d.ds)};",
                  f"  return {{s, ds, {c(d.flag_low)}, {c(d.flag_high)}}};", "}"]
        calls.append((f"k{''.join(p.capitalize() for p in P.upper_name(entry.name).lower().split('_'))}", name, args))
    lines += ["", "// The surrogate of objective p.objective.", "template <typename T>",
              "RLK_HOST_DEVICE inline Surrogate<T> surrogate(T logp, T old_logp, T adv, T w, T d, T chosen, "
              "bool r_passes,", "                                           const TokenLossParams<T>& p) {",
              "  switch (p.objective) {"]
    for constant, name, args in calls[:-1]:
        lines += [f"    case {constant}:", f"      return {name}({', '.join(args + ['p'])});"]
    constant, name, args = calls[-1]
    lines += [f"    default:  // {constant}", f"      return {name}({', '.join(args + ['p'])});", "  }", "}", "",
              "}  // namespace rlk"]
    return "\n".join(lines) + "\n"


class TorchPrinter(Printer):
    """The spec: the value in PyTorch, which autograd differentiates (sg: detach). `numbers`: the locals that are
    Python numbers (of the parameters alone, as lo and hi)."""
    cpp = False
    numbers: set = set()
    where_precedence = 7
    inputs = dict(logp="b.logp", old_logp="b.old_logp", adv="b.adv", d="b.logp - b.old_logp")
    names = dict(exp="torch.exp", log="torch.log", abs="torch.abs", sigmoid="torch.sigmoid", clamp="torch.clamp",
                 minimum="_minimum", maximum="_maximum")

    def _print(self, e):
        if isinstance(e, sp.Symbol) and e.name in self.inputs:
            return self.inputs[e.name], 4 if e.name == "d" else 7
        if isinstance(e, sg):
            return f"{self(e.args[0], 7)}.detach()", 7
        if isinstance(e, sp.Piecewise) and len(e.args) == 2 and not any(self._tensor(v) for v, _ in e.args):
            # two numbers: torch.where would make a float32 tensor of them, the first as w's dtype keeps fp64
            (a, cond), (b, _) = e.args
            return self.where(self(cond, 1), f"w.new_tensor({self(a)})", self(b)), self.where_precedence
        return super()._print(e)

    def _tensor(self, e) -> bool:
        """e reads an input or a formula's local (else it is a number of the parameters)."""
        return any(s.name not in self.params | self.numbers | set(CONSTANTS) for s in e.free_symbols)

    def param(self, name):
        return f"_param(cfg, {name!r})"

    def boolean(self, value):
        return "True" if value else "False"

    def number(self, x):
        return repr(x)

    def where(self, c, a, b):
        return f"torch.where({c}, {a}, {b})"

    def both(self, a, b):
        return f"({a}) & ({b})"

    def mask(self, c):
        return f"({c}).to(w.dtype)"

    def call(self, name, *args):
        return f"{self.names[name]}({', '.join(self(a) for a in args)})"


TORCH_FILE = ("rlkernels", "losses", "token_formulas.py")


def render_torch() -> str:
    """The spec of each objective the kernels evaluate, from the same formula (sg kept: autograd differentiates)."""
    t = TorchPrinter()
    lines = ['"""' + GENERATED, "",
             "Each objective's surrogate `f(w, b, cfg) -> Surrogate` at the importance weight w (B, T), its value",
             "from the table's formula; autograd gives its derivative. This is the spec of every objective of the",
             "table: objectives.py declares them with these, at each ratio they take. Clip-Cov's and KL-Cov's also",
             "take `chosen` (B, T), the outcome of their covariance choice over the whole batch, which no per-token",
             "formula can make (surrogates.py makes it).", '"""',
             "import math", "", "import torch", "", "from .batch import Batch, Surrogate",
             "", "", "def _param(cfg, name):",
             '    """The parameter\'s config field; None (no bound) is +inf, as the kernels have it."""',
             "    value = getattr(cfg, name)", "    return math.inf if value is None else value", "", "",
             "def _minimum(a, b):", "    return torch.minimum(*_tensors(a, b))", "", "",
             "def _maximum(a, b):", "    return torch.maximum(*_tensors(a, b))", "", "",
             "def _tensors(a, b):", '    """a number as a tensor of the other\'s dtype and device."""',
             "    like = a if torch.is_tensor(a) else b",
             "    return [x if torch.is_tensor(x) else torch.full_like(like, x) for x in (a, b)]", "", "",
             "def _none(b: Batch) -> torch.Tensor:", "    return torch.zeros_like(b.mask)"]
    for entry in sorted(P.OBJECTIVES, key=lambda e: e.id):
        lines_ = parse(entry.formula)
        chosen = ", chosen" if any("chosen" in {a.name for a in v.free_symbols} for _, v in lines_) else ""
        t.numbers = set()
        for name, value in lines_:
            if not is_boolean(value) and not t._tensor(value):
                t.numbers.add(name.name)
        lines += ["", "", f"def {entry.name}(w, b: Batch, cfg{chosen}) -> Surrogate:", *_wrap(entry.doc, "    ", "# ")]
        values = dict((n.name, v) for n, v in lines_)
        for name, value in lines_:
            if name.name not in ("flag_low", "flag_high"):
                lines.append(f"    {name.name} = {t(value)}")
        flags = [t(values[f]) if f in values else "_none(b)" for f in ("flag_low", "flag_high")]
        lines.append(f"    return Surrogate(s, w.detach(), {', '.join(flags)})")
    return "\n".join(lines) + "\n"
