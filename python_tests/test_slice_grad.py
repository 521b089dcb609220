"""A view's gradient is autograd's. `token_logprobs` and `fused_policy_loss` write the gradient of a slice
such as `model(x).logits[:, :-1]` straight into its parent (docs/design.md §4) only when one plain view op
lies between them and no hook or retain_grad is on the slice. An autograd.Function that returns its input
as a view (gradient reversal, gradient scaling, tensor-parallel identity regions), a hook, or retain_grad
takes autograd's own path. Each case is compared with autograd through the reference composition
(`reference.py`) on the same view of a copy of the parent.
"""
import numpy as np
import pytest
import torch

import rlkernels
from rlkernels import _backend, presets, reference
from rlkernels.ops._rows import logits_rows

BACKENDS = ["torch", "cpu"] + (["triton"] if _backend.backend_info()["triton"]["available"]
                               and _backend._device_ok("triton", torch.device("cpu")) else [])
B, T, V = 3, 4, 12


class _Scale(torch.autograd.Function):
    """The identity forward, returning its input as a view; the gradient times `scale` (−1: gradient reversal)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _hooked(x, calls):
    x.register_hook(lambda g: calls.append(1) or 2 * g)
    return x


def _retained(x, kept):
    x.retain_grad()
    kept.append(x)
    return x


# name -> make(parent, kept, calls): the logits handed to the op; `kept`: tensors whose .grad autograd retains
VIEWS = {
    "gradient reversal": lambda p, kept, calls: _Scale.apply(p, -1.0)[:, :-1],
    "gradient scaling": lambda p, kept, calls: _Scale.apply(p, 0.1)[:, :-1],
    "scaling of the slice": lambda p, kept, calls: _Scale.apply(p[:, :-1], 0.1),
    "hook": lambda p, kept, calls: _hooked(p[:, :-1], calls),
    "hook on an inner view": lambda p, kept, calls: _hooked(p.view_as(p), calls)[:, :-1],
    "retain_grad": lambda p, kept, calls: _retained(p[:, :-1], kept),
    "retain_grad on an inner view": lambda p, kept, calls: _retained(p.view_as(p), kept)[:, :-1],
}


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    parent = torch.randn(B, T + 1, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)
    return parent, targets, weights, g


def _token_loss(logp, entropy, weights):
    return (weights * logp + entropy.cos()).sum()


def _run(make, parent, loss_of):
    """(∂parent, the retained gradients, how many times the hooks ran) of `loss_of(make(parent))`."""
    leaf = parent.clone().requires_grad_(True)
    kept, calls = [], []
    loss_of(make(leaf, kept, calls)).backward()
    return leaf.grad, [t.grad for t in kept], len(calls)


def _compare(got, want):
    """`got` (fp32) equals `want` (fp64): the parent's gradient, the retained ones and the hooks' calls."""
    (grad, kept, calls), (want_grad, want_kept, want_calls) = got, want
    torch.testing.assert_close(grad, want_grad.float(), rtol=1e-5, atol=1e-6)
    assert calls == want_calls and len(kept) == len(want_kept)
    for a, b in zip(kept, want_kept):
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", list(VIEWS))
def test_token_logprobs_of_a_view_has_autograds_gradient(backend, view):
    parent, targets, weights, _ = _inputs(1)
    make = VIEWS[view]
    got = _run(make, parent.float(), lambda x: _token_loss(
        *rlkernels.token_logprobs(x, targets, temperature=0.7, return_entropy=True, backend=backend), weights.float()))
    want = _run(make, parent, lambda x: _token_loss(*reference.token_logprobs(x, targets, temperature=0.7), weights))
    _compare(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_fused_policy_loss_of_a_view_has_autograds_gradient(backend, view, name):
    parent, targets, _, g = _inputs(2)
    config = presets.get(name)
    mask = torch.rand(B, T, generator=g) > 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    old = reference.token_logprobs(parent[:, :-1], targets)[0]  # on-policy: GSPO's narrow band passes the gradient
    kw = dict(old_logp=old, ref_logp=old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64))
    make = VIEWS[view]
    got = _run(make, parent.float(), lambda x: rlkernels.fused_policy_loss(
        x, targets, adv.float(), mask, config, backend=backend, **{k: v.float() for k, v in kw.items()}).loss)
    want = _run(make, parent, lambda x: reference.policy_loss(reference.token_logprobs(x, targets)[0], adv, mask,
                                                              config, **kw)[0])
    _compare(got, want)


def test_only_a_plain_view_without_hooks_goes_to_the_parent():
    """The parent is written in place for one slice or select of a leaf or of a computed tensor; every case above
    (a Function's node, two view ops, a hook, retain_grad) is left to autograd."""
    leaf = torch.randn(B, T + 1, V, requires_grad=True)
    for parent in (leaf, leaf * 2.0):
        for view in (parent[:, :-1], parent[1], parent[:, -3:-1]):
            rows = logits_rows(view, to_parent=True)
            assert rows.grad_input is parent and rows.box is not None
    for view, make in VIEWS.items():
        rows = logits_rows(make(leaf * 2.0, [], []), to_parent=True)
        assert rows.box is None, view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["empty_strided", "numpy"])
def test_a_parent_with_a_stride_0_dimension(backend, source):
    """A size-1 dimension may have any stride (0 from numpy's newaxis, DLPack, empty_strided): it is still a
    contiguous parent, and its slice's gradient is the reference's."""
    parent, targets, weights, _ = _inputs(3)
    parent, targets, weights = parent[:1].float(), targets[:1], weights[:1].float()
    if source == "numpy":
        leaf = torch.from_numpy(np.ascontiguousarray(parent[0].numpy())[None])
    else:
        leaf = torch.empty_strided(parent.shape, (0, V, 1)).copy_(parent)
    assert leaf.stride(0) == 0 and leaf.is_contiguous()
    leaf.requires_grad_(True)
    _token_loss(*rlkernels.token_logprobs(leaf[:, :-1], targets, return_entropy=True, backend=backend),
                weights).backward()
    copy = parent.clone().requires_grad_(True)
    _token_loss(*reference.token_logprobs(copy[:, :-1], targets), weights).backward()
    torch.testing.assert_close(leaf.grad, copy.grad, rtol=1e-5, atol=1e-6)
