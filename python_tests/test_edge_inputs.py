"""Empty batches, unusual devices and bad arguments on the loss paths: a defined result or a
clear error naming the argument, never a crash deep inside, a NaN or a silent wrong answer."""
import pytest
import torch

import rlkernels
from rlkernels import presets

from loss_inputs import preset

V, H = 11, 4


def _config(name):
    config = preset(name)
    return config.replace(group_size=1) if config.ratio in ("group_expectation", "snis") else config


def _loss_args(name, B, T):
    config = _config(name)
    adv = None if config.ratio == "snis" else torch.randn(B)
    kw = dict(old_logp=torch.zeros(B, T), ref_logp=torch.zeros(B, T), rewards=torch.randn(B))
    return config, adv, torch.ones(B, T, dtype=torch.bool), kw


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("name", presets.NAMES)
def test_empty_batches_give_a_zero_loss(name, shape):
    B, T = shape
    config, adv, mask, kw = _loss_args(name, B, T)
    targets = torch.zeros(B, T, dtype=torch.long)
    x = torch.randn(B, T, V, requires_grad=True)
    h, w = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    outs = [rlkernels.policy_loss(torch.zeros(B, T), adv, mask, config, **kw),
            rlkernels.fused_policy_loss(x, targets, adv, mask, config, **kw),
            rlkernels.fused_linear_policy_loss(h, w, targets, adv, mask, config, **kw)]
    outs[1].loss.backward()
    outs[2].loss.backward()
    for out in outs:
        assert float(out.loss) == 0.0
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values()), out.metrics
    assert x.grad.shape == x.shape and (w.grad == 0).all()


def test_meta_tensors_trace_without_reading_values():
    B, T = 2, 3
    meta = lambda *s: torch.zeros(*s, device="meta")  # noqa: E731
    for name in ("grpo", "gspo"):
        out = rlkernels.policy_loss(meta(B, T), meta(B), torch.ones(B, T, dtype=torch.bool, device="meta"),
                                    presets.get(name), ref_logp=meta(B, T))
        assert out.loss.device.type == "meta"


def test_bad_arguments_name_the_argument():
    B, T = 2, 3
    mask, targets = torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.long)
    x = torch.randn(B, T, V, requires_grad=True)
    h, w = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    cfg, kw = presets.grpo(), dict(ref_logp=torch.zeros(B, T))
    with pytest.raises(ValueError, match="advantages: expected a tensor on cpu"):
        rlkernels.policy_loss(torch.zeros(B, T), torch.zeros(B, device="meta"), mask, cfg, **kw)
    with pytest.raises(ValueError, match="rewards"):
        rlkernels.policy_loss(torch.zeros(B, T), None, mask, presets.snis(group_size=1), rewards=torch.zeros(B, device="meta"))
    with pytest.raises(ValueError, match="logits"):
        rlkernels.fused_policy_loss([1, 2], targets, None, mask, cfg)
    with pytest.raises(ValueError, match="mask: expected shape"):
        rlkernels.fused_linear_policy_loss(h, w, targets, torch.zeros(B), mask.t(), cfg, **kw)
    with pytest.raises(TypeError, match="process_group"):
        rlkernels.fused_linear_policy_loss(h, w, targets, torch.zeros(B), mask, cfg, process_group=object(), **kw)
    for tau in (1e-45, 1e-39):
        with pytest.raises(ValueError, match="temperature"):
            rlkernels.token_logprobs(x, targets, temperature=tau)
        with pytest.raises(ValueError, match="temperature"):
            rlkernels.fused_policy_loss(x, targets, torch.zeros(B), mask, cfg, temperature=tau, **kw)
        with pytest.raises(ValueError, match="temperature"):
            rlkernels.linear_token_logprobs(h, w, targets, temperature=tau)
    values = torch.zeros(B, T)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="num_items"):
            rlkernels.value_loss(values, values, values, mask, num_items=bad)
        with pytest.raises(ValueError, match="num_seqs"):
            rlkernels.value_loss(values, values, values, mask, num_seqs=bad)
    for returns in (torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="returns"):
            rlkernels.value_loss(values, values, returns, mask)


def test_create_graph_is_refused_clearly():
    B, T = 2, 3
    mask, targets = torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.long)
    x = torch.randn(B, T, V, requires_grad=True)
    h, w = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    for out, leaf in ((rlkernels.fused_policy_loss(x, targets, torch.randn(B), mask, presets.dapo()), x),
                      (rlkernels.fused_linear_policy_loss(h, w, targets, torch.randn(B), mask, presets.dapo()), h)):
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(out.loss, leaf, create_graph=True)


AVAILABLE = rlkernels.backend_info()
# every backend on the tensors it runs on (Triton on CPU tensors under its interpreter)
DEVICE_BACKENDS = [(b, "cpu") for b in ("torch", "cpu") if AVAILABLE[b]["available"]]
DEVICE_BACKENDS += ([("cuda", "cuda"), ("triton", "cuda")] if torch.cuda.is_available() else
                    [("triton", "cpu")] if AVAILABLE["triton"]["available"] else [])


@pytest.mark.parametrize("backend,device", DEVICE_BACKENDS)
def test_higher_order_gradients_of_the_log_probs_are_refused(backend, device):
    """A gradient penalty through the kernels' log-probs once lost its second derivative silently (cpu: 0 where
    fp64 gives 0.356; linear_token_logprobs: a gradient without a graph); every backend now refuses by name."""
    B, T = 2, 3
    targets = torch.zeros(B, T, dtype=torch.long, device=device)
    logits = torch.randn(B, T + 1, V, device=device, requires_grad=True)  # whole (the op's autograd) and sliced
    h = torch.randn(B, T, H, device=device, requires_grad=True)
    w = torch.randn(V, H, device=device, requires_grad=True)
    cases = [("token_logprobs", logits[:, :T].contiguous(), logits), ("token_logprobs", logits[:, :T], logits),
             ("linear_token_logprobs", h, h)]
    for name, x, leaf in cases:
        logp = (rlkernels.token_logprobs(x, targets, backend=backend) if x is not h else
                rlkernels.linear_token_logprobs(h, w, targets, backend=backend))
        out = rlkernels.policy_loss(logp, torch.ones(B, device=device), torch.ones(B, T, dtype=torch.bool, device=device),
                                    presets.gpg())
        with pytest.raises(RuntimeError, match=f"create_graph=True is not supported by {name}"):
            torch.autograd.grad(out.loss, leaf, create_graph=True)


# every preset on the compiled and torch backends; under the (slow) Triton interpreter one per route: the forward
# kernel, the sequence step, the covariance step
TRANSPOSED_CASES = [(n, b) for b, device in DEVICE_BACKENDS if device == "cpu" and b != "triton" for n in presets.NAMES]
TRANSPOSED_CASES += [(n, "triton") for n in ("dapo", "gspo", "kl_cov") if ("triton", "cpu") in DEVICE_BACKENDS]


@pytest.mark.parametrize("name,backend", TRANSPOSED_CASES)
def test_transposed_inputs_equal_contiguous_ones(name, backend):
    """A mask (and log-probs, advantages) given as transposed views: the fused ops once crashed in `view(-1)`."""
    B, T = 4, 5
    g = torch.Generator().manual_seed(0)
    config, adv, _, _ = _loss_args(name, B, T)
    mask_t = torch.rand(T, B, generator=g) > 0.2
    old_t = -torch.rand(T, B, generator=g)
    if config.ratio == "token":
        adv = torch.randn(T, B, generator=g).t()
    targets = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    kw = dict(rewards=torch.randn(B, generator=g), ref_logp=old_t.t() - 0.1)
    for op, args in ((rlkernels.fused_policy_loss, (logits,)), (rlkernels.fused_linear_policy_loss, (hidden, weight))):
        grads = []
        for mask, old, a in ((mask_t.t(), old_t.t(), adv), (mask_t.t().contiguous(), old_t.t().contiguous(),
                                                               None if adv is None else adv.contiguous())):
            leaf = args[0].clone().requires_grad_(True)
            torch.manual_seed(0)  # Clip-Cov's draw
            out = op(leaf, *args[1:], targets, a, mask, config, old_logp=old, backend=backend, **kw)
            out.loss.backward()
            grads.append((out.loss, leaf.grad))
        torch.testing.assert_close(grads[0], grads[1])


def test_counts_groups_and_small_inputs_are_checked():
    B, T = 4, 3
    logp, mask = -torch.rand(B, T), torch.ones(B, T, dtype=torch.bool)
    for dtype, tiny in ((torch.float32, 1e-39), (torch.float64, 1e-320)):  # 1/x overflows: the loss was -inf
        for name in ("num_items", "num_seqs"):
            with pytest.raises(ValueError, match=name):
                rlkernels.policy_loss(logp.to(dtype), torch.ones(B), mask, presets.dapo(), **{name: tiny})
    out = rlkernels.policy_loss(logp.double(), torch.ones(B), mask, presets.dapo(), num_items=1e-300)
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="group_ids: expected shape"):  # once ignored by token-level ratios
        rlkernels.policy_loss(logp, torch.ones(B), mask, presets.dapo(), group_ids=torch.zeros(B + 1, dtype=torch.long))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    snis = presets.snis(group_size=2)
    same = rlkernels.policy_loss(logp, None, mask, snis, rewards=rewards, group_ids=torch.tensor([5, 5, 2, 2]))
    torch.testing.assert_close(same.loss, rlkernels.policy_loss(logp, None, mask, snis, rewards=rewards).loss)
    for ids in ([0, 1, 0, 1], [0, 0, 0, 0], [3, 3, 3, 4]):  # once silently overriding group_size
        with pytest.raises(ValueError, match="group_ids: expected the groups of config.group_size=2"):
            rlkernels.policy_loss(logp, None, mask, snis, rewards=rewards, group_ids=torch.tensor(ids))
