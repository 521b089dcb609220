"""The hidden-state path: `linear_token_logprobs` and `fused_linear_policy_loss` equal the logits
path on materialised logits `hidden @ weight.T + bias` in value, gradients (hidden, weight, bias)
and metrics, for every backend, preset, dtype and chunking."""
from __future__ import annotations


import zlib

import pytest
import torch

import rlkernels
from rlkernels import presets, reference

from loss_inputs import preset, random_loss_inputs

BACKENDS = [b for b in ("torch", "cpu") if rlkernels.backend_info()[b]["available"]]
TRITON = rlkernels.backend_info()["triton"]["available"]
# normwise relative error allowed (docs/design.md §9: 1e-5 fp32, 2e-3 bf16 on log-probs). bf16
# gradients are rounded to bf16 per logit, then summed over V or N by a bf16 matmul.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-3, 1e-2), torch.float64: (1e-12, 1e-12)}


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _inputs(N=13, H=8, V=37, dtype=torch.float32, bias=True, seed=0, shape=None):
    """hidden (N, H) (or `shape + (H,)`), weight (V, H), bias (V,), targets; logits of std ≈ 2.
    V = 37, N = 13: odd sizes that no chunk size below divides."""
    g = torch.Generator().manual_seed(seed)
    shape = shape or (N,)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    targets = torch.randint(0, V, shape, generator=g)
    return hidden, weight, b, targets


def _leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_(True) for x in xs]


def _materialised(hidden, weight, bias):
    """The logits as an `nn.Linear` head computes them (one rounding, as `addmm`), in the inputs' dtype."""
    return torch.nn.functional.linear(hidden, weight, bias)


def _reference_grads(hidden, weight, bias, targets, temperature, grad_logp, grad_entropy):
    """Reference (fp64) log-probs, entropy and gradients on the materialised logits (upcast), the
    chain rule through the matmul in fp64."""
    z = _materialised(hidden, weight, bias).double().requires_grad_(True)
    logp, ent = reference.token_logprobs(z, targets, temperature)
    (logp * grad_logp.double() + ent * grad_entropy.double()).sum().backward()
    gz = z.grad.reshape(-1, z.shape[-1])
    h = hidden.double().reshape(-1, hidden.shape[-1])
    grads = [(gz @ weight.double()).view(hidden.shape), gz.t() @ h, None if bias is None else gz.sum(0)]
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_size", [None, 1, 5, 64])  # default, one row, not dividing N = 13, more than N
def test_linear_token_logprobs_matches_reference(backend, dtype, bias, chunk_size):
    hidden, weight, b, targets = _inputs(dtype=dtype, bias=bias, shape=(3, 5) if chunk_size == 5 else None)
    h, w, bb = _leaves(hidden, weight, b)
    logp, ent = rlkernels.linear_token_logprobs(h, w, targets, bias=bb, temperature=0.8, return_entropy=True,
                                                backend=backend, chunk_size=chunk_size)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape and ent.shape == targets.shape
    gl, ge = torch.randn(targets.shape), torch.randn(targets.shape)
    (logp * gl + ent * ge).sum().backward()

    ref_logp, ref_ent, ref_grads = _reference_grads(hidden, weight, b, targets, 0.8, gl, ge)
    tol_fwd, tol_bwd = TOL[dtype]
    assert _rel(logp, ref_logp) < tol_fwd and _rel(ent, ref_ent) < tol_fwd
    for name, x, ref in zip(("hidden", "weight", "bias"), (h, w, bb), ref_grads):
        if x is not None:
            assert x.grad.dtype == dtype
            assert _rel(x.grad, ref) < tol_bwd, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_only_and_entropy_only_gradients(backend):
    hidden, weight, b, targets = _inputs()
    h, w, bb = _leaves(hidden, weight, b)
    rlkernels.linear_token_logprobs(h, w, targets, bias=bb, backend=backend, chunk_size=4).sum().backward()
    _, _, ref = _reference_grads(hidden, weight, b, targets, 1.0, torch.ones(13), torch.zeros(13))
    for x, r in zip((h, w, bb), ref):
        assert _rel(x.grad, r) < 1e-5

    h, w, bb = _leaves(hidden, weight, b)
    _, ent = rlkernels.linear_token_logprobs(h, w, targets, bias=bb, return_entropy=True, backend=backend)
    ent.sum().backward()
    _, _, ref = _reference_grads(hidden, weight, b, targets, 1.0, torch.zeros(13), torch.ones(13))
    for x, r in zip((h, w, bb), ref):
        assert _rel(x.grad, r) < 1e-5


def test_gradcheck_fp64_torch_backend():
    hidden, weight, b, targets = _inputs(N=5, H=3, V=7, dtype=torch.float64)

    def f(h, w, bb):
        return rlkernels.linear_token_logprobs(h, w, targets, bias=bb, temperature=0.7, return_entropy=True,
                                               backend="torch", chunk_size=2)

    assert torch.autograd.gradcheck(f, tuple(_leaves(hidden, weight, b)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weights_accumulate_both_uses(backend):
    """weight is also the input embedding: its gradient is the sum of the lookup's and the head's."""
    V, H = 37, 8
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(V, H, generator=g)
    ids, targets = torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (2, 6), generator=g)
    proj = torch.randn(H, H, generator=g) / H**0.5

    def run(fn):
        w = emb.clone().requires_grad_(True)
        hidden = torch.tanh(torch.nn.functional.embedding(ids, w) @ proj)
        fn(hidden, w).backward()
        return w.grad

    ours = run(lambda h, w: rlkernels.linear_token_logprobs(h, w, targets, backend=backend, chunk_size=5).sum())
    eager = run(lambda h, w: torch.log_softmax(h @ w.t(), -1).gather(-1, targets[..., None]).sum())
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input_and_frozen_weight(backend):
    hidden, weight, b, targets = _inputs(N=0)
    h, w, bb = _leaves(hidden, weight, b)
    logp = rlkernels.linear_token_logprobs(h, w, targets, bias=bb, backend=backend)
    assert logp.shape == (0,)
    logp.sum().backward()
    assert h.grad.shape == (0, 8) and not w.grad.any() and not bb.grad.any()

    hidden, weight, b, targets = _inputs()
    h = hidden.clone().requires_grad_(True)
    rlkernels.linear_token_logprobs(h, weight, targets, bias=b, backend=backend).sum().backward()
    _, _, ref = _reference_grads(hidden, weight, b, targets, 1.0, torch.ones(13), torch.zeros(13))
    assert weight.grad is None and _rel(h.grad, ref[0]) < 1e-5


def test_shift_invariance_and_no_grad():
    """A constant added to every logit (through the bias) changes nothing; no_grad works."""
    hidden, weight, b, targets = _inputs()
    with torch.no_grad():
        a = rlkernels.linear_token_logprobs(hidden, weight, targets, bias=b, backend="torch")
        c = rlkernels.linear_token_logprobs(hidden, weight, targets, bias=b + 100, backend="torch")
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_bad_inputs_name_the_argument():
    hidden, weight, b, targets = _inputs()
    with pytest.raises(TypeError, match="weight"):
        rlkernels.linear_token_logprobs(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="weight"):
        rlkernels.linear_token_logprobs(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError, match="bias"):
        rlkernels.linear_token_logprobs(hidden, weight, targets, bias=b[:3])
    with pytest.raises(ValueError, match="targets"):
        rlkernels.linear_token_logprobs(hidden, weight, targets + 37)
    with pytest.raises(ValueError, match="chunk_size"):
        rlkernels.linear_token_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        rlkernels.linear_token_logprobs(hidden, weight, targets, temperature=0.0)


@pytest.mark.skipif(not TRITON, reason="triton backend unavailable (needs CUDA or TRITON_INTERPRET=1)")
def test_triton_backend_tiny():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight, b, targets = _inputs(N=5, H=4, V=19)
    h, w, bb = _leaves(hidden.to(device), weight.to(device), b.to(device))
    logp, ent = rlkernels.linear_token_logprobs(h, w, targets.to(device), bias=bb, return_entropy=True,
                                                backend="triton", chunk_size=2)
    (logp + 0.5 * ent).sum().backward()
    ref_logp, ref_ent, ref = _reference_grads(hidden, weight, b, targets, 1.0, torch.ones(5), torch.full((5,), 0.5))
    assert _rel(logp.cpu(), ref_logp) < 1e-5 and _rel(ent.cpu(), ref_ent) < 1e-5
    for x, r in zip((h, w, bb), ref):
        assert _rel(x.grad.cpu(), r) < 1e-5


# ---------------------------------------------------------------------------------------------
# fused_linear_policy_loss


def _loss_case(B=6, T=7, H=8, V=37, dtype=torch.float32, bias=True, seed=0, per_token_adv=False):
    inputs = random_loss_inputs(B, T, dtype=torch.float64, noise=0.2, per_token_adv=per_token_adv, seed=seed)
    hidden, weight, b, targets = _inputs(H=H, V=V, dtype=dtype, bias=bias, seed=seed, shape=(B, T))
    with torch.no_grad():  # old/ref log-probs near the current ones, so ratios stay near 1 and clipping is mixed
        cur = rlkernels.linear_token_logprobs(hidden.float(), weight.float(), targets,
                                              bias=None if b is None else b.float(), backend="torch")
    inputs["old_logp"] = cur + 0.2 * torch.randn(B, T, dtype=torch.float64).float()
    inputs["ref_logp"] = cur + 0.2 * torch.randn(B, T, dtype=torch.float64).float()
    return hidden, weight, b, targets, inputs


def _kwargs(inputs, config, on_policy=False):
    kw = dict(old_logp=None if on_policy else inputs["old_logp"].float(), ref_logp=inputs["ref_logp"].float(),
              rewards=inputs["rewards"].float())
    if config.ratio in ("group_expectation", "snis"):
        kw["group_ids"] = inputs["group_ids"]
    return kw


def _compare_with_logits_path(name, backend, dtype, bias, chunk_size, on_policy=False, scale=2.5, fields=None,
                              **extra):
    per_token_adv = name in ("ppo", "dapo", "cispo", "gspo_token")
    hidden, weight, b, targets, inputs = _loss_case(dtype=dtype, bias=bias, seed=zlib.crc32(name.encode()) % 1000,
                                                    per_token_adv=per_token_adv)
    config = preset(name, **{"entropy_coef": 0.01, **(fields or {})})
    adv, mask = inputs["advantages"].float(), inputs["mask"]
    kw = dict(_kwargs(inputs, config, on_policy), **extra)

    h, w, bb = _leaves(hidden, weight, b)
    torch.manual_seed(0)  # Clip-Cov's random choice of tokens: the same draw on both paths
    ours = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, config, bias=bb, temperature=0.8,
                                              backend=backend, chunk_size=chunk_size, **kw)
    (scale * ours.loss).backward()

    h2, w2, bb2 = _leaves(hidden, weight, b)
    logits = _materialised(h2, w2, bb2)
    torch.manual_seed(0)
    theirs = rlkernels.fused_policy_loss(logits, targets, adv, mask, config, temperature=0.8, backend=backend, **kw)
    (scale * theirs.loss).backward()

    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=tol, atol=1e-6)
    assert set(ours.metrics) == set(theirs.metrics)
    for key in theirs.metrics:
        torch.testing.assert_close(ours.metrics[key], theirs.metrics[key], rtol=tol, atol=1e-6, msg=key)
    for label, x, y in (("hidden", h, h2), ("weight", w, w2), ("bias", bb, bb2)):
        if x is not None:
            assert x.grad.dtype == dtype
            assert _rel(x.grad, y.grad) < (1e-5 if dtype == torch.float32 else 1e-2), label
    return ours, (hidden, weight, b, targets, inputs, config, kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", presets.NAMES)
@pytest.mark.parametrize("bias", [True, False])
def test_every_preset_equals_the_logits_path(backend, name, bias):
    _compare_with_logits_path(name, backend, torch.float32, bias, chunk_size=5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "gspo", "kl_cov"])  # one pass, the sequence and the covariance steps
def test_entropy_bonus_as_its_own_token_mean(backend, name):
    _compare_with_logits_path(name, backend, torch.float32, True, chunk_size=5,
                              fields=dict(entropy_coef=0.05, entropy_agg="token_mean"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo"])  # one and two passes
def test_bf16(backend, name):
    _compare_with_logits_path(name, backend, torch.bfloat16, True, chunk_size=None)


@pytest.mark.parametrize("name", ["grpo", "ppo", "gspo"])
@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_chunking_on_policy_and_global_counts(name, chunk_size):
    _compare_with_logits_path(name, "torch", torch.float32, True, chunk_size, on_policy=True, scale=1.0)
    _compare_with_logits_path(name, "torch", torch.float32, False, chunk_size, num_items=50.0, num_seqs=8.0)


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_against_the_fp64_reference(name):
    ours, (hidden, weight, b, targets, inputs, config, kw) = _compare_with_logits_path(name, BACKENDS[-1], torch.float32,
                                                                                       True, 5)
    h, w, bb = _leaves(hidden.double(), weight.double(), b.double())
    logp, ent = reference.token_logprobs(_materialised(h, w, bb), targets, 0.8)
    kw64 = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in kw.items()}
    ref_loss, ref_metrics = reference.policy_loss(logp, inputs["advantages"], inputs["mask"], config, entropy=ent, **kw64)
    torch.testing.assert_close(ours.loss.double(), ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_fp64_and_gradcheck_of_the_loss(name):
    """The whole hidden-state loss in fp64 through the torch backend passes gradcheck (the gradient
    is computed in the forward, so gradcheck checks exactly what the backward hands out)."""
    hidden, weight, b, targets, inputs = _loss_case(B=3, T=4, H=3, V=7, dtype=torch.float64, seed=5)
    config = presets.get(name, entropy_coef=0.01)
    kw = {k: (v.double() if v is not None else v) for k, v in _kwargs(inputs, config).items()}

    def f(h, w, bb):
        return rlkernels.fused_linear_policy_loss(h, w, targets, inputs["advantages"], inputs["mask"], config,
                                                  bias=bb, backend="torch", chunk_size=5, **kw).loss

    assert torch.autograd.gradcheck(f, tuple(_leaves(hidden, weight, b)))


def test_no_grad_and_frozen_head_give_the_same_value():
    hidden, weight, b, targets, inputs = _loss_case()
    config = presets.grpo()
    args = (targets, inputs["advantages"].float(), inputs["mask"], config)
    kw = dict(_kwargs(inputs, config), bias=b, backend="torch")
    with torch.no_grad():
        plain = rlkernels.fused_linear_policy_loss(hidden, weight, *args, **kw)
    h = hidden.clone().requires_grad_(True)
    frozen = rlkernels.fused_linear_policy_loss(h, weight, *args, **kw)
    frozen.loss.backward()
    torch.testing.assert_close(plain.loss, frozen.loss)
    assert h.grad is not None and weight.grad is None


def test_fully_masked_batch_gives_zero_loss_and_zero_gradients():
    hidden, weight, b, targets, inputs = _loss_case()
    h, w, bb = _leaves(hidden, weight, b)
    config = presets.grpo()
    out = rlkernels.fused_linear_policy_loss(h, w, targets, inputs["advantages"].float(), torch.zeros(6, 7, dtype=torch.bool),
                                             config, bias=bb, backend="torch", **_kwargs(inputs, config))
    out.loss.backward()
    assert out.loss.item() == 0 and not h.grad.any() and not w.grad.any() and not bb.grad.any()


def test_loss_bad_inputs():
    hidden, weight, b, targets, inputs = _loss_case()
    h = hidden.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="hidden"):
        rlkernels.fused_linear_policy_loss(h[0], weight, targets[0], inputs["advantages"].float(), inputs["mask"],
                                           presets.grpo())
    with pytest.raises(ValueError, match="mask"):
        rlkernels.fused_linear_policy_loss(h, weight, targets, inputs["advantages"].float(), inputs["mask"][:, :3],
                                           presets.grpo())


@pytest.mark.skipif(not TRITON, reason="triton backend unavailable (needs CUDA or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("name", ["grpo", "gspo"])  # one pass, two passes
def test_triton_backend_loss_tiny(name):
    hidden, weight, b, targets, inputs = _loss_case(B=2, T=3, H=4, V=19)
    # On a GPU machine Triton runs compiled on CUDA tensors, elsewhere interpreted on CPU ones.
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, weight, b, targets = (x.to(dev) for x in (hidden, weight, b, targets))
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    config = presets.get(name, entropy_coef=0.01)
    kw = _kwargs(inputs, config)
    args = (targets, inputs["advantages"].float(), inputs["mask"], config)
    h, w, bb = _leaves(hidden, weight, b)
    ours = rlkernels.fused_linear_policy_loss(h, w, *args, bias=bb, backend="triton", chunk_size=4, **kw)
    ours.loss.backward()
    h2, w2, bb2 = _leaves(hidden, weight, b)
    theirs = rlkernels.fused_policy_loss(_materialised(h2, w2, bb2), *args, backend="torch", **kw)
    theirs.loss.backward()
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    for x, y in ((h, h2), (w, w2), (bb, bb2)):
        assert _rel(x.grad, y.grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_under_torch_compile(backend, name):
    """torch.compile (Dynamo + AOT autograd, no code generation) of a function calling the
    hidden-state ops gives eager's values and gradients. The chunk loop calls the backend's
    kernels with `out=` buffers, so the graph breaks there: fullgraph=True is not supported."""
    hidden, weight, bias, targets = _inputs(shape=(3, 5))
    batch = random_loss_inputs(3, 5, dtype=torch.float32, seed=1)
    adv, mask, old, ref = (batch[k] for k in ("advantages", "mask", "old_logp", "ref_logp"))

    def fn(h, w, b):
        logp, entropy = rlkernels.linear_token_logprobs(h, w, targets, bias=b, return_entropy=True, backend=backend)
        out = rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, presets.get(name), bias=b, old_logp=old,
                                                 ref_logp=ref, backend=backend)
        return out.loss + (logp * entropy).sum()

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager")):
        leaves = _leaves(hidden, weight, bias)
        loss = f(*leaves)
        loss.backward()
        results.append((loss.detach(), *[x.grad for x in leaves]))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_targets_in_the_padding_of_an_odd_vocabulary_are_refused(backend):
    """V = 37: the kernels' blocks are padded to 48 columns of −inf; ids 37..47 are out of range like 48
    (GPT-2: 50257..50271), on every backend and both ops, with the same message (issue 37, item 3)."""
    hidden, weight, b, targets = _inputs(shape=(2, 3))
    adv, mask, config = torch.randn(2), torch.ones(2, 3, dtype=torch.bool), preset("grpo")
    for bad in (37, 47):
        targets = targets.clone()
        targets[1, 2] = bad
        with pytest.raises(ValueError, match=r"targets: expected values in \[0, 37\)"):
            rlkernels.linear_token_logprobs(hidden, weight, targets, bias=b, backend=backend)
        with pytest.raises(ValueError, match=r"targets: expected values in \[0, 37\)"):
            rlkernels.fused_linear_policy_loss(hidden, weight, targets, adv, mask, config, bias=b, backend=backend)
