"""The kernel contract of `token_logprobs_fwd` / `token_logprobs_bwd` (rlkernels/kernels/__init__.py)
on every backend that runs here, against rlkernels.reference.

The kernels are called directly (rlkernels.kernels.<backend>), not through ops/, so that a failure
points at a kernel. BACKENDS says, per backend, where it runs, which dtypes it takes (fp64 only
where it does), the error bounds it is held to and the shapes it is tested at: `cpu` (the compiled
extension; skipped when `_C` is not built), `torch` (chunked pure PyTorch), `triton` (on CUDA
tensors, or on CPU tensors in the Triton interpreter, which is slow, so its shapes are tiny) and
`cuda` (marked `gpu`: skipped without a CUDA device or a CUDA build; run by
benchmarks/gpu_check.sh). Case builders, references and bounds: kernel_cases.py.

Under the interpreter the Triton kernels compute with numpy: RuntimeWarnings are errors for the
triton cases, so an intermediate 0·(−inf) or (−inf) − (−inf) fails a test even where a `tl.where`
would hide the NaN it makes. The checks that only some backends have (their own argument checks,
Triton's fp32 `out` and launch table, the `gpu` tests at real sizes, cuda through ops/) follow the
contract's.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from typing import Any, Tuple

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton: @triton.jit picks the interpreter at decoration.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from rlkernels.kernels import OPS, Kernels, cpu, cuda, torch_chunked  # noqa: E402

from kernel_cases import (  # noqa: E402
    BAD_INPUTS, BAD_OUT, CUDA_SHAPES, DTYPE_IDS, DTYPES, NAN_ROWS, SHAPES, TOL_REL, TRITON_SHAPES, ULP, VALID_ROWS,
    BadArgs, ExactBounds, RelativeBounds, _close_grad, _inputs, _reference, assert_close_rel, assert_grad_close,
    assert_rounded, bad_out_case, bwd_fp32, case_inputs, contract_case, grid_logits, minus_inf_case, misaligned,
    nan_rows_case,
)

try:
    from rlkernels.kernels import triton as tk  # noqa: E402
except ImportError as e:  # triton not installed
    tk, _TRITON_OK, _TRITON_REASON = None, False, f"triton is not importable ({e})"
else:
    _TRITON_OK, _TRITON_REASON = tk.available()  # False on CPU when triton was imported before TRITON_INTERPRET=1

ON_CUDA = torch.cuda.is_available()
FP64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    kernels: Any  # the module with token_logprobs_fwd / token_logprobs_bwd
    device: str
    available: Tuple[bool, str]
    dtypes: tuple  # the logits dtypes it takes; fp64 only where it does
    bounds: Any  # kernel_cases.ExactBounds or RelativeBounds
    fwd_cases: tuple  # (shape, dtype, temperature)
    bwd_cases: tuple  # (shape, dtype, temperature, with_entropy_grad)
    out_cases: tuple = ()  # (shape, dtype) of the out= / in-place test
    edge_vocab: int = 2500  # V of the −inf and NaN-row cases
    edge_lead: int = 2100  # −inf at the start of a row: more than one block (2048 elements on the CPU)
    edge_dtypes: tuple = tuple(DTYPES)  # of the −inf case
    nan_dtypes: tuple = tuple(DTYPES)  # of the NaN-row case
    no_entropy_vocabs: tuple = ()  # V where the forward test also runs without entropy; () = every V
    refuses: frozenset = frozenset()  # BAD_INPUTS it raises on (the others are ops/'s to check)
    refuses_out: tuple = ()  # BAD_OUT buffers it raises on
    errors: Any = RuntimeError  # what it raises on BAD_INPUTS (an exception type or a tuple of them)
    errors_of: tuple = ()  # (BAD_INPUTS id, exception type) where that differs from `errors`
    out_error: Any = RuntimeError  # what it raises on BAD_OUT buffers
    misaligned: bool = True  # also on logits / out whose first element is not 16-byte aligned
    exact_shift: bool = True  # logits + 100 (exact) gives bitwise the same logp, H and gradient
    strided_rows: bool = False  # takes logits whose rows are strided (row stride > V)
    nan_for_bad_targets: bool = False  # logp NaN for a target outside [0, V) instead of an error
    marks: tuple = ()

    def to(self, *tensors):
        return [None if t is None else t.to(self.device) for t in tensors]


def _grid(shapes, dtypes, temperatures):
    return tuple((s, d, t) for s in shapes for d in dtypes for t in temperatures)


# All but the cpu's out-of-range targets (a GPU backend does not read target values on the host:
# its logp is NaN), and the fp64 logits that cpu and torch take.
_C_REFUSES = frozenset(BAD_INPUTS) - {"targets-out-of-range", "targets-on-cpu", "logits-fp64"}
_C_TYPE_ERRORS = (("logits-int64", TypeError), ("targets-float", TypeError))  # a dtype (docs/design.md §8)
_FULL_FWD = _grid(SHAPES, DTYPES, [1.0, 0.7])
_FULL_BWD = tuple((s, d, 0.8, h) for s in SHAPES for d in DTYPES for h in (True, False))
_OUT = tuple((s, d) for s in SHAPES[:4] for d in DTYPES)
# Triton: each dtype with temperature ≠ 1, and fp32 also at 1 (the interpreter is slow: not a full grid).
_TRITON_DT = [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7), (torch.float16, 1.3)]

BACKENDS = [
    Backend("cpu", cpu, "cpu", cpu.available(), (*DTYPES, FP64), ExactBounds,
            fwd_cases=_FULL_FWD, bwd_cases=_FULL_BWD, out_cases=_OUT,
            refuses=_C_REFUSES | {"targets-out-of-range"}, refuses_out=tuple(BAD_OUT), errors=ValueError,
            errors_of=_C_TYPE_ERRORS, out_error=ValueError),
    # Pure PyTorch: no code that depends on alignment; the rows may be strided; no argument checks
    # (ops/ validates the inputs).
    Backend("torch", torch_chunked, "cpu", torch_chunked.available(), (*DTYPES, FP64), ExactBounds,
            fwd_cases=_FULL_FWD, bwd_cases=_FULL_BWD, out_cases=_OUT, misaligned=False, strided_rows=True),
    Backend("triton", tk, "cpu" if not ON_CUDA else "cuda", (_TRITON_OK, _TRITON_REASON), tuple(DTYPES),
            RelativeBounds,
            fwd_cases=tuple((s, d, t) for s in TRITON_SHAPES for d, t in _TRITON_DT),
            bwd_cases=tuple((s, d, t, True) for s in TRITON_SHAPES for d, t in _TRITON_DT)
            + (((3, 1000), torch.float32, 0.7, False), ((3, 1000), torch.bfloat16, 0.7, False)),
            # V = 1000: two interpreter tiles of 512, the first one all −inf in the −inf case.
            edge_vocab=1000, edge_lead=600, edge_dtypes=(torch.float32, torch.bfloat16), nan_dtypes=(torch.float32,),
            no_entropy_vocabs=(1000,),
            refuses=frozenset({"logits-int64", "logits-4d", "logits-transposed", "logits-fp64", "targets-short",
                               "lse_parts-short", "lse_parts-logsumexp", "grad_logp-short", "grad_entropy-short",
                               "entropy-empty", "logits-half-transposed"}),
            refuses_out=("shape", "stride"), errors=ValueError,
            errors_of=(("logits-int64", TypeError), ("logits-fp64", TypeError)), out_error=ValueError,
            # Rows aligned or not, out= aligned like them (16-byte vectors) or not (element by element).
            out_cases=tuple((s, d) for s in [(9, 7), (5, 1029)] for d in DTYPES),
            exact_shift=False, strided_rows=True, nan_for_bad_targets=True,
            marks=(pytest.mark.filterwarnings("error::RuntimeWarning"),)),
    Backend("cuda", cuda, "cuda", cuda.available(), tuple(DTYPES), ExactBounds,
            fwd_cases=_grid(CUDA_SHAPES, DTYPES, [1.0, 0.7]),
            bwd_cases=tuple((s, d, 0.8, h) for s in CUDA_SHAPES for d in DTYPES for h in (True, False)),
            out_cases=tuple((s, d) for s in [(9, 7), (13, 4099), (4, 32769)] for d in DTYPES),
            refuses=_C_REFUSES | {"targets-on-cpu", "logits-fp64"}, refuses_out=tuple(BAD_OUT), errors=ValueError,
            errors_of=_C_TYPE_ERRORS + (("logits-fp64", TypeError),), out_error=ValueError, nan_for_bad_targets=True,
            marks=(pytest.mark.gpu,)),
]
_BY_NAME = {b.name: b for b in BACKENDS}


def _shape_id(shape):
    return f"{shape[0]}x{shape[1]}"


def _params(cases_of, ident=lambda *case: "-".join(map(str, case)), backends=BACKENDS):
    """pytest params (backend, *case) for every backend and each of its cases, `cases_of(backend)`."""
    params = []
    for b in backends:
        marks = [*b.marks, pytest.mark.skipif(not b.available[0], reason=b.available[1])]
        for case in cases_of(b):
            case = case if isinstance(case, tuple) else (case,)
            params.append(pytest.param(b, *case, id="-".join([b.name, *filter(None, [ident(*case)])]), marks=marks))
    return params


def _dt(dtype):
    return DTYPE_IDS[dtype]


_forwards = {}


def _forward(backend, shape, dtype, temperature, need_entropy):
    """(logits, targets, the forward's (logp, entropy, lse_parts)) of `backend` on case_inputs(shape,
    dtype, temperature), on its device: run once per backend and case, so the forward test and the
    backward test of a case share it (the kernels are deterministic, and a launch in the Triton
    interpreter takes 0.03-0.2 s)."""
    key = (backend.name, shape, dtype, temperature, need_entropy)
    if key not in _forwards:
        logits, targets, _, _ = case_inputs(shape, dtype, temperature)
        z, y = backend.to(logits, targets)
        _forwards[key] = z, y, backend.kernels.token_logprobs_fwd(z, y, temperature, need_entropy)
    return _forwards[key]


# ---------------------------------------------------------------------------------------------
# The contract, on every backend.

@pytest.mark.parametrize("backend,shape,dtype,temperature",
                         _params(lambda b: b.fwd_cases, lambda s, d, t: f"{_shape_id(s)}-{_dt(d)}-t{t}"))
def test_forward_matches_reference(backend, shape, dtype, temperature):
    ref, fwd = contract_case(shape, dtype, temperature).ref, backend.kernels.token_logprobs_fwd
    z, y, outputs = _forward(backend, shape, dtype, temperature, True)
    runs = [(z, outputs)]
    if backend.misaligned:
        runs.append((misaligned(z), None))
    for z, outputs in runs:
        logp, entropy, lse_parts = outputs or fwd(z, y, temperature, True)
        assert logp.dtype == entropy.dtype == lse_parts.dtype == torch.float32 and lse_parts.shape == (shape[0], 2)
        assert logp.device == z.device
        backend.bounds.outputs(logp, ref.logp, dtype)
        backend.bounds.outputs(entropy, ref.entropy, dtype)
        backend.bounds.outputs(lse_parts, ref.lse_parts, dtype)
        assert (logp <= 0).all() and (entropy >= 0).all() and (lse_parts[:, 1] >= 0).all()

        # Without the entropy, int32 targets: the entropy sums do not touch (m, log s).
        if backend.no_entropy_vocabs and shape[1] not in backend.no_entropy_vocabs:
            continue
        logp2, entropy2, lse_parts2 = fwd(z, y.int(), temperature, False)
        assert entropy2.numel() == 0
        torch.testing.assert_close(logp2, logp, rtol=0, atol=0)
        torch.testing.assert_close(lse_parts2, lse_parts, rtol=0, atol=0)


@pytest.mark.parametrize("backend,shape,dtype,temperature,with_entropy_grad",
                         _params(lambda b: b.bwd_cases,
                                 lambda s, d, t, h: f"{_shape_id(s)}-{_dt(d)}-t{t}-{'gh' if h else 'g'}"))
def test_backward_matches_autograd(backend, shape, dtype, temperature, with_entropy_grad):
    """With grad_entropy=None the entropy term is absent and `entropy` (empty) is not read."""
    case = contract_case(shape, dtype, temperature, True, with_entropy_grad)
    z, y, (_, entropy, lse_parts) = _forward(backend, shape, dtype, temperature, with_entropy_grad)
    g, h = backend.to(case.grad_logp, case.grad_entropy)
    backend.bounds.grads(backend.kernels, z, y, lse_parts, entropy, g, h, temperature, case.ref)


@pytest.mark.parametrize("backend,shape,dtype", _params(lambda b: b.out_cases,
                                                        lambda s, d: f"{_shape_id(s)}-{_dt(d)}"))
def test_backward_out_and_in_place(backend, shape, dtype):
    """`out=` gives bitwise the allocating backward's result: into a row-strided buffer (rows aligned
    differently from the logits': the element-by-element path), and into the logits themselves (every
    element, the target's included, is read before it is written), aligned or not."""
    logits, targets = _inputs(*shape, dtype)
    targets[0] = shape[1] - 1  # targets at both ends of a row: the tail step and the first step
    targets[-1] = 0
    z, y, g, h = backend.to(logits, targets, torch.randn(shape[0]), torch.randn(shape[0]))
    bwd = backend.kernels.token_logprobs_bwd
    logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(z, y, 0.8, True)
    expected = bwd(z, y, lse_parts, entropy, g, h, 0.8)

    wide = torch.full((shape[0], shape[1] + 3), 7.0, dtype=dtype, device=backend.device)
    out = wide[:, 1:-2]  # row stride V + 3, unit stride over V
    assert bwd(z, y, lse_parts, entropy, g, h, 0.8, out=out) is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert (wide[:, 0] == 7).all() and (wide[:, -2:] == 7).all()  # nothing written outside `out`

    for buffer in [z.clone()] + ([misaligned(z)] if backend.misaligned else []):
        assert bwd(buffer, y, lse_parts, entropy, g, h, 0.8, out=buffer) is buffer
        torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend,case", _params(lambda b: b.refuses_out, str))
def test_backward_out_rejects_bad_buffers(backend, case):
    logits, out = bad_out_case(case, backend.device)
    # The backward's row inputs as the forward gives them (their values are not read before the checks).
    targets, lse_parts, entropy, g = backend.to(torch.randint(0, 100, (4,)), torch.zeros(4, 2), torch.zeros(4),
                                                torch.randn(4))
    error = TypeError if case in ("bf16", "fp16") else backend.out_error  # a dtype (docs/design.md §8)
    with pytest.raises(error, match="out:"):
        backend.kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, None, 1.0, out=out)


@pytest.mark.parametrize("backend", _params(lambda b: [()] if b.exact_shift else []))
def test_shift_by_100_changes_nothing(backend):
    # Logits on a 1/64 grid, so that z + 100 is exact in fp32 and only the kernel can differ.
    n, vocab = 17, 3001
    logits = grid_logits(n, vocab)
    targets = torch.randint(0, vocab, (n,))
    g, h = torch.randn(n), torch.randn(n)
    z, y, gd, hd = backend.to(logits, targets, g, h)
    fwd, bwd = backend.kernels.token_logprobs_fwd, backend.kernels.token_logprobs_bwd
    logp, entropy, parts = fwd(z, y, 1.0, True)
    logp_s, entropy_s, parts_s = fwd(z + 100, y, 1.0, True)
    # x − m is the same exact number in both, so are the sums: logp, entropy and log s are bitwise
    # equal, and m moves by exactly 100.
    torch.testing.assert_close(logp_s, logp, rtol=0, atol=0)
    torch.testing.assert_close(entropy_s, entropy, rtol=0, atol=0)
    torch.testing.assert_close(parts_s - torch.tensor([100.0, 0.0], device=backend.device), parts, rtol=0, atol=0)
    grad = bwd(z, y, parts, entropy, gd, hd, 1.0)
    grad_s = bwd(z + 100, y, parts_s, entropy_s, gd, hd, 1.0)
    torch.testing.assert_close(grad_s, grad, rtol=0, atol=0)
    _close_grad(grad_s.cpu(), _reference(logits, targets, 1.0, g, h))


def check_shift_invariance(backend):
    # +100 moves every logit; with the state kept relative to the max, logp, H and the gradient
    # move only by the rounding of the shifted inputs.
    logits, targets = _inputs(4, 1000, torch.float32)
    targets[0], targets[-1] = 0, 999
    g, h = torch.randn(4), torch.randn(4)
    z, y, gd, hd = backend.to(logits, targets, g, h)
    shifted = z + 100
    outs = [backend.kernels.token_logprobs_fwd(x, y, 0.7, True) for x in (z, shifted)]
    grads = [backend.kernels.token_logprobs_bwd(x, y, lse_parts, entropy, gd, hd, 0.7)
             for x, (_, entropy, lse_parts) in zip((z, shifted), outs)]
    ref = _reference(shifted.cpu(), targets, 0.7, g, h)
    assert_close_rel(outs[1][0].cpu(), ref.logp, 1e-5)
    assert_close_rel(outs[1][1].cpu(), ref.entropy, 1e-5)
    assert_grad_close(grads[1].cpu(), ref.grad, 1e-5)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=1e-4)
    torch.testing.assert_close(outs[1][2][:, 0], outs[0][2][:, 0] + 100, rtol=1e-6, atol=0)  # m, raw
    torch.testing.assert_close(outs[1][2][:, 1], outs[0][2][:, 1], rtol=0, atol=1e-4)  # log s
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", _params(lambda b: [()]))
def test_shift_invariance(backend):
    check_shift_invariance(backend)


def check_minus_inf_logits(backend, dtype):
    """Masked vocabulary entries (−inf) contribute nothing and make no NaN; a row with only its
    target is valid."""
    temperature = 0.9
    logits, targets, masked = minus_inf_case(backend.edge_vocab, dtype, backend.edge_lead)
    n = logits.shape[0]
    g, h = torch.randn(n), torch.randn(n)
    z, y, gd, hd = backend.to(logits, targets, g, h)
    logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(z, y, temperature, True)
    # The reference computes 0·(−inf) = NaN for the entropy, so it sees a finite stand-in whose
    # exp underflows to exactly 0: the same mathematical input.
    ref = _reference(logits.double().masked_fill(masked, -1e4), targets, temperature, g, h)
    for t in (logp, entropy, lse_parts):
        assert not t.isnan().any()
    backend.bounds.outputs(logp, ref.logp, dtype)
    backend.bounds.outputs(logp, _reference(logits, targets, temperature).logp, dtype)  # the −inf themselves
    backend.bounds.outputs(entropy, ref.entropy, dtype)
    backend.bounds.outputs(lse_parts, ref.lse_parts, dtype)
    grads = backend.bounds.grads(backend.kernels, z, y, lse_parts, entropy, gd, hd, temperature, ref)
    for grad in grads:
        grad = grad.cpu()
        assert not grad.isnan().any()
        assert (grad[masked] == 0).all()
        assert (grad[2] == 0).all()
    assert logp[2] == 0 and entropy[2] == 0


@pytest.mark.parametrize("backend,dtype", _params(lambda b: b.edge_dtypes, _dt))
def test_minus_inf_logits(backend, dtype):
    check_minus_inf_logits(backend, dtype)


@pytest.mark.parametrize("backend,dtype", _params(lambda b: b.nan_dtypes, _dt))
def test_nan_or_inf_logit_gives_a_nan_row(backend, dtype):
    """A NaN or +inf logit, or a row of −inf, makes its row NaN (as log_softmax does); the other
    rows are unaffected. (The interpreter's numpy warns on the NaN it makes: not an error here.)"""
    logits, targets = nan_rows_case(backend.edge_vocab, dtype)
    z, y, g = backend.to(logits, targets, torch.randn(logits.shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for need_entropy in (True, False):
            logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(z, y, 0.9, need_entropy)
            # log s of the all −inf row (the last of NAN_ROWS) may be −inf or NaN: only its logp and H are NaN.
            assert logp[NAN_ROWS].isnan().all() and lse_parts[NAN_ROWS[:-1], 1].isnan().all()
            assert logp[VALID_ROWS].isfinite().all() and lse_parts[VALID_ROWS].isfinite().all()
            if need_entropy:
                assert entropy[NAN_ROWS].isnan().all() and entropy[VALID_ROWS].isfinite().all()
        grad = backend.kernels.token_logprobs_bwd(z, y, lse_parts, entropy, g, None, 0.9)
    assert grad[NAN_ROWS].isnan().all() and grad[VALID_ROWS].isfinite().all()


@pytest.mark.parametrize("backend,vocab", _params(lambda b: [7, 11], lambda v: f"V{v}"))
def test_empty_batch(backend, vocab):
    logits = torch.randn(0, vocab, device=backend.device)
    targets = torch.zeros(0, dtype=torch.long, device=backend.device)
    logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(logits, targets, 1.0, True)
    assert logp.shape == entropy.shape == (0,) and lse_parts.shape == (0, 2)
    grad = backend.kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, logp, entropy, 1.0)
    assert grad.shape == (0, vocab)


@pytest.mark.parametrize("backend,case", _params(lambda b: [c for c in BAD_INPUTS if c in b.refuses], str))
def test_bad_inputs_name_the_argument(backend, case):
    logits, targets = _inputs(4, 10, torch.float32)
    # The backward's row inputs as the forward gives them (their values are not read before the checks).
    lse_parts, entropy = torch.zeros(4, 2), torch.zeros(4)
    name, which, args = BAD_INPUTS[case]
    args = args(BadArgs(*backend.to(logits, targets, lse_parts, entropy, torch.randn(4)), backend.device))
    with pytest.raises(dict(backend.errors_of).get(case, backend.errors), match=f"{name}:"):
        if which == "fwd":
            backend.kernels.token_logprobs_fwd(*args, True)
        else:
            backend.kernels.token_logprobs_bwd(*args, 1.0)


@pytest.mark.parametrize("backend", _params(lambda b: [()]))
def test_backend_is_a_kernels(backend):
    """The module meets `kernels.Kernels`: `supports` answers for every op, and each op it has takes the
    Protocol's parameters by the same names (Triton adds a keyword-only `wrap` for torch.compile)."""
    for op in OPS:
        reason = backend.kernels.supports(op)
        if reason is None:
            want = list(inspect.signature(getattr(Kernels, op)).parameters)[1:]
            have = inspect.signature(getattr(backend.kernels, op)).parameters.values()
            assert [p.name for p in have if p.kind is not p.KEYWORD_ONLY] == want, op
            assert all(p.default is not p.empty for p in have if p.kind is p.KEYWORD_ONLY), op
        else:
            assert isinstance(reason, str) and reason, op
    with pytest.raises(ValueError, match="no kernel op"):
        backend.kernels.supports("token_logprobs")


@pytest.mark.parametrize("backend", _params(lambda b: [()] if b.nan_for_bad_targets else []))
def test_target_outside_the_row_gives_nan(backend):
    """GPU backends do not read target values on the host (that would synchronise): a target outside
    [0, V) gives its row a NaN logp, not a neighbouring logit (the cpu raises: see the bad inputs)."""
    logits = torch.randn(4, 100)
    z, y = backend.to(logits, torch.tensor([-1, 100, 5000, 3]))
    logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(z, y, 1.0, True)
    assert logp[:3].isnan().all() and logp[3].isfinite()
    assert entropy.isfinite().all() and lse_parts.isfinite().all()


@pytest.mark.parametrize("backend", _params(lambda b: [()] if b.strided_rows else []))
def test_strided_rows_int32_targets_and_in_place(backend):
    # Rows of a wider buffer (row stride 1100 > V), int32 targets, gradient written over the
    # logits themselves.
    wide = torch.randn(3, 1100, device=backend.device)
    logits = wide[:, :1000]
    targets = torch.randint(0, 1000, (3,), device=backend.device, dtype=torch.int32)
    g, h = torch.randn(3), torch.randn(3)
    gd, hd = backend.to(g, h)
    logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(logits, targets, 1.0, True)
    ref = _reference(logits.cpu(), targets.long().cpu(), 1.0, g, h)
    assert_close_rel(logp.cpu(), ref.logp, 1e-5)
    assert_close_rel(entropy.cpu(), ref.entropy, 1e-5)
    tail = wide[:, 1000:].clone()
    out = backend.kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, gd, hd, 1.0, out=logits)
    assert out.data_ptr() == logits.data_ptr()
    assert_grad_close(logits.cpu(), ref.grad, 1e-5)
    assert torch.equal(wide[:, 1000:], tail)  # the padding past V is untouched


@pytest.mark.parametrize("backend,dtype", _params(lambda b: [(d,) for d in (torch.float32, torch.bfloat16)], _dt))
def test_batch_strided_view_in_one_call(backend, dtype):
    """logits[:, :-1] of a (B, T + 1, V) parent, read where it lies in one call (a batch stride beside the row
    stride, issue 30): the forward gives the reference's values of its rows, and the backward gives the gradient of
    the same rows copied contiguous, into a new buffer of the view's shape, into the same box of a parent-shaped
    buffer (each sequence's last position left as it was) and into a (T, B, V) buffer seen as (B, T, V). V odd:
    the rows are aligned differently in turn."""
    B, T, V = 3, 4, 37
    parent, _ = _inputs(B * (T + 1), V, dtype)
    targets = torch.randint(0, V, (B * T,), generator=torch.Generator().manual_seed(3))
    g, h = torch.randn(B * T), torch.randn(B * T)
    z, y, gd, hd = backend.to(parent.view(B, T + 1, V), targets, g, h)
    view = z[:, :-1]
    logp, entropy, lse_parts = backend.kernels.token_logprobs_fwd(view, y, 0.8, True)
    ref = _reference(parent.view(B, T + 1, V)[:, :-1].reshape(-1, V), targets, 0.8)
    for actual, expected in ((logp, ref.logp), (entropy, ref.entropy), (lse_parts, ref.lse_parts)):
        assert actual.shape == expected.shape
        backend.bounds.outputs(actual, expected, dtype)

    bwd = backend.kernels.token_logprobs_bwd
    copy = view.reshape(-1, V).contiguous()
    expected = bwd(copy, y, lse_parts, entropy, gd, hd, 0.8).view(B, T, V).cpu().double()
    tol = dict(rtol=2 * ULP[dtype], atol=1e-6 * expected.abs().max().item())
    grad = bwd(view, y, lse_parts, entropy, gd, hd, 0.8)
    assert grad.shape == (B, T, V)
    torch.testing.assert_close(grad.cpu().double(), expected, **tol)
    boxed = torch.full((B, T + 1, V), 7.0, dtype=dtype, device=backend.device)
    assert bwd(view, y, lse_parts, entropy, gd, hd, 0.8, out=boxed[:, :-1]).data_ptr() == boxed.data_ptr()
    torch.testing.assert_close(boxed[:, :-1].cpu().double(), expected, **tol)
    assert (boxed[:, -1] == 7).all()
    transposed = torch.empty(T, B, V, dtype=dtype, device=backend.device).transpose(0, 1)
    bwd(view, y, lse_parts, entropy, gd, hd, 0.8, out=transposed)
    torch.testing.assert_close(transposed.cpu().double(), expected, **tol)


# fp64 logits, where the backend takes them.
_FP64 = [b for b in BACKENDS if FP64 in b.dtypes]


class _TokenLogprobs(torch.autograd.Function):
    """The kernels joined by hand, only to let gradcheck see them (ops/ does it for real)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, kernels):
        logp, entropy, lse_parts = kernels.token_logprobs_fwd(logits, targets, temperature, True)
        ctx.save_for_backward(logits, targets, lse_parts, entropy)
        ctx.temperature, ctx.kernels = temperature, kernels
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse_parts, entropy = ctx.saved_tensors
        grad = ctx.kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, grad_logp, grad_entropy,
                                              ctx.temperature)
        return grad, None, None, None


@pytest.mark.parametrize("backend,shape", _params(lambda b: [((3, 5),), ((4, 37),)], _shape_id, _FP64))
def test_gradcheck_fp64(backend, shape):
    logits, targets = _inputs(*shape, FP64, scale=1.5)
    z, y = backend.to(logits, targets)
    z.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: _TokenLogprobs.apply(x, y, 0.7, backend.kernels), (z,))


@pytest.mark.parametrize("backend", _params(lambda b: [()], backends=_FP64))
def test_fp64_matches_reference_tightly(backend):
    logits, targets = _inputs(7, 4099, FP64)
    z, y = backend.to(logits, targets)
    logp, entropy, _ = backend.kernels.token_logprobs_fwd(z, y, 1.3, True)
    assert logp.dtype == FP64
    ref = _reference(logits, targets, 1.3)
    torch.testing.assert_close(logp.cpu(), ref.logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy.cpu(), ref.entropy, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Triton only: its launch table, and the contract at real sizes on a GPU (151936 = Qwen2,
# 128256 = Llama 3, 50257 = GPT-2: odd).

TRITON = _BY_NAME["triton"]
_needs_triton = pytest.mark.skipif(tk is None, reason=_TRITON_REASON)
_needs_cuda = pytest.mark.skipif(not (ON_CUDA and _TRITON_OK), reason="needs a CUDA device")


@_needs_triton
def test_triton_row_grids_cover_every_sequence_once(monkeypatch):
    """A (B, T, V) launch is a program per row on a (T, B) grid; past 65535 sequences (the grid's y) it is cut into
    launches that start at `first_batch`, which the kernels add (checked with 2 sequences per launch). (N, V) is one
    sequence of N rows."""
    from rlkernels.kernels.triton import launch
    assert list(launch.row_grids(7 * 3, 7)) == [((7, 3), 0)]
    assert list(launch.row_grids(1000, 1000)) == [((1000, 1), 0)]
    grids = list(launch.row_grids(3 * 140000, 3))
    assert [first for _, first in grids] == [0, 65535, 131070]
    assert sum(y for (x, y), _ in grids) == 140000 and all(x == 3 and y <= 65535 for (x, y), _ in grids)

    parent, _ = _inputs(5 * 4, 37, torch.float32)
    z, y, g = TRITON.to(parent.view(5, 4, 37), torch.randint(0, 37, (15,)), torch.randn(15))
    whole = tk.token_logprobs_fwd(z[:, :-1], y, 1.0, True)
    grad = tk.token_logprobs_bwd(z[:, :-1], y, whole[2], whole[1], g, None, 1.0)
    monkeypatch.setattr(launch, "MAX_BATCHES", 2)
    for got, expected in zip(tk.token_logprobs_fwd(z[:, :-1], y, 1.0, True), whole):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(tk.token_logprobs_bwd(z[:, :-1], y, whole[2], whole[1], g, None, 1.0), grad, rtol=0,
                               atol=0)


@_needs_triton
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_triton_launch_config_table():
    for vocab in [1, 7, 1000, 4096, 4099, 32768, 128256, 151936]:
        for dtype in DTYPES:
            block, warps = tk.launch_config(vocab, dtype, interpret=False)
            assert block & (block - 1) == 0 and warps in (1, 2, 4, 8, 16)
            if vocab <= 4096:
                assert block >= vocab  # the whole row in one tile
            assert block * dtype.itemsize <= 16384  # tiles of at most 16 KB
    assert tk.launch_config(151936, torch.bfloat16, interpret=False) == (8192, 16)
    assert tk.launch_config(151936, torch.float32, interpret=False) == (4096, 8)
    assert tk.launch_config(4099, torch.float32, interpret=True)[0] == 512


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("vocab", [151936, 128256, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_triton_gpu_large_vocab(vocab, dtype):
    logits, targets = _inputs(64, vocab, dtype, scale=4.0)
    targets[0], targets[-1] = 0, vocab - 1
    z, y = logits.cuda(), targets.cuda()
    g, h = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    logp, entropy, lse_parts = tk.token_logprobs_fwd(z, y, 0.7, True)
    ref = _reference(z, y, 0.7, g, h)  # on the device: 64 × 152k in fp64 is slow on a CPU
    assert_close_rel(logp, ref.logp, TOL_REL[dtype])
    assert_close_rel(entropy, ref.entropy, TOL_REL[dtype])
    grad32 = bwd_fp32(tk, z, y, lse_parts, entropy, g, h, 0.7)
    assert_grad_close(grad32, ref.grad, TOL_REL[dtype])
    grad = tk.token_logprobs_bwd(z, y, lse_parts, entropy, g, h, 0.7)
    assert_rounded(grad, grad32)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_triton_gpu_minus_inf_and_shift():
    check_minus_inf_logits(TRITON, torch.bfloat16)
    check_shift_invariance(TRITON)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_triton_gpu_offsets_beyond_int32():
    # N·V > 2^31 elements (4.3 GB of bf16): the last rows need 64-bit offsets.
    vocab, n = 151936, 14200
    assert n * vocab > 2**31
    logits = torch.empty(n, vocab, dtype=torch.bfloat16, device="cuda").normal_(0, 3)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    g, h = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    logp, entropy, lse_parts = tk.token_logprobs_fwd(logits, targets, 1.0, True)
    tail = slice(n - 4, n)
    ref = _reference(logits[tail], targets[tail], 1.0, g[tail], h[tail])
    assert_close_rel(logp[tail], ref.logp, 2e-3)
    assert_close_rel(entropy[tail], ref.entropy, 2e-3)
    # In place, so no second 4 GB; bf16 rounding (≤ half an ulp on CUDA) plus the bf16 tolerance.
    tk.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, 1.0, out=logits)
    atol = 2e-3 * ref.grad.abs().max().item()
    torch.testing.assert_close(logits[tail].double(), ref.grad, rtol=2.0**-8 + 2e-3, atol=atol)


# ---------------------------------------------------------------------------------------------
# cuda only: through ops/.

@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available()[0], reason=cuda.available()[1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_ops_and_fused_loss_in_place(dtype):
    """Through ops/: token_logprobs' gradient and fused_policy_loss(inplace=True) equal the torch backend's."""
    import rlkernels
    from rlkernels import presets

    B, T, V = 4, 9, 3001
    logits = (torch.randn(B, T, V, device="cuda") * 2).to(dtype)
    targets = torch.randint(0, V, (B, T), device="cuda")
    results = {}
    for backend in ("torch", "cuda"):
        x = logits.clone().requires_grad_(True)
        logp, ent = rlkernels.token_logprobs(x, targets, temperature=0.9, return_entropy=True, backend=backend)
        (logp.sum() + 0.1 * ent.sum()).backward()
        results[backend] = (logp, ent, x.grad)
    (logp, ent, grad), (logp_t, ent_t, grad_t) = results["cuda"], results["torch"]
    torch.testing.assert_close(logp, logp_t, rtol=2e-5, atol=2e-5)  # fp32 from the same values
    torch.testing.assert_close(ent, ent_t, rtol=2e-5, atol=2e-5)
    # bf16 gradients: the two fp32 results may round to neighbouring bf16 values (2^-8 apart).
    torch.testing.assert_close(grad, grad_t, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-6)

    adv, mask = torch.randn(B, device="cuda"), torch.ones(B, T, device="cuda")
    y = logits.clone().requires_grad_(True)
    expected = rlkernels.fused_policy_loss(y, targets, adv, mask, presets.dapo(), backend="torch")
    expected.loss.backward()
    buffer = logits.clone()
    x = buffer.view_as(buffer).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, presets.dapo(), inplace=True, backend="cuda")
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-6)
    assert x.grad.data_ptr() == buffer.data_ptr()
