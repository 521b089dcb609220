"""Bytes over the logits, counted (`benchmarks.traffic`: a TorchDispatchMode over forward + backward on fake
tensors), and the views of logits read in place with their gradient handed to the parent.

The floor of the logits path is 3 passes over N·V·b: read forward, read and write backward; 2 where the forward
writes the gradient (the two-pass path). A slice such as
`model(x).logits[:, :-1]` must not add autograd's zero-filled parent-sized gradient and copy (7 and 5 passes
before: a clone of the slice for token_logprobs, `slice_backward` for both ops). The parent's rows outside
the slice are written once (zeros): that is the gradient autograd needs there.
"""
import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rlkernels
from benchmarks import traffic
from rlkernels import _backend, presets

N, V, H, B = 512, 4096, 64, 8
BACKENDS = [b for b in ("cpu", "triton") if _backend.backend_info()[b]["available"]
            and (b != "triton" or _backend._device_ok("triton", torch.device("cpu")))]
# Counted on the cpu backend's op sequence, which is the cuda backend's (the same extension ops). The
# Triton backend launches its kernels from Python, not as ops a dispatch mode sees.
COUNTED = [b for b in ("cpu",) if b in BACKENDS]
LOGITS_PATHS = ["token_logprobs", "fused_policy_loss grpo", "fused_policy_loss gspo"]


@pytest.mark.parametrize("backend", COUNTED)
@pytest.mark.parametrize("path", LOGITS_PATHS)
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_path_makes_three_passes(backend, path, sliced, dtype):
    name = path + (", sliced" if sliced else "")
    (row,) = traffic.model(N, V, H, dtype, backend, only=[name])
    outside = B / N if sliced else 0.0  # the parent's rows past the slice: one write of zeros
    size = N * V * torch.empty(0, dtype=dtype).element_size()
    per_token = 512 * N  # the (N,) per-token vectors: targets, mask, log-probs, derivatives, statistics
    assert row.bytes <= (3.0 + outside) * size + per_token, row.by_op
    # the logits (or their parent) and one gradient of that size; no second N × V buffer
    assert row.peak_bytes <= 2 * size * (1 + outside) + 0.05 * size, row.by_op


@pytest.mark.parametrize("backend", COUNTED)
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_pass_path_makes_two_passes(backend, sliced, dtype):
    """The forward reads the logits once and writes ∂logits once; the backward (`loss.backward()`, the assumed
    incoming gradient) moves nothing of size N × V."""
    name = "fused_policy_loss grpo, two-pass" + (", sliced" if sliced else "")
    (row,) = traffic.model(N, V, H, dtype, backend, only=[name])
    outside = B / N if sliced else 0.0
    size = N * V * torch.empty(0, dtype=dtype).element_size()
    assert row.bytes <= (2.0 + outside) * size + 512 * N, row.by_op
    kernel = row.by_op.get("rlkernels_C::policy_token_fwd_grad", 0) + row.by_op.get(
        "rlkernels_C::policy_token_fwd_grad_out", 0)
    assert kernel >= 2 * size, row.by_op  # the forward writes the gradient
    assert row.peak_bytes <= 2 * size * (1 + outside) + 0.05 * size, row.by_op


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")
def test_the_triton_split_row_adds_only_its_scratch():
    """The split row is the two-pass op (2 passes) plus K partials of 16 bytes per row, written and read once, and
    N + 2 int32 counters (kernels/triton/split_row.py)."""
    from rlkernels.kernels.triton.split_row import split_plan

    chunks = split_plan(V, torch.bfloat16, interpret=False)[3]
    name = "fused_policy_loss grpo, two-pass"
    base, split = traffic.model(N, V, H, torch.bfloat16, "cpu", only=[name, f"{name}, triton split row (K = {chunks})"])
    assert split.bytes - base.bytes == 2 * N * chunks * 16 + 8 * (N + 2)
    assert split.passes - base.passes == pytest.approx((32 * chunks * N + 8 * (N + 2)) / (N * V * 2))


def test_counter_counts_what_an_op_reads_and_writes():
    with FakeTensorMode():
        x, y = torch.empty(100, 10), torch.empty(10, 20)
        with traffic.TrafficCounter() as c:
            z = x @ y          # reads 1000 + 200, writes 2000 floats; 2·100·10·20 FLOPs
            z[:, :5].zero_()   # writes 500 floats (a view counts its own elements)
            z.add_(1.0)        # reads and writes 2000
    assert c.read == 4 * (1200 + 2000) and c.written == 4 * (2000 + 500 + 2000)
    assert c.flops == 2 * 100 * 10 * 20


def _views():
    """(parent shape, view of it) pairs: boxes (read in place, gradient to the parent) and others."""
    return {
        "shifted": ((3, 9, 33), lambda p: p[:, :-1]),
        "completion": ((3, 9, 33), lambda p: p[:, -5:-1]),
        "rows": ((20, 33), lambda p: p[4:11]),
        "batch": ((4, 6, 33), lambda p: p[1:3]),
        "select": ((4, 6, 33), lambda p: p[2]),
        "4-d": ((2, 3, 5, 33), lambda p: p[:, 1:, :-1]),
        "stepped": ((3, 9, 33), lambda p: p[:, ::2]),
        "transposed": ((3, 9, 33), lambda p: p.transpose(0, 1)[:-1]),
    }


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("view", list(_views()))
def test_views_match_a_contiguous_copy(backend, view):
    shape, make = _views()[view]
    g = torch.Generator().manual_seed(len(view))
    parent = torch.randn(*shape, generator=g).requires_grad_(True)
    logits = make(parent)
    targets = torch.randint(0, shape[-1], logits.shape[:-1], generator=g)
    w = torch.randn(logits.shape[:-1], generator=g)
    copy = logits.detach().clone().requires_grad_(True)
    grads = []
    for x in (logits, copy):
        logp, entropy = rlkernels.token_logprobs(x, targets, temperature=0.7, return_entropy=True, backend=backend)
        (w * logp + entropy.cos()).sum().backward()
    expected = torch.zeros_like(parent)
    make(expected).copy_(copy.grad)
    torch.testing.assert_close(parent.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("preset", ["grpo", "gspo"])
def test_fused_loss_on_a_slice_used_twice(backend, preset):
    """The slice's own graph (another use of it) and the parent's gradient from the kernel add up."""
    g = torch.Generator().manual_seed(7)
    parent = torch.randn(4, 7, 40, generator=g).requires_grad_(True)
    targets = torch.randint(0, 40, (4, 6), generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    adv, old = torch.randn(4, generator=g), -torch.rand(4, 6, generator=g)
    grads = []
    for make in (lambda p: p[:, :-1], lambda p: p[:, :-1].contiguous()):
        parent.grad = None
        logits = make(parent)
        out = rlkernels.fused_policy_loss(logits, targets, adv, mask, presets.get(preset), old_logp=old, ref_logp=old,
                                          backend=backend)
        (out.loss + 0.1 * logits.square().mean()).backward()
        grads.append(parent.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_changing_the_parent_after_the_forward_is_refused():
    parent = torch.randn(2, 5, 11, requires_grad=True)
    base = parent * 1.0
    logp = rlkernels.token_logprobs(base[:, :-1], torch.zeros(2, 4, dtype=torch.long), backend="cpu")
    with torch.no_grad():
        base.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton interpreter is off")
def test_launches_count_the_triton_kernels():
    """A Triton kernel is launched from Python, past the dispatcher: counted once per launch, with the aten ops
    of its op's body, and not as its op (which is no launch of its own)."""
    from benchmarks import launches

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 40, generator=g).requires_grad_(True)
    targets = torch.randint(0, 40, (2, 5), generator=g)
    c = launches.count(lambda: rlkernels.token_logprobs(logits, targets, backend="triton").sum().backward())
    kernels = {k: v for k, v in c.names.items() if k.startswith("triton::")}
    assert kernels == {"triton::_token_logprobs_fwd_kernel": 1, "triton::_token_logprobs_bwd_kernel": 1}, c.names
    assert not [k for k in c.names if k.startswith("rlkernels::")], c.names


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "cpu"])
def test_per_call_counts_the_call_not_its_inputs(backend):
    """traffic's launches per call are those of the call on inputs made before it."""
    from benchmarks import launches

    n, vocab, batch = 64, 16, 4
    got = traffic.per_call(n, vocab, 8, torch.float32, backend, "cpu", batch, reps=1,
                           only=["token_logprobs", "fused_policy_loss grpo, sliced"])
    logits = torch.randn(batch, n // batch, vocab, requires_grad=True)
    targets = torch.zeros(batch, n // batch, dtype=torch.int64)
    rlkernels.token_logprobs(logits, targets, backend=backend).sum().backward()  # first call: registrations
    logits.grad = None
    alone = launches.count(lambda: rlkernels.token_logprobs(logits, targets, backend=backend).sum().backward())
    assert set(got) == {"token_logprobs", "fused_policy_loss grpo, sliced"}
    assert got["token_logprobs"][0] == alone.ops and got["token_logprobs"][1] > 0


def test_printout_has_launches_and_host_time(capsys):
    traffic.main(["--n", "64", "--vocab", "256", "--hidden", "16", "--dtype", "fp32", "--per-call", "cpu",
                  "--per-call-vocab", "16"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| path |"))
    assert header.endswith("| launches per call (cpu on cpu, V = 16) | host ms per call (cpu on cpu, V = 16) |")
    row = next(line for line in out.splitlines() if line.startswith("| fused_policy_loss grpo |"))
    launches, host_ms = row.strip("| ").split(" | ")[-2:]
    assert int(launches) > 0 and float(host_ms) > 0
    linear = next(line for line in out.splitlines() if line.startswith("| fused_linear_policy_loss grpo |"))
    assert linear.endswith("| - | - |")  # another V and H than the model's: another design; not shown



def _rows(out):
    return sum(line.startswith("| ") and not line.startswith(("| path", "|---")) for line in out.splitlines())


def test_per_call_none_skips_and_rows_stream(capsys, monkeypatch):
    """--per-call none: the model's table without per-call columns (it raised KeyError: 'none'); each row is printed
    as soon as it is done, before the next path's calls run (a run cut at its limit keeps the rows it finished)."""
    traffic.main(["--n", "64", "--vocab", "256", "--hidden", "16", "--dtype", "fp32", "--per-call", "none"])
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("| path |")).endswith("| modelled ms |")
    assert _rows(out) > 0
    real, printed = traffic.per_call, []

    def per_call(*args, **kwargs):
        printed.append(_rows(capsys.readouterr().out))  # rows printed since the previous call
        return real(*args, **kwargs)

    monkeypatch.setattr(traffic, "per_call", per_call)
    traffic.main(["--n", "64", "--vocab", "256", "--hidden", "16", "--dtype", "fp32", "--per-call", "cpu",
                  "--per-call-vocab", "16"])
    assert len(printed) > 2 and printed[0] == 0 and min(printed[1:]) >= 1  # (unmeasured rows print between)
