"""The hidden-state path's vocabulary-blocked design (rlkernels/ops/_vocab_blocks.py) and the choice of design
(_head_design.py): exact against rlkernels/reference.py on fresh random inputs (fp64 chain rule through the
materialised logits) for every preset family, soft cap, temperature, bias, tied weights and masks (empty ones
too), on blocks that split the vocabulary unevenly; the design each size takes; odd vocabularies padded."""
from __future__ import annotations

import zlib

import pytest
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.ops import _head_design
from rlkernels.ops._head_design import Design, choose, row_chunk_extra, vocab_block_extra

from loss_inputs import preset, random_loss_inputs

BACKENDS = [b for b in ("cpu", "torch") if rlkernels.backend_info()[b]["available"]]
TRITON = rlkernels.backend_info()["triton"]["available"]
V152K = 151936
# normwise relative error against fp64 (test_linear_path.py's): fp32 1e-5; bf16 log-probs 2e-3, gradients 1e-2
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-3, 1e-2)}


@pytest.fixture
def blocks(monkeypatch):
    """`blocks(c)`: every call from here on takes vocabulary blocks of c columns (at test sizes the default
    takes one row chunk: 16 MiB is allowed whatever the budget)."""
    def force(cols):
        monkeypatch.setattr(_head_design, "choose", lambda *a, **k: Design("vocab", cols))
    return force


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _head(shape, H, V, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    return hidden, weight, b, torch.randint(0, V, shape, generator=g)


def _leaves(*xs, dtype=None):
    return [None if x is None else x.detach().to(dtype or x.dtype).clone().requires_grad_(True) for x in xs]


class _Reference:
    """reference.token_logprobs (ℓ, H) on the logits as `nn.Linear` materialises them (rounded once in the inputs'
    dtype), upcast to fp64; `grads()`: the fp64 chain rule through the matmul, once ℓ and H were backpropagated."""

    def __init__(self, hidden, weight, bias, targets, temperature, softcap):
        hidden, weight, bias = (None if x is None else x.detach() for x in (hidden, weight, bias))
        self.hidden, self.weight, self.bias = hidden.double(), weight.double(), bias is not None
        self.z = torch.nn.functional.linear(hidden, weight, bias).double().requires_grad_(True)
        self.logp, self.entropy = reference.token_logprobs(self.z, targets, temperature, softcap=softcap)

    def grads(self):
        gz = self.z.grad.reshape(-1, self.weight.shape[0])
        h = self.hidden.reshape(-1, self.hidden.shape[-1])
        return [(gz @ self.weight).view(self.hidden.shape), gz.t() @ h, gz.sum(0) if self.bias else None]


def _assert_grads(ours, ref: _Reference, tol):
    for name, x, r in zip(("hidden", "weight", "bias"), ours, ref.grads()):
        if x is not None:
            assert x.grad.dtype == x.dtype, name
            assert _rel(x.grad, r) < tol, name


# ---------------------------------------------------------------------------------------------
# linear_token_logprobs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols,softcap,bias", [(15, None, True), (31, 4.0, False), (47, None, False),
                                               (63, 4.0, True)])  # 3, 2, 1 (with its −inf column) and 1 blocks
def test_logprobs_and_entropy_gradients_against_the_reference(blocks, backend, dtype, cols, softcap, bias):
    blocks(cols)
    hidden, weight, b, targets = _head((3, 5), 8, 37, dtype, bias, seed=cols)
    ours = _leaves(hidden, weight, b)
    logp, ent = rlkernels.linear_token_logprobs(*ours[:2], targets, bias=ours[2], temperature=0.7, softcap=softcap,
                                                return_entropy=True, backend=backend)
    gl, ge = torch.randn(targets.shape), torch.randn(targets.shape)
    (logp * gl + ent * ge).sum().backward()
    ref = _Reference(hidden, weight, b, targets, 0.7, softcap)
    ref_logp, ref_ent = ref.logp, ref.entropy
    (ref_logp * gl.double() + ref_ent * ge.double()).sum().backward()
    tol_fwd, tol_bwd = TOL[dtype]
    assert logp.dtype == torch.float32 and _rel(logp, ref_logp) < tol_fwd and _rel(ent, ref_ent) < tol_fwd
    _assert_grads(ours, ref, tol_bwd)


@pytest.mark.skipif(not TRITON, reason="triton backend unavailable (needs CUDA or TRITON_INTERPRET=1)")
def test_triton_backend(blocks):
    blocks(15)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight, b, targets = _head((5,), 4, 37, torch.float32)
    ours = [x.to(device).detach().clone().requires_grad_(True) for x in (hidden, weight, b)]
    logp, ent = rlkernels.linear_token_logprobs(*ours[:2], targets.to(device), bias=ours[2], temperature=0.7,
                                                return_entropy=True, backend="triton")
    (logp + 0.5 * ent).sum().backward()
    ref = _Reference(hidden, weight, b, targets, 0.7, None)
    (ref.logp + 0.5 * ref.entropy).sum().backward()
    assert _rel(logp.cpu(), ref.logp) < 1e-5 and _rel(ent.cpu(), ref.entropy) < 1e-5
    for x, r in zip(ours, ref.grads()):
        assert _rel(x.grad.cpu(), r) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_only_no_rows_and_a_frozen_weight(blocks, backend):
    blocks(15)
    hidden, weight, b, targets = _head((13,), 8, 37, torch.float32)
    ours = _leaves(hidden, weight, b)
    rlkernels.linear_token_logprobs(*ours[:2], targets, bias=ours[2], backend=backend).sum().backward()
    ref = _Reference(hidden, weight, b, targets, 1.0, None)
    ref.logp.sum().backward()
    _assert_grads(ours, ref, 1e-5)

    hidden, weight, b, targets = _head((0,), 8, 37, torch.float32)
    h, w, bb = _leaves(hidden, weight, b)
    logp = rlkernels.linear_token_logprobs(h, w, targets, bias=bb, backend=backend)
    logp.sum().backward()
    assert logp.shape == (0,) and h.grad.shape == (0, 8) and not w.grad.any() and not bb.grad.any()

    hidden, weight, b, targets = _head((13,), 8, 37, torch.float32)
    h = hidden.clone().requires_grad_(True)
    rlkernels.linear_token_logprobs(h, weight, targets, bias=b, backend=backend).sum().backward()
    assert weight.grad is None and _rel(h.grad, ref.grads()[0]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weights_accumulate_both_uses(blocks, backend):
    """weight is also the input embedding: its gradient is the lookup's plus the head's."""
    blocks(15)
    V, H = 37, 8
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(V, H, generator=g)
    ids, targets = torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (2, 6), generator=g)
    proj = torch.randn(H, H, generator=g) / H ** 0.5

    def run(fn, dtype):
        w = emb.to(dtype).clone().requires_grad_(True)
        hidden = torch.tanh(torch.nn.functional.embedding(ids, w) @ proj.to(dtype))
        fn(hidden, w, targets).backward()
        return w.grad

    ours = run(lambda h, w, t: rlkernels.linear_token_logprobs(h, w, t, backend=backend).sum(), torch.float32)
    ref = run(lambda h, w, t: reference.token_logprobs(h @ w.t(), t)[0].sum(), torch.float64)
    assert _rel(ours, ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_backward_computes_every_block_again(blocks, backend):
    """retain_graph: the forward's last block is used once; the second backward gives the same gradients."""
    blocks(15)
    hidden, weight, b, targets = _head((13,), 8, 37, torch.float32)
    h, w, bb = _leaves(hidden, weight, b)
    logp, ent = rlkernels.linear_token_logprobs(h, w, targets, bias=bb, return_entropy=True, backend=backend)
    (logp + ent).sum().backward(retain_graph=True)
    first = [x.grad.clone() for x in (h, w, bb)]
    (logp + ent).sum().backward()
    for x, g in zip((h, w, bb), first):
        torch.testing.assert_close(x.grad, 2 * g)


# ---------------------------------------------------------------------------------------------
# fused_linear_policy_loss: every preset (token-level, covariance, sequence-level) against the reference


def _loss_case(name, dtype, bias, empty=False):
    seed = zlib.crc32(name.encode()) % 1000
    B, T = 6, 7
    inputs = random_loss_inputs(B, T, dtype=torch.float64, noise=0.2, seed=seed,
                                per_token_adv=name in ("ppo", "dapo", "cispo", "gspo_token"))
    hidden, weight, b, targets = _head((B, T), 8, 37, dtype, bias, seed=seed)
    with torch.no_grad():  # old/ref log-probs near the current ones: ratios near 1, clipping mixed
        cur = reference.token_logprobs(torch.nn.functional.linear(
            hidden.double(), weight.double(), None if b is None else b.double()), targets)[0]
    config = preset(name, entropy_coef=0.01)
    kw = dict(old_logp=cur + 0.2 * torch.randn(B, T, dtype=torch.float64),
              ref_logp=cur + 0.2 * torch.randn(B, T, dtype=torch.float64), rewards=inputs["rewards"])
    if config.ratio in ("group_expectation", "snis"):
        kw["group_ids"] = inputs["group_ids"]
    mask = torch.zeros_like(inputs["mask"]) if empty else inputs["mask"]  # row 1 is empty in any case
    return hidden, weight, b, targets, inputs["advantages"], mask, config, kw


def _fp32(kw):
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}


def _check_loss(name, backend, dtype, bias, empty=False, scale=2.5, **options):
    hidden, weight, b, targets, adv, mask, config, kw = _loss_case(name, dtype, bias, empty)
    ours = _leaves(hidden, weight, b)
    torch.manual_seed(0)  # Clip-Cov's random choice of tokens: the same draw for the reference
    out = rlkernels.fused_linear_policy_loss(*ours[:2], targets, adv.float(), mask, config, bias=ours[2],
                                             temperature=0.8, backend=backend, **options, **_fp32(kw))
    (scale * out.loss).backward()

    ref = _Reference(hidden, weight, b, targets, 0.8, options.get("softcap"))
    torch.manual_seed(0)
    ref_loss, ref_metrics = reference.policy_loss(ref.logp, adv, mask, config, entropy=ref.entropy, **kw)
    (scale * ref_loss).backward()
    tol_fwd, tol_bwd = TOL[dtype]
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=tol_fwd, atol=1e-6)
    for key in ("entropy", "clip_frac") if dtype == torch.float32 else ():
        if key in ref_metrics:
            torch.testing.assert_close(out.metrics[key].double(), ref_metrics[key].detach().double(), rtol=1e-5,
                                       atol=1e-6, msg=key)
    _assert_grads(ours, ref, tol_bwd)
    return out, ours


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", presets.NAMES)
def test_every_preset_against_the_reference(blocks, backend, name):
    blocks(15)
    _check_loss(name, backend, torch.float32, bias=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "clip_cov", "gspo", "gepo"])  # token-level, covariance, sequence-level
def test_soft_cap_no_bias_and_bf16(blocks, backend, name):
    blocks(31)
    _check_loss(name, backend, torch.float32, bias=False, softcap=3.0)
    _check_loss(name, backend, torch.bfloat16, bias=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_an_empty_mask_gives_zero_loss_and_zero_gradients(blocks, backend, name):
    blocks(15)
    out, leaves = _check_loss(name, backend, torch.float32, bias=True, empty=True)
    assert out.loss.item() == 0 and not any(x.grad.any() for x in leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_with_a_known_unit_scale_and_retain_graph(blocks, backend):
    """loss.backward() (a scale of 1 known on the host) and a second backward through the retained graph."""
    blocks(15)
    hidden, weight, b, targets, adv, mask, config, kw = _loss_case("grpo", torch.float32, True)
    h, w, bb = _leaves(hidden, weight, b)
    out = rlkernels.fused_linear_policy_loss(h, w, targets, adv.float(), mask, config, bias=bb, backend=backend,
                                             **_fp32(kw))
    out.loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in (h, w, bb)]
    (3.0 * out.loss).backward()
    for x, g in zip((h, w, bb), first):
        torch.testing.assert_close(x.grad, 4 * g, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# odd vocabularies: the buffer padded to a multiple of 16 columns of −inf


@pytest.mark.parametrize("vocab", [50257, 32001])
@pytest.mark.parametrize("design", ["rows", "vocab"])
def test_odd_vocabularies(blocks, vocab, design):
    if design == "vocab":
        blocks(8191)  # 7 and 4 blocks, the last one short
    hidden, weight, b, targets = _head((6,), 8, vocab, torch.float32)
    ours = _leaves(hidden, weight, b)
    logp, ent = rlkernels.linear_token_logprobs(*ours[:2], targets, bias=ours[2], return_entropy=True,
                                                backend=BACKENDS[0])
    (logp + 0.5 * ent).sum().backward()
    ref = _Reference(hidden, weight, b, targets, 1.0, None)
    (ref.logp + 0.5 * ref.entropy).sum().backward()
    assert _rel(logp, ref.logp) < 1e-5 and _rel(ent, ref.entropy) < 1e-5
    _assert_grads(ours, ref, 1e-5)


# ---------------------------------------------------------------------------------------------
# the choice of design


def _choose(n, hidden, dtype, gpu=True, budget=0.1, **kw):
    return choose(n, V152K, hidden, dtype, sharded=False, gpu=gpu, fp32_out=gpu, memory_budget=budget, **kw)


def test_target_size_takes_vocabulary_blocks_within_the_budget():
    """N = 8192, H = 4096, V = 151936, bf16 on a GPU: row chunks take ≥ 100% (the chunk, or the fp32 ∂W),
    vocabulary blocks fit 10%: 14 blocks, each of 10864 columns with its −inf one."""
    logits = 8192 * V152K * 2
    d = _choose(8192, 4096, torch.bfloat16)
    assert d == Design("vocab", 10863)
    assert vocab_block_extra(8192, d.size, 4096, torch.bfloat16, upcast=False) <= 0.1 * logits
    for rows in (8192, 4096, 1024):
        assert row_chunk_extra(8192, rows, V152K, 4096, torch.bfloat16, False, upcast=False) >= logits
    assert _choose(8192, 4096, torch.bfloat16, budget=None) == Design("rows", 8192)  # speed: one chunk
    assert _choose(8192, 4096, torch.bfloat16, budget=1.0) == Design("rows", 8192)
    assert _choose(8192, 4096, torch.bfloat16, chunk_size=100) == Design("rows", 100)


def test_row_chunks_where_they_fit():
    """fp32 on a CPU (∂W is the gradient itself): 94-row chunks, 4.6% of the logits; bf16 at H = 2048 on a CPU:
    the fp32 ∂W alone is 2H/N = 200% of the logits, so vocabulary blocks; a GPU's row chunks below 4096 rows
    spend their time on the accumulator, so fp32 at N = 8192 takes blocks there too."""
    assert _choose(2048, 896, torch.float32, gpu=False) == Design("rows", 94)
    d = _choose(2048, 2048, torch.bfloat16, gpu=False)
    assert d.kind == "vocab"
    assert vocab_block_extra(2048, d.size, 2048, torch.bfloat16, upcast=True) <= 0.1 * 2048 * V152K * 2
    assert _choose(8192, 4096, torch.float32).kind == "vocab"
    assert _choose(32, 4096, torch.bfloat16) == Design("rows", 32)  # 16 MiB allowed whatever the budget


def test_bad_memory_budget_names_the_argument():
    hidden, weight, _, targets = _head((3,), 4, 7, torch.float32)
    for bad in (-0.1, float("nan"), "small", True):
        with pytest.raises(ValueError, match="memory_budget"):
            rlkernels.linear_token_logprobs(hidden, weight, targets, memory_budget=bad)


# ---------------------------------------------------------------------------------------------
# vocabulary blocks of a vocabulary-parallel head (each rank blocks its slice; the blocks merge, then the ranks)


def _sharded_worker(rank, path, result_path):
    import torch.distributed as dist

    from test_vocab_parallel import SPLIT, WORLD, _data, _run

    _head_design.choose = lambda *a, **k: Design("vocab", 7)  # 20 and 17 rows of the head: 3 blocks each
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        rows = slice(sum(SPLIT[:rank]), sum(SPLIT[: rank + 1]))
        hidden, weight, bias, targets, inputs = _data()
        res = {name: _run(hidden, weight[rows], bias[rows], targets, inputs, name, BACKENDS[0], 0.8,
                          group=dist.group.WORLD) for name in ("grpo", "gspo")}
        torch.save(res, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_vocabulary_parallel_blocks_equal_the_unsharded_head(tmp_path):
    import torch.multiprocessing as mp

    from test_vocab_parallel import SPLIT, WORLD, _data, _run

    mp.spawn(_sharded_worker, args=(str(tmp_path / "store"), str(tmp_path / "result")), nprocs=WORLD, join=True)
    hidden, weight, bias, targets, inputs = _data()
    for name in ("grpo", "gspo"):
        logp, ent, loss, metrics, grads_lp, grads_loss = _run(hidden, weight, bias, targets, inputs, name,
                                                              BACKENDS[0], 0.8)
        for r in range(WORLD):
            lp_r, ent_r, loss_r, metrics_r, g_lp, g_loss = torch.load(f"{tmp_path / 'result'}.{r}")[name]
            rows = slice(sum(SPLIT[:r]), sum(SPLIT[: r + 1]))
            torch.testing.assert_close(lp_r, logp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent_r, ent, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(loss_r, loss, rtol=1e-5, atol=1e-6)
            for mine, full in ((g_lp, grads_lp), (g_loss, grads_loss)):
                torch.testing.assert_close(mine[0], full[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine[1], full[1][rows], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine[2], full[2][rows], rtol=1e-5, atol=1e-6)
