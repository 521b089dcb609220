"""The hidden-state head's mechanics (rlkernels/ops/_linear_head.py, _precomputed_grad.py): the
chunk rule, the ∂W GEMM and its probe, gradients handed to autograd without copies, its extra peak
memory, and the path on fake tensors (benchmarks/traffic.py). Values against the logits path and
the fp64 reference are in test_linear_path.py."""
from __future__ import annotations

import functools

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import rlkernels
from rlkernels import presets
from rlkernels.ops import _gpu_like, _linear_head, _precomputed_grad
from rlkernels.ops._head_design import CPU_CHUNK_BYTES, GPU_MIN_CHUNK_ROWS, buffer_width, default_rows

CPU = rlkernels.backend_info()["cpu"]["available"]
V152K = 151936


class _Ops(TorchDispatchMode):
    """(op name with overload, output shape) of every op run under it; `dtypes`: the output dtypes alongside."""

    def __init__(self):
        super().__init__()
        self.ops, self.dtypes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        tensor = isinstance(first, torch.Tensor)
        self.ops.append((str(func), tuple(first.shape) if tensor else None))
        self.dtypes.append(first.dtype if tensor else None)
        return out

    def count(self, name, shape=None):
        return sum(1 for op, s in self.ops if op == name and (shape is None or s == shape))

    def made(self, shape, dtype) -> list:
        """The ops whose output has this shape and dtype."""
        return [op for (op, s), d in zip(self.ops, self.dtypes) if s == shape and d == dtype]


def _loss_inputs(B, T, H, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g)
    return hidden, weight, targets, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool), old


# ---------------------------------------------------------------------------------------------
# the chunk rule


def test_gpu_chunks_are_as_large_as_the_accumulator():
    """N = 8192, H = 4096 bf16: the logits (2.49 GB) are no larger than the fp32 ∂W (2.49 GB): one chunk."""
    assert default_rows(8192, V152K, 4096, torch.bfloat16, gpu=True, upcast=False) == 8192
    assert default_rows(16384, V152K, 4096, torch.bfloat16, gpu=True, upcast=False) == 8192  # two chunks
    assert default_rows(8193, V152K, 4096, torch.bfloat16, gpu=True, upcast=False) == 4097  # two, evened out
    assert default_rows(8192, V152K, 4096, torch.float32, gpu=True, upcast=False) == 4096
    # a small accumulator: chunks of at least GPU_MIN_CHUNK_ROWS rows, still one chunk when all rows fit
    assert default_rows(8192, V152K, 896, torch.bfloat16, gpu=True, upcast=False) == GPU_MIN_CHUNK_ROWS
    assert default_rows(3000, V152K, 896, torch.bfloat16, gpu=True, upcast=False) == 3000
    # a GEMM that upcasts (torch < 2.9): the chunk's fp32 image counts too
    assert default_rows(10922, V152K, 8192, torch.bfloat16, gpu=True, upcast=False) == 10922
    assert default_rows(10922, V152K, 8192, torch.bfloat16, gpu=True, upcast=True) == 5461


@pytest.mark.parametrize("dtype,upcast", [(torch.float32, False), (torch.bfloat16, True), (torch.float64, False)])
def test_cpu_chunks_stay_under_the_chunk_bytes(dtype, upcast):
    rows = default_rows(2048, V152K, 896, dtype, gpu=False, upcast=upcast)
    per_logit = dtype.itemsize + (4 if upcast else 0)
    assert 0.9 * CPU_CHUNK_BYTES < rows * V152K * per_logit <= CPU_CHUNK_BYTES
    assert default_rows(0, 37, 8, dtype, gpu=False, upcast=upcast) == 1
    assert default_rows(13, 37, 8, dtype, gpu=False, upcast=upcast) == 13


def test_buffer_rows_are_16_element_aligned():
    """Sharded (and a vocabulary block): one −inf column at least; any V: a multiple of 16 (odd vocabularies
    such as GPT-2's 50257 and Llama 2's 32001 gave cuBLAS an unaligned leading dimension)."""
    assert [buffer_width(v, True) for v in (15, 16, 17, 20, V152K)] == [16, 32, 32, 32, V152K + 16]
    assert [buffer_width(v, False) for v in (37, 32, 50257, 32001, V152K)] == [48, 32, 50272, 32016, V152K]


# ---------------------------------------------------------------------------------------------
# the ∂W GEMM: β = 0 for the first chunk, fp32 products and sums, the probe of the fp32-output GEMM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accumulate_is_exact_in_fp32(dtype):
    """Whatever form the GEMM takes (fp32 output, or the upcast fallback), every product of half
    inputs is exact in fp32 and the sums are fp32's: within fp32 rounding of the fp64 result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(37, 9, generator=g).to(device, dtype) for _ in range(3)]
    b = [torch.randn(9, 5, generator=g).to(device, dtype) for _ in range(3)]
    acc = torch.full((37, 5), float("nan"), device=device)  # β = 0: never read
    for i in range(3):
        _linear_head.accumulate(acc, a[i], b[i], first=i == 0)
    ref = sum(x.double() @ y.double() for x, y in zip(a, b))
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), ref, rtol=1e-6, atol=1e-6)


def test_fp32_out_gemm_probe(monkeypatch):
    """Tried once per (device, dtype), cached; a refusal means the upcast fallback; fake tensors
    are not probed (and cache nothing)."""
    cache = {}
    monkeypatch.setattr(_linear_head, "_FP32_OUT_GEMM", cache)
    x = torch.ones(1, dtype=torch.bfloat16)
    assert _linear_head.fp32_out_gemm(x) is False  # CPUs have no such GEMM
    assert cache == {(x.device, torch.bfloat16): False}

    calls = []

    def refuse(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        raise RuntimeError("out_dtype is not supported here")

    cache.clear()
    monkeypatch.setattr(torch, "mm", refuse)
    assert _linear_head.fp32_out_gemm(x) is False and _linear_head.fp32_out_gemm(x) is False
    assert calls == [torch.float32]  # probed once

    # A GEMM that takes out_dtype is used only if its values are the fp32 products, the aliased out=acc included.
    def mm(a, b, out_dtype, out):
        out.copy_(a.double() @ b.double())

    def addmm(acc, a, b, out_dtype, out, wrong=0.0):
        out.copy_(acc.double() + a.double() @ b.double() + wrong)

    cache.clear()
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    assert _linear_head.fp32_out_gemm(x) is True
    assert _linear_head.head_gemm(x) == "mm / addmm(out_dtype=float32) of the bfloat16 operands"
    for wrong_mm, wrong_addmm in (
            (lambda a, b, out_dtype, out: out.copy_((a.float() @ b.float()).to(a.dtype)), addmm),  # rounded to bf16
            (mm, lambda acc, a, b, out_dtype, out: out.copy_(a.double() @ b.double())),  # acc not added (aliased)
            (mm, functools.partial(addmm, wrong=2 ** -20))):
        cache.clear()
        monkeypatch.setattr(torch, "mm", wrong_mm)
        monkeypatch.setattr(torch, "addmm", wrong_addmm)
        with pytest.raises(RuntimeError, match="fp32_out_gemm: .* its fp32-output GEMM is wrong here"):
            _linear_head.fp32_out_gemm(x)
    monkeypatch.setattr(torch, "mm", refuse)
    cache.clear()
    assert _linear_head.head_gemm(x) == "upcast: the bfloat16 operands copied to fp32, then mm in fp32"
    cache.clear()
    with FakeTensorMode():
        assert _linear_head.fp32_out_gemm(torch.empty(1, dtype=torch.float16)) is False  # a fake CPU tensor
        monkeypatch.setattr(_gpu_like, "MODEL_GPU", True)  # benchmarks/traffic.py modelling a GPU
        assert _linear_head.fp32_out_gemm(torch.empty(1, dtype=torch.float16)) is True
    assert cache == {}


def test_fallback_when_the_probe_refuses(monkeypatch):
    """A device whose fp32-output GEMM is refused takes the upcast: the ops show it, the values are exact."""
    monkeypatch.setattr(_linear_head, "fp32_out_gemm", lambda t: False)
    acc, a, b = torch.empty(4, 3), torch.ones(4, 2, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bfloat16)
    with _Ops() as ops:
        _linear_head.accumulate(acc, a, b, first=True)
    assert ops.count("aten.mm.out") == 1 and ops.count("aten.mm.dtype_out") == 0
    assert torch.equal(acc, torch.full((4, 3), 2.0))


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
def test_first_chunk_writes_the_accumulators_with_beta_zero():
    """No zero-filled (V, H) or (V,) accumulator: the first chunk's product writes it (`mm`, and a
    `sum` into ∂bias), the others add to it."""
    V, H = 37, 8
    h, w, targets, _, _, _ = _loss_inputs(3, 5, H, V)
    b = torch.zeros(V, requires_grad=True)
    with _Ops() as ops:
        rlkernels.linear_token_logprobs(h, w, targets, bias=b, backend="cpu", chunk_size=4).sum().backward()
    assert ops.count("aten.mm.out", (V, H)) == 1 and ops.count("aten.addmm.out", (V, H)) == 3
    assert ops.count("aten.sum.IntList_out", (V,)) == 1
    assert not [op for op, shape in ops.ops if shape in ((V, H), (V,)) and ("zero" in op or "fill" in op)]


# ---------------------------------------------------------------------------------------------
# the backward: the stored gradients scaled where they lie, converted and scaled in one pass


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
def test_a_second_backward_after_an_in_place_scale_is_an_error():
    h, w, targets, adv, mask, old = _loss_inputs(2, 3, 4, 19)
    out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.grpo(), old_logp=old, ref_logp=old)
    (2.0 * out.loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*retain_graph"):
        (2.0 * out.loss).backward()


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
def test_a_known_unit_scale_leaves_the_gradients_as_they_are():
    """`loss.backward()` on CPU tensors: the 1 is read without a device copy and nothing is scaled,
    so a retained graph gives the same gradients again (gradcheck relies on it)."""
    h, w, targets, adv, mask, old = _loss_inputs(2, 3, 4, 19)
    out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.grpo(), old_logp=old, ref_logp=old)
    with _Ops() as ops:
        out.loss.backward(retain_graph=True)
    assert not [op for op, _ in ops.ops if "mul" in op]
    first = w.grad.clone()
    out.loss.backward()
    torch.testing.assert_close(w.grad, 2 * first)


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
@pytest.mark.parametrize("gpu_form", [False, True])
def test_half_precision_gradients_converted_and_scaled(monkeypatch, gpu_form):
    """bf16 parameters and an fp32 ∂W accumulator: the CPU's in-place scale then conversion, and the
    GPU's one pass (forced here on CPU tensors), round the scaled accumulator once: with a scale of
    4 the gradients are exactly 4 times those of a unit scale (the accumulator converted alone)."""
    if gpu_form:
        monkeypatch.setattr(_precomputed_grad, "gpu_like", lambda t: True)
    grads = []
    for scale in (1.0, 4.0):
        h, w, targets, adv, mask, old = _loss_inputs(2, 3, 8, 37, dtype=torch.bfloat16)
        out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.grpo(), old_logp=old,
                                                 ref_logp=old, backend="cpu", chunk_size=4)
        with _Ops() as ops:
            (scale * out.loss).backward()
        grads.append((h.grad, w.grad))
    assert ops.count("aten.mul.out", tuple(w.shape)) == gpu_form  # one pass: fp32 in, bf16 out
    assert w.grad.dtype == h.grad.dtype == torch.bfloat16
    for unit, scaled in zip(*grads):
        assert torch.equal(scaled, 4 * unit)


@pytest.mark.slow  # a subprocess (a clean allocator) and a 512 × 32768 head: 3-8 s on 2 shared cores
@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
def test_extra_peak_memory_within_5_percent_of_the_logits():
    """fp32 on CPU, the loss scaled by 2.5 (so the stored gradients are scaled, in place): beyond
    ∂hidden and ∂W, the step's peak is one chunk of logits and O(N), ≤ 5% of the N × V logits it
    avoids (the out-of-place scale it replaced cost a second ∂W, 24% here). At N = 2048, H = 896,
    V = 151936 (default chunks of 94 rows): 54 MiB, 4.6% of 1187 MiB."""
    script = textwrap.dedent("""
        import torch
        from benchmarks import measure
        measure.fix_malloc_threshold()  # first: no freed block may stay in the heap, reused unseen
        import rlkernels
        from rlkernels import presets
        B, T, H, V = 2, 256, 128, 32768
        g = torch.Generator().manual_seed(0)
        h = torch.randn(B, T, H, generator=g).requires_grad_(True)
        w = (torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_(True)
        targets, adv, old = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g), -torch.rand(B, T)
        mask = torch.ones(B, T, dtype=torch.bool)
        def step():
            out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.grpo(), old_logp=old,
                                                     ref_logp=old, backend="cpu", chunk_size=16)
            (2.5 * out.loss).backward()
        step()
        grads = (h.numel() + w.numel()) * 4
        print((measure.extra_peak_bytes(step, [h, w], torch.device("cpu")) - grads) / (B * T * V * 4))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=pathlib.Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) <= 0.05


# ---------------------------------------------------------------------------------------------
# fake tensors (benchmarks/traffic.py): the path runs, with a GPU's choices


def _fake_call(name, **design):
    """fused_linear_policy_loss forward + backward at N = 8192, V = 151936, H = 4096 in bf16 on fake tensors,
    modelling a GPU as benchmarks/traffic.py does: (ops, the weight's gradient dtype)."""
    with FakeTensorMode():
        h = torch.empty(8, 1024, 4096, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(V152K, 4096, dtype=torch.bfloat16, requires_grad=True)
        targets, mask = torch.zeros(8, 1024, dtype=torch.int64), torch.ones(8, 1024, dtype=torch.bool)
        old = torch.zeros(8, 1024)
        with _Ops() as ops:
            out = rlkernels.fused_linear_policy_loss(h, w, targets, torch.zeros(8), mask, presets.get(name),
                                                     old_logp=old, ref_logp=old, backend="cpu", **design)
            out.loss.backward()
        assert h.grad.shape == h.shape and h.grad.dtype == torch.bfloat16
        return ops, w.grad.dtype


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
@pytest.mark.parametrize("name", ["grpo", "gspo"])  # one pass, two passes
def test_speed_first_on_fake_tensors_writes_dw_in_bf16(name, monkeypatch):
    """`memory_budget=None` at the target size with a GPU's choices: one row chunk, whose ∂W GEMM writes the
    bf16 gradient itself: no fp32 (V, H) tensor, no conversion; no probe is cached."""
    cache = dict(_linear_head._FP32_OUT_GEMM)
    monkeypatch.setattr(_gpu_like, "MODEL_GPU", True)
    ops, dtype = _fake_call(name, memory_budget=None)
    assert dtype == torch.bfloat16
    assert ops.count("aten.mm.out", (V152K, 4096)) == 1 and ops.count("aten.addmm.out", (V152K, 4096)) == 0
    assert not ops.made((V152K, 4096), torch.float32)
    assert _linear_head._FP32_OUT_GEMM == cache


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_default_on_fake_tensors_takes_vocabulary_blocks(name, monkeypatch):
    """The default at the target size: 14 vocabulary blocks; each writes its rows of ∂W once in bf16 (13 of
    10863 rows, the last 10717), ∂hidden is one fp32 GEMM then 13 that add (fp32 output); no fp32 (V, H)."""
    monkeypatch.setattr(_gpu_like, "MODEL_GPU", True)
    ops, dtype = _fake_call(name)
    assert dtype == torch.bfloat16 and not ops.made((V152K, 4096), torch.float32)
    assert ops.count("aten.mm.out", (10863, 4096)) == 13 and ops.count("aten.mm.out", (10717, 4096)) == 1
    assert ops.count("aten.mm.dtype_out", (8192, 4096)) == 1 and ops.count("aten.addmm.dtype_out", (8192, 4096)) == 13
    # the logits: 14 GEMMs forward, 13 backward (the last block's, 10717 columns, are still in the buffer)
    assert ops.count("aten.mm.out", (8192, 10863)) == 13 + 13 and ops.count("aten.mm.out", (8192, 10717)) == 1


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
def test_modelled_time_within_1_15_of_the_three_gemm_floor_speed_first():
    """Token-level (one pass), speed first, at N = 8192, V = 151936, H = 4096, bf16, H200 model
    (benchmarks/traffic.py): the three GEMMs' FLOPs and no more, and their time plus the bytes moved ≤ 1.15×
    the GEMMs' alone (1.13×: 21.5 GB, ∂W written once in bf16; 1.14× with the fp32 ∂W before), its extra
    peak the one chunk of logits (100%; 150% with the fp32 ∂W)."""
    from benchmarks import traffic

    n, hidden = 8192, 4096
    (row,) = traffic.model(n, V152K, hidden, torch.bfloat16, "cpu",
                           only=["fused_linear_policy_loss grpo, memory_budget=None"])
    floor_ms = 1e3 * 3 * 2 * n * hidden * V152K / traffic.MATMUL_FLOPS_PER_S
    assert row.gemm_ratio == 1.0 and row.model_ms <= 1.15 * floor_ms, row.by_op
    assert row.extra_peak <= 1.01


@pytest.mark.skipif(not CPU, reason="needs the compiled cpu backend")
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_default_within_10_percent_at_1_5_times_the_floor(name):
    """The issue's target at N = 8192, V = 151936, H = 4096, bf16 (H200 model): extra peak ≤ 10% of the logits
    at ≤ 1.5× the 3-GEMM floor, by default (vocabulary blocks: 9.9%, 1.48×; 150% and 1.14×/1.49× before)."""
    from benchmarks import traffic

    n, hidden = 8192, 4096
    (row,) = traffic.model(n, V152K, hidden, torch.bfloat16, "cpu", only=[f"fused_linear_policy_loss {name}"])
    floor_ms = 1e3 * 3 * 2 * n * hidden * V152K / traffic.MATMUL_FLOPS_PER_S
    assert row.extra_peak <= 0.10 and row.model_ms <= 1.5 * floor_ms, (row.extra_peak, row.model_ms / floor_ms)


# ---------------------------------------------------------------------------------------------
# on a GPU: the fp32-output GEMM itself


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_weight_gradient_against_fp64():
    """bf16 on CUDA, three chunks (the first GEMM with β = 0, then two that add): ∂W and ∂hidden
    against the fp64 chain rule through the materialised logits. Where the probe accepts the
    fp32-output GEMM, it is what ran."""
    from test_linear_path import _inputs, _reference_grads, _rel

    hidden, weight, b, targets = _inputs(N=12, H=16, V=37, dtype=torch.bfloat16)
    h, w = (x.cuda().requires_grad_(True) for x in (hidden, weight))
    with _Ops() as ops:
        logp, ent = rlkernels.linear_token_logprobs(h, w, targets.cuda(), return_entropy=True, chunk_size=4)
        (logp + 0.5 * ent).sum().backward()
    _, _, ref = _reference_grads(hidden, weight, None, targets, 1.0, torch.ones(12), torch.full((12,), 0.5))
    assert _rel(h.grad.cpu(), ref[0]) < 1e-2 and _rel(w.grad.cpu(), ref[1]) < 1e-2
    if _linear_head.fp32_out_gemm(h):
        assert ops.count("aten.mm.dtype_out", (37, 16)) == 1 and ops.count("aten.addmm.dtype_out", (37, 16)) == 2
