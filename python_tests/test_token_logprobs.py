"""The public `token_logprobs` on every backend that runs on CPU tensors here, against the reference."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import reference

# The Triton interpreter is slow; its kernels are tested at tiny shapes in test_kernel_contract.py.
BACKENDS = [b for b in ("torch", "cpu") if rlkernels.backend_info()[b]["available"]]
# Relative tolerance on log-probs and gradients (docs/design.md §9): bf16/fp16 are compared with the
# reference evaluated on the same rounded values, upcast.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-3, atol=2e-3),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.float64: dict(rtol=1e-10, atol=1e-10)}
# The gradient is returned in the logits' dtype: rounding it to bf16 alone costs up to half an ulp,
# 2⁻⁸ relative, on top of the 2e-3 of docs/design.md §9.
GRAD_TOL = {**TOL, torch.bfloat16: dict(rtol=2e-3 + 2**-8, atol=2e-3)}


def _inputs(shape, vocab, dtype, scale=3.0):
    logits = (torch.randn(*shape, vocab) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape)
    return logits, targets


def _check(backend, logits, targets, temperature, tol):
    x = logits.clone().requires_grad_(True)
    logp, ent = rlkernels.token_logprobs(x, targets, temperature=temperature, return_entropy=True, backend=backend)
    assert logp.dtype == (torch.float64 if logits.dtype == torch.float64 else torch.float32)
    assert logp.shape == targets.shape and ent.shape == targets.shape
    g_logp, g_ent = torch.randn_like(logp), torch.randn_like(ent)
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), x)

    x_ref = logits.detach().double().requires_grad_(True)  # the same (rounded) values, upcast
    ref_logp, ref_ent = reference.token_logprobs(x_ref, targets, temperature)
    (ref_grad,) = torch.autograd.grad((ref_logp * g_logp.double()).sum() + (ref_ent * g_ent.double()).sum(), x_ref)
    torch.testing.assert_close(logp.double(), ref_logp, **tol)
    torch.testing.assert_close(ent.double(), ref_ent, **tol)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[logits.dtype])
    assert grad.dtype == logits.dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 4099])  # V = 1, tiny odd, medium, just above a power of two
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(backend, dtype, vocab, temperature):
    logits, targets = _inputs((3, 5), vocab, dtype)
    _check(backend, logits, targets, temperature, TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_vocabulary(backend):
    logits, targets = _inputs((3,), 151936, torch.bfloat16)  # Qwen2's vocabulary
    _check(backend, logits, targets, 1.0, TOL[torch.bfloat16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits(backend):
    logits, targets = _inputs((4,), 50, torch.float32)
    logits[:, ::3] = float("-inf")
    targets[:] = 1
    logits[3, :] = float("-inf")
    logits[3, 1] = 2.0  # a row whose only finite entry is the target: log-prob 0, entropy 0
    _check(backend, logits, targets, 1.0, TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_shift_by_100_changes_nothing(backend):
    logits, targets = _inputs((6,), 333, torch.float32)
    a = rlkernels.token_logprobs(logits, targets, return_entropy=True, backend=backend)
    b = rlkernels.token_logprobs(logits + 100, targets, return_entropy=True, backend=backend)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_leading_shapes(backend):
    logits, targets = _inputs((0, 4), 9, torch.float32)
    assert rlkernels.token_logprobs(logits, targets, backend=backend).shape == (0, 4)
    logits, targets = _inputs((2, 3, 2), 9, torch.float32)
    _check(backend, logits, targets, 1.3, TOL[torch.float32])
    # a non-contiguous slice, as in logits[:, :-1]
    logits, targets = _inputs((2, 5), 9, torch.float32)
    _check(backend, logits[:, :-1], targets[:, 1:], 1.0, TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_are_read_in_one_launch_where_their_strides_allow(backend):
    """A view whose leading dims collapse into a batch stride and a row stride (`[:, :, :-1]` of a 4-D parent, as
    `logits[:, :-1]` of a 3-D one) is read by one launch of each kernel (issue 30); one whose dims do not
    (`[:, :-1, :-1]`) by one per index of its first dim. Either gives the reference's values and the gradient
    reaches the parent's box, zero elsewhere."""
    from benchmarks.launches import OpCounter

    parent, targets = _inputs((3, 4, 6), 50, torch.float32)
    for index, launches in (((slice(None), slice(None), slice(0, 5)), 1), ((slice(None), slice(0, 3), slice(0, 5)), 3)):
        leaf = parent.clone().requires_grad_(True)
        y = targets[index]
        with OpCounter() as counter:
            logp, ent = rlkernels.token_logprobs(leaf[index], y, return_entropy=True, backend=backend)
            (logp.sum() - 0.5 * ent.sum()).backward()
        x_ref = parent[index].double().requires_grad_(True)
        ref_logp, ref_ent = reference.token_logprobs(x_ref, y, 1.0)
        (ref_logp.sum() - 0.5 * ref_ent.sum()).backward()
        torch.testing.assert_close(logp.double(), ref_logp, **TOL[torch.float32])
        torch.testing.assert_close(ent.double(), ref_ent, **TOL[torch.float32])
        torch.testing.assert_close(leaf.grad[index].double(), x_ref.grad, **GRAD_TOL[torch.float32])
        outside = torch.ones_like(leaf.grad, dtype=torch.bool)
        outside[index] = False
        assert (leaf.grad[outside] == 0).all()
        if backend == "cpu":
            assert counter.names["rlkernels_C::token_logprobs_fwd"] == launches, counter.names
            assert counter.names["rlkernels_C::token_logprobs_bwd_out"] == launches, counter.names


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliced_logits_without_gradient_are_read_in_place(backend):
    """`logits[:, :-1]` for old/reference log-probs (no gradient): the same numbers as its
    contiguous copy, without making one (peak memory well under the copy's size)."""
    from rlkernels._peak_memory import peak_since, reset_peak

    base = torch.randn(8, 129, 65536) * 3  # 270 MB; a copy of the slice: 268 MB
    logits, targets = base[:, :-1], torch.randint(0, 65536, (8, 128))
    expected = rlkernels.token_logprobs(logits.contiguous(), targets, return_entropy=True, backend=backend)
    with torch.no_grad():
        start = reset_peak()
        got = rlkernels.token_logprobs(logits, targets, return_entropy=True, backend=backend)
        extra = peak_since(start)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    if backend == "cpu":  # the torch backend's chunk temporaries, served by a heap that earlier
        # tests have shaped, make its resident peak an unreliable witness here
        copy_bytes = logits.numel() * logits.element_size()
        assert extra < copy_bytes / 2, f"{extra / 2**20:.0f} MB extra: the logits were copied"
    # with autograd the slice is copied once, and the gradient reaches the base tensor's slice
    leaf = base[:2, :, :1000].clone().requires_grad_(True)
    rlkernels.token_logprobs(leaf[:, :-1], targets[:2] % 1000, backend=backend).sum().backward()
    assert leaf.grad[:, -1].abs().sum() == 0 and leaf.grad[:, :-1].abs().sum() > 0


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("torch", "cpu")])
def test_gradcheck_fp64(backend):
    logits, targets = _inputs((2, 3), 6, torch.float64, scale=1.0)
    logits.requires_grad_(True)

    def f(x):
        logp, ent = rlkernels.token_logprobs(x, targets, temperature=0.8, return_entropy=True, backend=backend)
        return logp, ent

    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_only_gradient(backend):
    # Only the entropy is used: the log-prob output gets no gradient at all.
    logits, targets = _inputs((4,), 20, torch.float64)
    x = logits.clone().requires_grad_(True)
    _, ent = rlkernels.token_logprobs(x, targets, return_entropy=True, backend=backend)
    (grad,) = torch.autograd.grad(ent.sum(), x)
    x_ref = logits.clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(reference.token_logprobs(x_ref, targets)[1].sum(), x_ref)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(targets=torch.tensor([[0, 9]])), ValueError, "targets.*\\[0, 9\\)"),
    (dict(targets=torch.tensor([[0, -1]])), ValueError, "targets"),
    (dict(targets=torch.zeros(1, 3, dtype=torch.int64)), ValueError, "targets.*shape"),
    (dict(targets=torch.zeros(1, 2)), TypeError, "targets"),
    (dict(logits=torch.zeros(1, 2, 9, dtype=torch.int64)), TypeError, "logits"),
    (dict(logits=torch.zeros(1, 2, 0)), ValueError, "logits"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(backend="tpu"), ValueError, "backend"),
    (dict(return_entropy=1), TypeError, "return_entropy"),
])
def test_bad_inputs_name_the_argument(kwargs, error, match):
    args = dict(logits=torch.zeros(1, 2, 9), targets=torch.tensor([[0, 8]]))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rlkernels.token_logprobs(args.pop("logits"), args.pop("targets"), **args)


def test_env_var_and_explicit_backend(monkeypatch):
    logits, targets = _inputs((2,), 5, torch.float32)
    monkeypatch.setenv("RLKERNELS_BACKEND", "tpu")
    with pytest.raises(ValueError, match="RLKERNELS_BACKEND"):
        rlkernels.token_logprobs(logits, targets)
    monkeypatch.setenv("RLKERNELS_BACKEND", "torch")
    torch.testing.assert_close(rlkernels.token_logprobs(logits, targets), reference.token_logprobs(logits, targets)[0])
    with pytest.raises((RuntimeError, ValueError), match="backend: backend 'cuda'"):
        rlkernels.token_logprobs(logits, targets, backend="cuda")


def test_backend_info_reports_reasons():
    info = rlkernels.backend_info()
    assert set(info) == {"triton", "cuda", "cpu", "torch"}
    assert info["torch"]["available"]
    for entry in info.values():
        assert isinstance(entry["reason"], str) and entry["reason"]
