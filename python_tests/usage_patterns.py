"""The usage-pattern suite's two registries (test_usage_patterns.py takes their product).

An op case (`OpCase`) is a public op on one backend and one path: how to draw its differentiable input `x` (logits,
hidden states, log-probs or values), how to call it on `x` (the other arguments fixed per case), its definition in
plain PyTorch (`rlkernels.reference` on a contiguous copy of `x`), and the capabilities that say which patterns apply.
A pattern is a script a user might write around one call. It is run twice on the same values, once with the op and
once with the definition, and what it returns (gradients, values read back, hook counts) must agree; a pattern
that checks a refusal runs the op alone. A new op, backend or path joins by one `register` call; a new pattern by one
`pattern` decoration.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Tuple

import torch

import rlkernels
from rlkernels import presets, reference

B, T, V, H = 2, 3, 37, 8  # V odd: the cpu hidden-state path pads it to 48

Outputs = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class OpCase:
    id: str
    call: Callable[..., Outputs]  # call(x, **kw): every tensor the op returns, by name
    define: Callable[[torch.Tensor], Outputs]  # the definition on x (contiguous copy taken inside)
    sample: Callable[[Tuple[int, ...], torch.Generator], torch.Tensor]  # fresh values of x's kind
    shape: Tuple[int, ...]
    dtype: torch.dtype
    primary: Tuple[str, ...]  # the outputs a plain objective reduces (the loss, or logp and entropy)
    caps: FrozenSet[str]
    tol: Tuple[float, float]  # rtol, atol (atol relative to the largest expected value)
    kw: dict = field(default_factory=dict)  # fixed keywords of the call (backend, two_pass)


OPS: Dict[str, OpCase] = {}


def register(name, *, call, define, sample, shape, primary, caps, backends):
    """One op: `backends` maps a backend to its paths: (path {keyword: value}, e.g. two_pass; caps added[; caps
    taken away, where a case would cost more than it tells]).
    Triton cases run fp32 under the interpreter (it takes no fp64) with fp32 tolerances."""
    for backend, paths in backends.items():
        for path, extra, *without in paths:
            dtype = torch.float32 if backend == "triton" else torch.float64
            tol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-7, 1e-9)
            suffix = "".join(f"-{k}={v}" for k, v in path.items())
            kw = {"backend": backend, **path} if backend else dict(path)
            # The Triton interpreter (no GPU) patches triton.language while a kernel runs: one thread at a time
            # (GPU cases: benchmarks/gpu_check.sh); torch.compile of interpreted kernels: test_compile.py.
            drop = ({"threads", "compile"} if backend == "triton" else set()).union(*without)
            OPS[f"{name}-{backend or 'torch'}{suffix}"] = OpCase(
                f"{name}-{backend or 'torch'}{suffix}", call, define, sample, shape, dtype, primary,
                (frozenset(caps) | frozenset(extra)) - drop, tol, kw)


# ----------------------------------------------------------------------------------------------------------------
# fixed arguments, drawn once

_g = torch.Generator().manual_seed(37)
TARGETS = torch.randint(0, V, (B, T), generator=_g)
ADV = torch.randn(B, generator=_g, dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, True, True]])
OLD = -torch.rand(B, T, generator=_g, dtype=torch.float64) * 3
REF = OLD + 0.3 * torch.randn(B, T, generator=_g, dtype=torch.float64)
WEIGHT = torch.randn(V, H, generator=_g, dtype=torch.float64) / H ** 0.5
OLD_VALUES = torch.randn(B, T, generator=_g, dtype=torch.float64)
RETURNS = torch.randn(B, T, generator=_g, dtype=torch.float64)
CONFIGS = {
    "grpo": presets.get("grpo"),  # token-level: the cpu two-pass path
    # the sequence step, off-policy, with a KL term
    "gspo_token_kl": presets.get("gspo_token", kl_coef=0.05, kl_estimator="k3"),
}
LOSS_ARGS = dict(old_logp=OLD, ref_logp=REF)


def _logits(shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * 2


def _logp(shape, g):
    return -torch.rand(*shape, generator=g, dtype=torch.float64) * 3


def _values(shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _dense(x):
    """The definition's own copy: contiguous, fp64 (differentiable back to x)."""
    return x.contiguous().double()


def _loss_out(out) -> Outputs:
    return {"loss": out.loss, "logp": out.logp, "entropy": out.entropy}


def _ref_policy(logp, entropy, cfg, **args) -> Outputs:
    loss, _ = reference.policy_loss(logp, ADV, MASK, cfg, entropy=entropy, **args)
    return {"loss": loss, "logp": logp, "entropy": entropy}


def _targets(kw):
    return kw.pop("targets", TARGETS)


def _tlp_call(x, **kw):
    logp, entropy = rlkernels.token_logprobs(x, _targets(kw), return_entropy=True, **kw)
    return {"logp": logp, "entropy": entropy}


def _tlp_define(x):
    logp, entropy = reference.token_logprobs(_dense(x), TARGETS)
    return {"logp": logp, "entropy": entropy}


def _head(x):
    return _dense(x) @ WEIGHT.T


def _linear_call(x, **kw):
    logp, entropy = rlkernels.linear_token_logprobs(x, WEIGHT.to(x.dtype), _targets(kw), return_entropy=True, **kw)
    return {"logp": logp, "entropy": entropy}


def _linear_define(x):
    logp, entropy = reference.token_logprobs(_head(x), TARGETS)
    return {"logp": logp, "entropy": entropy}


# no "view_node_hooks": a slice of the logits is read in place and its gradient written into its parent (below)
LOGITS_CAPS = {"views", "logits", "targets", "nonfinite", "threads"}

register("token_logprobs", call=_tlp_call, define=_tlp_define, sample=_logits, shape=(B, T, V),
         primary=("logp", "entropy"), caps=LOGITS_CAPS,
         backends={"cpu": [({}, {"compile"})], "torch": [({}, ())], "triton": [({}, ())]})
register("linear_token_logprobs", call=_linear_call, define=_linear_define, sample=_logits, shape=(B, T, H),
         primary=("logp", "entropy"), caps={"views", "targets", "threads", "view_node_hooks"},
         backends={"cpu": [({}, ())], "torch": [({}, ())]})


def _fused(cfg_name):
    cfg = CONFIGS[cfg_name]

    def call(x, **kw):
        return _loss_out(rlkernels.fused_policy_loss(x, _targets(kw), ADV, MASK, cfg, **LOSS_ARGS, **kw))

    def define(x):
        logp, entropy = reference.token_logprobs(_dense(x), TARGETS)
        return _ref_policy(logp, entropy, cfg, **LOSS_ARGS)

    return call, define


def _fused_linear(cfg_name):
    cfg = CONFIGS[cfg_name]

    def call(x, **kw):
        return _loss_out(rlkernels.fused_linear_policy_loss(x, WEIGHT.to(x.dtype), _targets(kw), ADV, MASK, cfg,
                                                            **LOSS_ARGS, **kw))

    def define(x):
        logp, entropy = reference.token_logprobs(_head(x), TARGETS)
        return _ref_policy(logp, entropy, cfg, **LOSS_ARGS)

    return call, define


_TWO_PASS = {"two_pass", "inplace", "grad_scale"}
for _cfg in CONFIGS:
    _call, _define = _fused(_cfg)
    register(f"fused_policy_loss[{_cfg}]", call=_call, define=_define, sample=_logits, shape=(B, T, V),
             primary=("loss",), caps=LOGITS_CAPS | {"inplace"},
             # two_pass=True with inplace=True overwrites the logits at the call, as documented (test_two_pass.py
             # checks that opt-in); the default path (no two_pass) must keep them until the backward, as 3 passes do
             backends={"cpu": [({"two_pass": True}, (_TWO_PASS - {"inplace"}) | {"compile"}, {"inplace"}),
                               ({"two_pass": False}, ()), ({}, (), LOGITS_CAPS)]
                       if _cfg == "grpo" else [({"two_pass": False}, ())],
                       "torch": [({}, ())],
                       # the interpreter is slow: the views of the sequence-level config on the grpo case only
                       "triton": [({}, (), {"views"} if _cfg != "grpo" else ())]
                       # the split row (test_usage_patterns.py marks its cases slow)
                       + ([({"two_pass": True}, _TWO_PASS - {"inplace"}, {"inplace"})] if _cfg == "grpo" else [])})
    _call, _define = _fused_linear(_cfg)
    register(f"fused_linear_policy_loss[{_cfg}]", call=_call, define=_define, sample=_logits, shape=(B, T, H),
             primary=("loss",), caps={"views", "targets", "threads", "view_node_hooks"}, backends={"cpu": [({}, ())], "torch": [({}, ())]})


def _policy_call(x, **kw):
    out = rlkernels.policy_loss(x, ADV, MASK, CONFIGS["grpo"], **LOSS_ARGS, **kw)
    return {"loss": out.loss}


def _policy_define(x):
    loss, _ = reference.policy_loss(_dense(x), ADV, MASK, CONFIGS["grpo"], **LOSS_ARGS)
    return {"loss": loss}


def _value_call(x, **kw):
    return {"loss": rlkernels.value_loss(x, OLD_VALUES, RETURNS, MASK, **kw).loss}


def _value_define(x):
    return {"loss": reference.value_loss(_dense(x), OLD_VALUES, RETURNS, MASK)[0]}


def _verl_call(x, **kw):
    from rlkernels.integrations import verl

    fn = verl.policy_loss_fn("grpo", **kw)
    loss, _ = fn(OLD, x, ADV[:, None].expand(B, T), MASK.double(), "token-mean", None)
    return {"loss": loss}


def _verl_define(x):
    # verl's "token-mean": the mean over the micro-batch's valid tokens, of GRPO's clipped surrogate (no KL:
    # verl adds it elsewhere)
    cfg = CONFIGS["grpo"].replace(agg="token_mean", kl_coef=0.0)
    loss, _ = reference.policy_loss(_dense(x), ADV, MASK, cfg, old_logp=OLD)
    return {"loss": loss}


_PLAIN = {"": [({}, ())]}
register("policy_loss", call=_policy_call, define=_policy_define, sample=_logp, shape=(B, T), primary=("loss",),
         caps={"views", "threads", "view_node_hooks"}, backends=_PLAIN)
register("value_loss", call=_value_call, define=_value_define, sample=_values, shape=(B, T), primary=("loss",),
         caps={"views", "threads", "view_node_hooks"}, backends=_PLAIN)
register("verl.policy_loss_fn[grpo]", call=_verl_call, define=_verl_define, sample=_logp, shape=(B, T),
         primary=("loss",), caps={"views", "threads", "view_node_hooks"}, backends=_PLAIN)


# ----------------------------------------------------------------------------------------------------------------
# patterns


@dataclass(frozen=True)
class Pattern:
    id: str
    run: Callable  # run(f, case) -> {name: tensor}; f(x, **kw) is the op or the definition
    needs: FrozenSet[str]
    compare: bool = True  # False: run on the op alone (it checks a refusal itself)
    tol: tuple = None  # (rtol, atol) where the pattern sets the dtype; else the op case's


PATTERNS: Dict[str, Pattern] = {}


def pattern(id, needs=(), **flags):
    def deco(fn):
        PATTERNS[id] = Pattern(id, fn, frozenset(needs), **flags)
        return fn
    return deco


def _weights(outs: Outputs, names, seed=0) -> torch.Tensor:
    """Σ_name ⟨out[name], W_name⟩ with fixed random W (the same for the op and the definition)."""
    g = torch.Generator().manual_seed(seed)
    total = 0
    for name in names:
        t = outs[name]
        total = total + (t * (torch.rand(t.shape, generator=g, dtype=torch.float64) + 0.5).to(t.dtype)).sum()
    return total


def objective(case, outs, seed=0):
    return _weights(outs, case.primary, seed)


class _IdentityView(torch.autograd.Function):
    """A custom Function that returns its input as a view (as some wrappers do)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _fresh(case, shape, seed=1):
    return case.sample(shape, torch.Generator().manual_seed(seed)).to(case.dtype).requires_grad_()


def _grow(shape, dim, by):
    return tuple(s + by if d == dim else s for d, s in enumerate(shape))


# view kind: (base shape from x's shape, the view of the base with x's shape)
VIEWS = {
    "leaf": (lambda s: s, lambda b: b),
    "clone": (lambda s: s, lambda b: b * 1),
    "slice": (lambda s: _grow(s, 1, 1), lambda b: b[:, :-1]),
    "select": (lambda s: (2, *s), lambda b: b[1]),
    "narrow_last": (lambda s: _grow(s, len(s) - 1, 3), lambda b: b.narrow(-1, 1, b.shape[-1] - 3)),
    "transpose": (lambda s: (s[1], s[0], *s[2:]), lambda b: b.transpose(0, 1)),
    "expand": (lambda s: (1, *s[1:]), lambda b: b.expand(B, *b.shape[1:])),
    "as_strided": (lambda s: (torch.Size(s).numel() + 5,),
                   None),  # filled below: needs x's shape
    "view_of_view": (lambda s: _grow(_grow(s, 0, 1), 1, 1), lambda b: b[1:][:, :-1]),
    "function_view": (lambda s: _grow(s, 1, 1), lambda b: _IdentityView.apply(b)[:, :-1]),
}


def _as_strided(case):
    shape = case.shape
    strides = torch.empty(shape).stride()
    return lambda b: b.as_strided(shape, strides, 5)


def view_input(case, kind, seed=1):
    """(base leaf, view of it with x's shape) of view kind `kind`."""
    base_shape, view = VIEWS[kind]
    base = _fresh(case, base_shape(case.shape), seed)
    view = _as_strided(case) if kind == "as_strided" else view
    return base, view(base)


def _grads(*ts):
    return {f"grad{i}": (torch.zeros(()) if t.grad is None else t.grad) for i, t in enumerate(ts)}


def _view_pattern(kind):
    def run(f, case):
        base, x = view_input(case, kind)
        objective(case, f(x)).backward()
        return _grads(base)
    return run


for _kind in VIEWS:
    pattern(f"view[{_kind}]", needs={"views"} if _kind not in ("leaf", "clone") else ())(_view_pattern(_kind))


def _counting_double(counter, key):
    def hook(g):
        counter[key] = counter.get(key, 0) + 1
        return g * 2
    return hook


# Hooks on the view x (or its node), registered before or after the call; the base's gradient, the view's retained
# gradient and how often each hook ran must be autograd's.
HOOKS = ("tensor_hook", "retain_grad", "node_prehook", "node_hook")


def _hook_pattern(kind, hook, when):
    def run(f, case):
        base, x = view_input(case, kind)
        counts = {}

        def install():
            if hook == "tensor_hook":
                x.register_hook(_counting_double(counts, "tensor"))
            elif hook == "retain_grad":
                x.retain_grad()
            elif hook == "node_prehook":  # doubles what arrives at the view's node
                x.grad_fn.register_prehook(lambda go: (counts.__setitem__("pre", counts.get("pre", 0) + 1),
                                                       tuple(None if g is None else 2 * g for g in go))[1])
            else:  # a post-hook that only observes
                x.grad_fn.register_hook(lambda gi, go: counts.__setitem__("post", counts.get("post", 0) + 1))

        if when == "before":
            install()
        outs = f(x)
        if when == "after":
            install()
        objective(case, outs).backward()
        result = _grads(base)
        if hook == "retain_grad":
            result["view.grad"] = torch.zeros(()) if x.grad is None else x.grad
        result["hook_calls"] = torch.tensor(float(sum(counts.values())))
        return result
    return run


for _kind in ("slice", "transpose", "function_view", "clone"):
    for _hook in HOOKS:
        for _when in ("before", "after"):
            # Hooks on a slice's own node are invisible from Python (torch has no query for them), so the ops that
            # write a slice's gradient straight into its parent (LOGITS_CAPS) cannot honour them: docs/design.md §4
            node = _kind == "slice" and _hook.startswith("node_")
            pattern(f"hook[{_kind}-{_hook}-{_when}]",
                    needs=({"views"} if _kind != "clone" else set()) | ({"view_node_hooks"} if node else set()))(
                _hook_pattern(_kind, _hook, _when))


def _autograd_grad(kind, wrt):
    def run(f, case):
        base, x = view_input(case, kind)
        inputs = {"view": [x], "base": [base], "both": [x, base]}[wrt]
        gs = torch.autograd.grad(objective(case, f(x)), inputs)
        return {f"d{i}": g for i, g in enumerate(gs)}
    return run


for _kind in ("slice", "clone"):
    for _wrt in ("view", "base", "both"):
        pattern(f"autograd_grad[{_kind}-wrt_{_wrt}]", needs={"views"} if _kind == "slice" else ())(
            _autograd_grad(_kind, _wrt))


def _incoming(how, kind):
    def run(f, case):
        base, x = view_input(case, kind)
        if how == "scaled":
            (objective(case, f(x)) * -3.5).backward()
        elif how == "accumulated":  # two graphs, gradients summed in base.grad
            (objective(case, f(x)) * 0.25).backward()
            objective(case, f(x)).backward()
        elif how == "reused":  # the loss enters the objective twice, non-linearly
            y = objective(case, f(x))
            (y * 2 + y ** 2).backward()
        elif how == "retain_graph":
            y = objective(case, f(x))
            y.backward(retain_graph=True)
            try:
                y.backward()
            except RuntimeError as e:  # a loud refusal of a second backward is allowed (the two-pass path's)
                assert "backward" in str(e), e
                return {"refused": torch.tensor(1.0)}
        return _grads(base)
    return run


for _how in ("scaled", "accumulated", "reused", "retain_graph"):
    for _kind in ("leaf", "slice"):
        pattern(f"incoming[{_how}-{_kind}]", needs={"views"} if _kind == "slice" else ())(_incoming(_how, _kind))


def _extra_terms(kind):
    """Each returned tensor alone (a term on it beside the primary objective), then all together."""
    def run(f, case):
        result = {}
        names = list(f(view_input(case, kind)[1]))
        for name in [*names, "all"]:
            base, x = view_input(case, kind)
            outs = f(x)
            extra = _weights(outs, names if name == "all" else [name], seed=3)
            (objective(case, outs) + 0.7 * extra).backward()
            result[f"with_{name}"] = base.grad
        return result
    return run


for _kind in ("leaf", "slice"):
    pattern(f"extra_terms[{_kind}]", needs={"views"} if _kind == "slice" else ())(_extra_terms(_kind))


@pattern("inplace", needs={"inplace"})
def _inplace(f, case):
    """inplace=True on logits the user computed (a non-leaf): until backward they still hold the logits (what
    argmax, sampling or a later metric reads); the gradient reaching the leaf is autograd's."""
    leaf = _fresh(case, case.shape)
    x = leaf * 1
    try:
        outs = f(x, inplace=True)
    except ValueError as e:
        assert "inplace" in str(e), e
        return {"refused": torch.tensor(1.0)}
    read_before_backward = x.detach().clone()
    objective(case, outs).backward()
    return {"read_before_backward": read_before_backward, "grad": leaf.grad}


def _grad_scale(scale, incoming, dtype=None):
    """`grad_scale` with the incoming gradient `incoming` (equal to it, or 1: the documented scaling pass): the
    gradient per unit of incoming gradient is the definition's, or the argument is refused, naming it."""
    def run(f, case):
        leaf = _fresh(case, case.shape)
        x = leaf if dtype is None else leaf.detach().to(dtype).requires_grad_()
        try:
            outs = f(x, grad_scale=scale)
        except ValueError as e:
            assert "grad_scale" in str(e), e
            return {"refused": torch.tensor(1.0)}
        try:
            (outs["loss"].double() * incoming).backward()
        except RuntimeError as e:  # the incoming gradient is known only here: a loud refusal naming the argument
            assert "grad_scale" in str(e), e
            return {"refused": torch.tensor(1.0)}
        return {"grad_per_incoming": x.grad.double() / incoming}
    return run


# (grad_scale, incoming gradient, logits dtype, tolerance: the rounding of a gradient stored in that dtype)
for _s, _inc, _dt, _tol in ((1e-30, 1e-30, None, None), (1e-30, 1.0, None, None), (1e39, 1.0, None, None),
                            (1e39, 1.0, torch.float32, (1e-5, 1e-6)), (1e-10, 1.0, torch.float16, (2e-3, 2e-3))):
    _name = f"grad_scale[{_s:g}-incoming_{_inc:g}{'' if _dt is None else '-' + str(_dt)[6:]}]"
    pattern(_name, needs={"grad_scale"}, tol=_tol)(_grad_scale(_s, _inc, _dt))


def _no_grad(ctx):
    def run(f, case):
        x = _fresh(case, case.shape)
        with ctx():
            outs = f(x)
        return {**{k: v.detach() for k, v in outs.items()},
                "requires_grad": torch.tensor([float(v.requires_grad) for v in outs.values()])}
    return run


pattern("no_grad")(_no_grad(torch.no_grad))
pattern("inference_mode")(_no_grad(torch.inference_mode))


@pattern("threads", needs={"threads"})
def _threads(f, case):
    """Two threads, each its own input and backward, at once."""
    leaves = [_fresh(case, case.shape, seed) for seed in (1, 2)]
    errors = []

    def work(x):
        try:
            for _ in range(3):
                objective(case, f(x)).backward()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(x,)) for x in leaves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return _grads(*leaves)


@pattern("compile", needs={"compile"})
def _compile(f, case):
    x = _fresh(case, case.shape)
    compiled = torch.compile(lambda y: objective(case, f(y)), backend="eager")
    y = compiled(x)
    y.backward()
    return {"value": y.detach(), **_grads(x)}


def _nonfinite(what):
    """−inf on a token that is not sampled (a banned token), or on a sampled one, or a NaN: the values must be
    the definition's (NaN where it is NaN); the gradient too where every value is finite."""
    def run(f, case):
        x0 = _fresh(case, case.shape).detach()
        if what == "minus_inf_other":
            x0[..., :5] = float("-inf")
            x0.scatter_(-1, TARGETS[..., None], 1.0)
        elif what == "minus_inf_target":
            x0[1, 0, TARGETS[1, 0]] = float("-inf")
        else:
            x0[0, 1, 3] = float("nan")
        x = x0.requires_grad_()
        outs = f(x)
        result = {k: v.detach() for k, v in outs.items()}
        if what == "minus_inf_other":
            objective(case, outs).backward()
            result["grad"] = x.grad
        return result
    return run


for _what in ("minus_inf_other", "minus_inf_target", "nan"):
    pattern(f"nonfinite[{_what}]", needs={"nonfinite"})(_nonfinite(_what))


def _bad_targets(value):
    """A target outside [0, V): refused with a ValueError naming `targets` (never a −inf log-prob, a NaN loss or a
    read past the row)."""
    def run(f, case):
        targets = TARGETS.clone()
        targets[1, 1] = value
        x = _fresh(case, case.shape)
        try:
            outs = f(x, targets=targets)
        except (ValueError, IndexError) as e:
            assert isinstance(e, ValueError) and "targets" in str(e), f"unclear error: {type(e).__name__}: {e}"
            return {}
        raise AssertionError(f"targets={value} accepted (V={V}): {({k: v.detach() for k, v in outs.items()})}")
    return run


for _name, _value in (("negative", -1), ("V", V), ("padding_V+5", V + 5), ("far", 10 * V)):
    pattern(f"bad_targets[{_name}]", needs={"targets"}, compare=False)(_bad_targets(_value))


# ----------------------------------------------------------------------------------------------------------------


def run(case: OpCase, pat: Pattern):
    """Run `pat` with the op of `case`, and (unless it checks a refusal) with its definition; compare."""
    def op(x, **kw):
        return case.call(x, **case.kw, **kw)

    def definition(x, **kw):
        kw.pop("inplace", None), kw.pop("grad_scale", None)
        return case.define(x)

    got = pat.run(op, case)
    if not pat.compare:
        return
    want = pat.run(definition, case)
    if "refused" in got:  # a loud refusal, allowed by the pattern (it checked the message)
        return
    rtol, atol = case.tol
    if pat.tol is not None:
        rtol, atol = pat.tol
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key in want:
        g, w = got[key], want[key]
        scale = max(1.0, float(w.detach().double().abs().nan_to_num(0, 0, 0).max())) if w.numel() else 1.0
        torch.testing.assert_close(g.detach().double(), w.detach().double(), rtol=rtol, atol=atol * scale,
                                   equal_nan=True, msg=lambda m, key=key: f"{key}: {m}")


def cases():
    """(op case, pattern) pairs, with the reason to skip where the op lacks a capability the pattern needs."""
    for op in OPS.values():
        for pat in PATTERNS.values():
            missing = pat.needs - op.caps
            yield op, pat, (f"{op.id} has no {', '.join(sorted(missing))}" if missing else None)
