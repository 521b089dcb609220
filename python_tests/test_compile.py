"""`torch.compile(fullgraph=True)` and `torch.library.opcheck` on the registered ops.

One list of sample inputs (`SAMPLES`) drives opcheck on every op of the backends that run on
CPU tensors here, and the compiled-vs-eager checks. Inductor compiles on CPU are slow (a C++
build per graph), so the inductor checks share one compiled function; the graph-break check over
every preset uses the `eager` backend (Dynamo's trace only, no code generation).
"""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import presets
from rlkernels.ops.token_logprobs import _define

from loss_inputs import preset, random_loss_inputs

BACKENDS = [b for b in ("torch", "cpu") if rlkernels.backend_info()[b]["available"]]
INTERPRETED_TRITON = not torch.cuda.is_available() and rlkernels.backend_info()["triton"]["available"]
# Presets that need no group ids; their whole loss traces as one graph.
PRESETS = ("ppo", "grpo", "dr_grpo", "dapo", "cispo", "gspo", "gspo_token", "fspo", "gmpo")
COMPILED_PRESETS = ("grpo", "gspo")  # one token-level and one sequence-level ratio


def _sample(B, T, V, dtype, temperature, softcap, need_entropy, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    return logits, targets, temperature, softcap, need_entropy


# (logits (B, T, V), targets (B, T), temperature, softcap, need_entropy): odd V (a partial tile), a
# one-token vocabulary, bf16, fp64 (gradcheck's dtype; not the triton backend's), a soft cap.
SAMPLES = [
    _sample(2, 3, 37, torch.float32, 0.8, 0.0, True, 0),
    _sample(1, 4, 1, torch.float32, 1.0, 0.0, True, 1),
    _sample(3, 2, 50, torch.bfloat16, 1.3, 0.0, False, 2),
    _sample(2, 2, 19, torch.float64, 1.0, 2.0, True, 3),
    _sample(2, 3, 37, torch.float32, 0.8, 4.0, True, 4),
]


def _op_args(backend, device="cpu"):
    """(fwd args, bwd args) of the registered ops for every sample the backend takes."""
    for logits, targets, temperature, softcap, need_entropy in SAMPLES:
        if backend in ("triton", "cuda") and logits.dtype == torch.float64:
            continue
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]).to(device), targets.reshape(-1).to(device)
        fwd_args = (flat, flat_targets, temperature, softcap, need_entropy)
        logp, entropy, lse_parts = _define(backend)(*fwd_args)
        grad_logp = torch.randn_like(logp)
        grad_entropy = torch.randn_like(entropy) if need_entropy else None
        yield fwd_args, (flat, flat_targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap)


OPCHECK_BACKENDS = BACKENDS + (["triton"] if INTERPRETED_TRITON else [])


def _bwd_op(backend):
    """The backward op of `backend`: the extension's own for cpu and cuda, else the Python op."""
    if backend in ("cpu", "cuda"):
        return torch.ops.rlkernels_C.token_logprobs_bwd.default
    return getattr(torch.ops.rlkernels, f"token_logprobs_bwd_{backend}").default


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_opcheck(backend):
    fwd = _define(backend)
    bwd = _bwd_op(backend)
    # Under the interpreter a triton_op's compile path runs its body on fake tensors, which the
    # interpreter cannot launch; the compiled path is checked on a GPU (test_gpu_triton_compile).
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") if backend == "triton" else None
    for fwd_args, bwd_args in _op_args(backend):
        kw = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(fwd, (fwd_args[0].clone().requires_grad_(True), *fwd_args[1:]), **kw)
        torch.library.opcheck(bwd, bwd_args, **kw)


def _loss_inputs(B, T):
    inputs = random_loss_inputs(B, T, dtype=torch.float32, noise=0.2, seed=7)
    # (B, T) advantages equal along each row and a float mask: the forms whose eager checks read
    # values (and so are skipped while compiling).
    adv = inputs["advantages"][:, None].expand(B, T).contiguous()
    return adv, inputs["mask"].float(), inputs["old_logp"], inputs["ref_logp"]


def _losses(configs, backends, logits, targets, adv, mask, old, ref):
    """{(backend, preset): LossOutput} of policy_loss(token_logprobs(...)), one logits tensor per backend."""
    out = {}
    for backend, x in zip(backends, logits):
        logp, ent = rlkernels.token_logprobs(x, targets, temperature=0.8, return_entropy=True, backend=backend)
        for name, config in configs.items():
            out[backend, name] = rlkernels.policy_loss(logp, adv, mask, config, old_logp=old, ref_logp=ref, entropy=ent)
    return out


def _fused(config, logits, targets, adv, mask, old, ref):
    return rlkernels.fused_policy_loss(logits, targets, adv, mask, config, old_logp=old, ref_logp=ref, temperature=0.8,
                                       backend="torch")


def _run(fn, logits, *args):
    """(outputs, ∂(Σ losses)/∂logits for each logits tensor)."""
    xs = [x.clone().requires_grad_(True) for x in logits]
    out = fn(xs, *args)
    sum(o.loss for o in out.values()).backward()
    return out, [x.grad for x in xs]


def _assert_same(out, grads, expected, expected_grads):
    assert out.keys() == expected.keys()
    for key, o in out.items():
        torch.testing.assert_close(o.loss, expected[key].loss, rtol=1e-5, atol=1e-6, msg=str(key))
        for metric, value in expected[key].metrics.items():
            torch.testing.assert_close(o.metrics[metric], value, rtol=1e-5, atol=1e-6, msg=f"{key} {metric}")
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_every_preset_traces_without_graph_break():
    logits, targets = SAMPLES[0][:2]
    configs = {name: preset(name, entropy_coef=0.01) for name in PRESETS}
    args = (targets, *_loss_inputs(*targets.shape))

    def fn(xs, *a):
        return _losses(configs, ["torch"], xs, *a)

    expected = _run(fn, [logits], *args)
    _assert_same(*_run(torch.compile(fn, fullgraph=True, backend="eager"), [logits], *args), *expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", COMPILED_PRESETS)
def test_fused_linear_policy_loss_traces_in_one_graph(name, backend):
    """Under compile the hidden-state op is its definition `policy_loss(linear_token_logprobs(...))`, as
    `fused_policy_loss` is (its gradients computed in the forward break the graph: a host check, and
    autograd.grad for the general step): one graph (Dynamo's, `eager` backend) with eager's value and gradients."""
    g = torch.Generator().manual_seed(5)
    B, T, H, V = 2, 5, 16, 50
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) / 4
    targets = torch.randint(0, V, (B, T), generator=g)
    adv, mask, old, ref = _loss_inputs(B, T)
    config = presets.get(name, entropy_coef=0.01)

    def fn(h, w):
        return rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, config, old_logp=old, ref_logp=ref,
                                                  backend=backend, chunk_size=4).loss

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="eager")):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = f(h, w)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for compiled, eager in zip(*reversed(results)):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # ~25-30 s on 2 cores with a cold inductor cache: a C++ build per graph, forward and backward
def test_inductor_matches_eager():
    """token_logprobs on each CPU backend + policy_loss, and fused_policy_loss, in one graph."""
    logits, targets = SAMPLES[0][:2]
    configs = {name: presets.get(name, entropy_coef=0.01) for name in COMPILED_PRESETS}
    args = (targets, *_loss_inputs(*targets.shape))

    def fn(xs, *a):
        out = _losses(configs, BACKENDS, xs[:-1], *a)
        out["fused", "grpo"] = _fused(configs["grpo"], xs[-1], *a)  # its composed path, under compile
        return out

    all_logits = [logits] * (len(BACKENDS) + 1)
    expected, expected_grads = _run(fn, all_logits, *args)
    torch._dynamo.reset()
    out, grads = _run(torch.compile(fn, fullgraph=True, dynamic=False), all_logits, *args)
    _assert_same(out, grads, expected, expected_grads)

    # and eager fused_policy_loss (∂logits in the forward) gives what the compiled composition gives
    x = logits.clone().requires_grad_(True)
    fused = _fused(configs["grpo"], x, *args)
    fused.loss.backward()
    torch.testing.assert_close(fused.loss, out["fused", "grpo"].loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, grads[-1], rtol=1e-5, atol=1e-7)


def test_eager_checks_still_run():
    logits, targets = SAMPLES[0][:2]
    adv, mask, old, ref = _loss_inputs(*targets.shape)
    logp = rlkernels.token_logprobs(logits, targets, backend="torch")
    with pytest.raises(ValueError, match="mask"):
        rlkernels.policy_loss(logp, adv, mask * 2, presets.grpo(), ref_logp=ref)
    with pytest.raises(ValueError, match="advantages"):
        rlkernels.policy_loss(logp, torch.randn_like(logp), torch.ones_like(mask), presets.gspo())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_triton_compile():
    """The triton_op path on a GPU: opcheck in full, and a compiled loss equal to eager."""
    for fwd_args, bwd_args in _op_args("triton", "cuda"):
        torch.library.opcheck(_define("triton"), (fwd_args[0].clone().requires_grad_(True), *fwd_args[1:]))
        torch.library.opcheck(torch.ops.rlkernels.token_logprobs_bwd_triton.default, bwd_args)
    logits, targets = (t.cuda() for t in SAMPLES[0][:2])
    configs = {name: presets.get(name, entropy_coef=0.01) for name in COMPILED_PRESETS}
    args = (targets, *(t.cuda() for t in _loss_inputs(*targets.shape)))

    def fn(xs, *a):
        return _losses(configs, ["triton"], xs, *a)

    expected = _run(fn, [logits], *args)
    _assert_same(*_run(torch.compile(fn, fullgraph=True, dynamic=False), [logits], *args), *expected)


@pytest.mark.gpu
@pytest.mark.skipif(not rlkernels.backend_info()["cuda"]["available"], reason="needs the CUDA build and a device")
def test_gpu_cuda_opcheck():
    """The compiled CUDA kernels' ops (rlkernels::token_logprobs_*_cuda) under opcheck."""
    for fwd_args, bwd_args in _op_args("cuda", "cuda"):
        torch.library.opcheck(_define("cuda"), (fwd_args[0].clone().requires_grad_(True), *fwd_args[1:]))
        torch.library.opcheck(_bwd_op("cuda"), bwd_args)
    for op, args in _loss_op_args("cuda"):
        torch.library.opcheck(op, args)


def _loss_op_args(device):
    """(op, args) of the extension's other ops: the backward into a buffer, the fused forward with the
    token loss, the token loss at given log-probs (the latter two with and without optional inputs; KL-Cov with
    chosen tokens) and Clip-Cov's and KL-Cov's choice."""
    from rlkernels.ops.kernel_params import covariance_choice_params, covariance_params, token_loss_params

    params = token_loss_params(presets.grpo(entropy_coef=0.01)).packed()
    for logits, targets, temperature, softcap, need_entropy in SAMPLES[-1:]:
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]).to(device), targets.reshape(-1).to(device)
        n = flat.shape[0]
        g = torch.Generator().manual_seed(5)
        mask = (torch.rand(n, generator=g) > 0.2).to(device)
        weight, adv, old, ref = (torch.randn(n, generator=g).to(device) for _ in range(4))
        logp, entropy, lse_parts = torch.ops.rlkernels_C.token_logprobs_fwd(flat, flat_targets, temperature, softcap,
                                                                            True)
        grad_logp, grad_entropy = torch.randn_like(logp), torch.randn_like(entropy)
        yield (torch.ops.rlkernels_C.token_logprobs_bwd_out.default,
               (flat, flat_targets, lse_parts, entropy, grad_logp, grad_entropy, temperature, softcap,
                torch.empty_like(flat)))
        omega = torch.rand(n, generator=g).to(device)
        for optional in ((old, ref, omega), (None, None, None)):
            yield (torch.ops.rlkernels_C.policy_token_fwd.default,
                   (flat, flat_targets, mask, weight, adv, *optional, temperature, softcap, params))
            yield (torch.ops.rlkernels_C.policy_token_loss.default,
                   (logp, entropy, mask, weight, adv, *optional[:2], None, optional[2], params))
        # the two-pass row and its backward (cuda: the sm_90 cluster kernel, docs/design.md §7)
        if device == "cpu" or torch.cuda.get_device_capability(device) >= (9, 0):
            for optional in ((old, ref, omega, torch.randn(n, generator=g).to(device)), (None, None, None, None)):
                args = (flat, flat_targets, mask, weight, adv, *optional, temperature, softcap, params, 0.5)
                yield torch.ops.rlkernels_C.policy_token_fwd_grad.default, args
                yield torch.ops.rlkernels_C.policy_token_fwd_grad_out.default, (*args, torch.empty_like(flat))
            for incoming in (0.5, 2.0):  # returns at once; scales
                yield (torch.ops.rlkernels_C.scale_grad_.default,
                       (torch.randn(n, 7, generator=g).to(device), torch.tensor(incoming, device=device), 0.5))
        yield (torch.ops.rlkernels_C.policy_token_loss.default,
               (logp, None, mask, weight, None, old, None, None, None, params))
        chosen = torch.where(mask, 0.3, 0.0)
        yield (torch.ops.rlkernels_C.policy_token_loss.default,
               (logp, entropy, mask, weight, adv, old, ref, chosen, omega,
                covariance_params(presets.kl_cov()).packed()))
        for name, draws in (("kl_cov", None), ("clip_cov", torch.rand(n, generator=g).to(device))):
            p = covariance_choice_params(presets.get(name, clip_cov_lb=-1.0, kl_cov_ratio=0.3, clip_cov_ratio=0.3))
            for old_logp in (old, None):
                yield (torch.ops.rlkernels_C.covariance_choice.default,
                       (logp, adv, old_logp, mask, draws, int(p.objective), p.fraction, p.cov_lb, p.cov_ub, p.clip_low,
                        p.clip_high, p.log_ratio_clamp, p.scale))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the compiled extension")
def test_opcheck_of_the_extensions_other_ops():
    _define("cpu")  # registers the fakes
    for op, args in _loss_op_args("cpu"):
        torch.library.opcheck(op, args)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the compiled extension")
def test_opcheck_on_a_sliced_view():
    """The logits ops read `logits[:, :-1]` of a (B, T + 1, V) parent where it lies, as (B, T, V) (issue 30): their
    fakes give the real outputs' shapes and strides there too (the gradient in the view's shape)."""
    _define("cpu")
    g = torch.Generator().manual_seed(9)
    parent = torch.randn(2, 5, 33, generator=g)
    n, view = 8, parent[:, :-1]
    targets = torch.randint(0, 33, (n,), generator=g)
    torch.library.opcheck(torch.ops.rlkernels_C.token_logprobs_fwd.default,
                          (parent.clone().requires_grad_(True)[:, :-1], targets, 0.8, 0.0, True))
    logp, entropy, lse_parts = torch.ops.rlkernels_C.token_logprobs_fwd(view, targets, 0.8, 0.0, True)
    grad_logp, grad_entropy = torch.randn_like(logp), torch.randn_like(entropy)
    bwd_args = (view, targets, lse_parts, entropy, grad_logp, grad_entropy, 0.8, 0.0)
    torch.library.opcheck(torch.ops.rlkernels_C.token_logprobs_bwd.default, bwd_args)
    torch.library.opcheck(torch.ops.rlkernels_C.token_logprobs_bwd_out.default,
                          (*bwd_args, torch.empty(2, 5, 33)[:, 1:]))
    from rlkernels.ops.kernel_params import token_loss_params
    mask = torch.rand(n, generator=g) > 0.2
    weight, adv, old, ref = (torch.randn(n, generator=g) for _ in range(4))
    torch.library.opcheck(torch.ops.rlkernels_C.policy_token_fwd.default,
                          (view, targets, mask, weight, adv, old, ref, None, 0.8, 0.0,
                           token_loss_params(presets.grpo()).packed()))
