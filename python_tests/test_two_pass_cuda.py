"""The CUDA two-pass row (the sm_90 cluster kernel, docs/design.md §2, §7) on a device: `fused_policy_loss` with
`two_pass=True` against `two_pass=False` (the 3-pass kernels) and the fp64 reference, on fresh random inputs, every
preset the forward kernel evaluates, −inf entries, NaN, all −inf, masked and empty rows, a soft cap and τ ≠ 1, in
place, logits[:, :-1], a declared grad_scale and an incoming gradient other than it (the scale_grad_ kernel); the op
against policy_token_fwd then token_logprobs_bwd at vocabularies that take 1, 2, 4 and 8 blocks per row, with an
entropy bonus given apart, into an output aligned otherwise than the logits. Skipped
without a CUDA device of sm_90 or later (benchmarks/gpu_check.sh runs it first on a lent one)."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import presets, reference
from rlkernels.kernels import cuda
from rlkernels.ops._plan import Step, plan
from rlkernels.ops.kernel_params import token_loss_params

from loss_inputs import preset, random_loss_inputs

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
pytestmark = pytest.mark.skipif(not (_SM90 and cuda.available()[0]),
                                reason="needs the cuda backend on a device of sm_90 or later")
FORWARD_PRESETS = [n for n in presets.NAMES if plan(preset(n), cuda).step is Step.FORWARD]
DEV = "cuda"
# two passes against three: the same formula, the row's statistics merged in another order (a few ulp of fp32),
# then one rounding in the logits' dtype
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-9), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-9)}
# rows of 1 block (53), 2 (40001 bf16), 4 (40001 fp32, 151936 bf16) and 8 (151936 fp32): cluster_row.cuh's plan()
VOCABS = [53, 40001, 151936]


def _case(name, V, dtype, B=3, T=4, seed=0):
    config = preset(name, entropy_coef=0.01)
    inputs = random_loss_inputs(B, T, dtype=torch.float64, noise=0.2, per_token_adv=True, seed=seed, empty_rows=(2,))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    logits[0, 1, ::4] = -torch.inf  # −inf entries in an unmasked row
    logits[1, 2] = -torch.inf  # a masked row that is all −inf
    logits[1, 3, V // 2] = torch.nan  # a masked row with a NaN
    mask = inputs["mask"].clone()
    mask[0, 1], mask[1, 2:4] = True, False
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 1], targets[0, 0], targets[0, 2] = 1, V - 1, 0  # a finite logit; the last and first elements
    kw = dict(old_logp=inputs["old_logp"].float().to(DEV), ref_logp=inputs["ref_logp"].float().to(DEV))
    return config, logits.to(dtype).to(DEV), targets.to(DEV), inputs["advantages"].float().to(DEV), mask.to(DEV), kw


def _run(config, logits, targets, adv, mask, kw, incoming=1.0, softcap=None, **opts):
    x = logits.clone().requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.7, softcap=softcap, backend="cuda",
                                      **kw, **opts)
    (out.loss * incoming).backward()
    return out, x.grad


def _against_three_passes_and_reference(name, V, dtype, softcap):
    config, logits, targets, adv, mask, kw = _case(name, V, dtype, seed=V + len(name))
    two, grad2 = _run(config, logits, targets, adv, mask, kw, softcap=softcap, two_pass=True)
    three, grad3 = _run(config, logits, targets, adv, mask, kw, softcap=softcap, two_pass=False)
    torch.testing.assert_close(two.loss, three.loss, rtol=1e-5, atol=1e-6)
    for key in three.metrics:
        torch.testing.assert_close(two.metrics[key], three.metrics[key], rtol=1e-5, atol=1e-6, equal_nan=True, msg=key)
    assert torch.equal(grad2.isnan(), grad3.isnan())
    torch.testing.assert_close(grad2.nan_to_num(0.0), grad3.nan_to_num(0.0), **TOL[dtype])
    z = logits.double().requires_grad_(True)
    capped = softcap * torch.tanh(z / softcap) if softcap else z
    logp, ent = reference.token_logprobs(capped, targets, 0.7)
    loss, _ = reference.policy_loss(logp, adv.double(), mask, config, entropy=ent,
                                    **{k: v.double() for k, v in kw.items()})
    loss.backward()
    torch.testing.assert_close(two.loss.double(), loss, rtol=1e-5, atol=1e-6)
    assert grad2[1, 2].isnan().all()  # the all −inf row: NaN on every backend, where the reference's masked row has 0
    grad2[1, 2] = z.grad[1, 2].to(grad2.dtype)
    assert torch.equal(grad2.isnan(), z.grad.isnan())
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(grad2.double().nan_to_num(0.0), z.grad.nan_to_num(0.0), **tol)


@pytest.mark.parametrize("softcap", [None, 9.0])
@pytest.mark.parametrize("name", FORWARD_PRESETS)
def test_every_forward_preset(name, softcap):
    _against_three_passes_and_reference(name, 53, torch.float32, softcap)


@pytest.mark.parametrize("softcap", [None, 9.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", VOCABS[1:])
@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_rows_held_by_clusters(name, V, dtype, softcap):
    _against_three_passes_and_reference(name, V, dtype, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_sliced_and_scaled(dtype):
    """Over the logits; from logits[:, :-1] into the parent's gradient; a declared grad_scale (no pass in the
    backward, .grad the written tensor) and an incoming gradient other than it (one scale_grad_ pass)."""
    config, logits, targets, adv, mask, kw = _case("grpo", 40001, dtype, seed=7)
    _, expected = _run(config, logits, targets, adv, mask, kw, two_pass=False)
    buffer = logits.clone()
    x = buffer.view_as(buffer).requires_grad_(True)
    out = rlkernels.fused_policy_loss(x, targets, adv, mask, config, temperature=0.7, backend="cuda", inplace=True,
                                      two_pass=True, **kw)
    torch.testing.assert_close(buffer.nan_to_num(0.0), expected.nan_to_num(0.0), **TOL[dtype])
    out.loss.backward()
    assert x.grad.data_ptr() == buffer.data_ptr()
    grads = []
    for two_pass in (True, False):
        parent = torch.cat([logits, logits[:, :1]], dim=1).requires_grad_(True)
        rlkernels.fused_policy_loss(parent[:, :-1], targets, adv, mask, config, temperature=0.7, backend="cuda",
                                    two_pass=two_pass, **kw).loss.backward()
        grads.append(parent.grad)
    assert (grads[0][:, -1] == 0).all()
    torch.testing.assert_close(grads[0].nan_to_num(0.0), grads[1].nan_to_num(0.0), **TOL[dtype])
    for incoming, declared in ((0.25, 0.25), (2.5, 1.0), (0.125, 0.5)):
        _, got = _run(config, logits, targets, adv, mask, kw, incoming=incoming, two_pass=True, grad_scale=declared)
        _, want = _run(config, logits, targets, adv, mask, kw, incoming=incoming, two_pass=False)
        tol = TOL[dtype] if incoming == declared else dict(rtol=1e-5 if dtype == torch.float32 else 2 ** -6, atol=1e-9)
        torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_grad_reads_the_incoming_gradient_on_the_device(dtype):
    base = torch.randn(3 * 1001 + 5, device=DEV).to(dtype)
    grad = base[3:3 + 3 * 1001]  # not 16-byte aligned, odd length: a head, packs and a tail
    kept, around = grad.clone(), base.clone()
    cuda.scale_grad_(grad, torch.tensor(0.1, device=DEV), 0.1)
    assert torch.equal(grad, kept)
    for loss_dtype in (torch.float32, torch.float64):
        grad.copy_(kept)
        incoming = torch.tensor(0.3, dtype=loss_dtype, device=DEV)
        cuda.scale_grad_(grad, incoming, 0.1)
        ratio = incoming.double().item() / 0.1
        expected = (kept.float() * torch.tensor(ratio, dtype=torch.float32)).to(dtype)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert torch.equal(base[:3], around[:3]) and torch.equal(base[-2:], around[-2:])  # nothing outside grad


def test_too_long_a_row_names_itself():
    config, logits, targets, adv, mask, kw = _case("grpo", 160001, torch.float32, B=1, T=2)
    with pytest.raises(ValueError, match="at most 8 blocks"):
        _run(config, logits, targets, adv, mask, kw, two_pass=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", VOCABS)
def test_the_op_is_the_forward_then_the_backward(V, dtype):
    """policy_token_fwd_grad = policy_token_fwd, then token_logprobs_bwd at scale·(g, h), h the bonus given apart;
    its gradient written into rows 1 element past a 16-byte boundary of the logits' (element by element)."""
    config, logits, targets, adv, mask, kw = _case("grpo", V, dtype, seed=3)
    flat, n = logits.reshape(-1, V), logits.shape[0] * logits.shape[1]
    args = (targets.reshape(-1), mask.reshape(-1), torch.rand(n, device=DEV), adv.reshape(-1),
            kw["old_logp"].reshape(-1), kw["ref_logp"].reshape(-1), None)
    params, bonus, scale = token_loss_params(config), torch.randn(n, device=DEV) * 0.01, 0.375
    logp, entropy, lse, g, _, stats = cuda.policy_token_fwd(flat, *args, 0.7, params, softcap=5.0)
    want = cuda.token_logprobs_bwd(flat, args[0], lse, entropy, g * scale, bonus * scale, 0.7, softcap=5.0)
    box = torch.full((n, V + 1), 7.0, device=DEV, dtype=dtype)
    got = cuda.policy_token_fwd_grad(flat, *args, bonus, 0.7, params, scale, out=box[:, 1:], softcap=5.0)
    for name, a, b in zip(("logp", "entropy", "stats"), got[:3], (logp, entropy, stats)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)
    assert (box[:, 0] == 7.0).all()
    torch.testing.assert_close(box[:, 1:].nan_to_num(0.0), want.nan_to_num(0.0), **TOL[dtype])
    assert torch.equal(box[:, 1:].isnan(), want.isnan())
