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
