"""`ops._plan.plan`: the one decision of which step evaluates a config, made without a warning."""
from __future__ import annotations

import warnings

import pytest

from rlkernels import _backend, presets
from rlkernels.ops._plan import Plan, Step, plan, warn_general_path

CPU_OK = _backend.backend_info()["cpu"]["available"]

CASES = [  # (config, step with the forward pass, step once the log-probs are there)
    (presets.grpo(), Step.FORWARD, Step.SEQUENCE),
    (presets.topr(kl_estimator="abs", kl_coef=0.1), Step.FORWARD, Step.SEQUENCE),
    (presets.dapo(off_policy_mask=0.5), Step.SEQUENCE, Step.SEQUENCE),
    (presets.gspo(), Step.SEQUENCE, Step.SEQUENCE),
    (presets.clip_cov(), Step.COVARIANCE, Step.COVARIANCE),
    (presets.dapo(kl_estimator="mse", kl_coef=0.1), Step.AUTOGRAD, Step.AUTOGRAD),
    (presets.gspo(kl_estimator="abs+", kl_coef=0.1), Step.AUTOGRAD, Step.AUTOGRAD),
]


@pytest.mark.skipif(not CPU_OK, reason="the cpu backend is not built")
@pytest.mark.parametrize("config,with_forward,after_logprobs", CASES)
def test_plan_picks_the_step_without_warning(config, with_forward, after_logprobs):
    kernels = _backend.kernels("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan(config, kernels).step is with_forward
        assert plan(config, kernels, forward=False).step is after_logprobs
        assert plan(config, _backend.kernels("torch")).step is Step.AUTOGRAD  # no kernel ops: autograd of losses/


def test_warning_names_what_the_kernels_lack_once():
    lacking = plan(presets.dapo(kl_estimator="mse", kl_coef=0.1), _backend.kernels("torch"))
    assert lacking == Plan(Step.AUTOGRAD, "objective='clip' with kl_estimator='mse'")
    with pytest.warns(UserWarning, match="the test-backend kernels do not evaluate objective='clip' with kl_est"):
        warn_general_path(lacking, "test-backend")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_general_path(lacking, "test-backend")  # said once
        warn_general_path(lacking, "torch")  # the torch backend has no kernels to lack
        gspo = plan(presets.gspo(), _backend.kernels("torch"))
        warn_general_path(gspo, "test-backend")  # a sequence-level ratio: not token-level


@pytest.mark.skipif(not CPU_OK, reason="the cpu backend is not built")
@pytest.mark.parametrize("preset,in_kernel", [("grpo", True), ("dapo", True), ("gspo", False), ("clip_cov", False)])
def test_both_fused_ops_behave_alike_without_a_gradient(preset, in_kernel):
    """Without a gradient both ops take the same step: the forward kernel where it has the loss (its statistics
    are the loss: one pass), else the composition `policy_loss(logprobs)` (no derivatives nobody asks for);
    either way the value of the call with a gradient."""
    import torch

    import rlkernels
    from benchmarks.launches import count, loss_inputs

    config, targets, adv, mask, kw = loss_inputs(preset, B=4, T=16)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(*targets.shape, 32, generator=g)
    weight = torch.randn(1000, 32, generator=g) / 32 ** 0.5
    logits = hidden @ weight.t()
    calls = {
        "logits": lambda x: rlkernels.fused_policy_loss(x, targets, adv, mask, config, backend="cpu", **kw),
        "hidden": lambda h: rlkernels.fused_linear_policy_loss(h, weight, targets, adv, mask, config, backend="cpu",
                                                               chunk_size=24, **kw),
    }
    for name, x in (("logits", logits), ("hidden", hidden)):
        torch.manual_seed(0)  # Clip-Cov draws its tokens
        with_grad = calls[name](x.clone().requires_grad_(True))
        torch.manual_seed(0)
        with torch.no_grad():
            c = count(lambda: calls[name](x))
        torch.manual_seed(0)
        with torch.no_grad():
            without = calls[name](x)
        assert (c.names.get("rlkernels_C::policy_token_fwd", 0) > 0) == in_kernel, (name, c.names)
        assert c.names.get("rlkernels_C::token_logprobs_bwd", 0) == 0, (name, c.names)  # no gradient pass
        torch.testing.assert_close(without.loss, with_grad.loss.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_the_loss_arguments_are_declared_once():
    """`policy_loss` and both fused ops list the keyword arguments `LossInputs.build` declares, with its defaults;
    a misspelt one is a TypeError naming the function and the keyword (not a silent default)."""
    import inspect

    import torch

    import rlkernels
    from rlkernels.losses.inputs import LOSS_ARGS, LossInputs

    build = inspect.signature(LossInputs.build).parameters
    for fn in (rlkernels.policy_loss, rlkernels.fused_policy_loss, rlkernels.fused_linear_policy_loss):
        params = inspect.signature(fn).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), fn.__name__
        for name in LOSS_ARGS:
            assert params[name].kind is params[name].KEYWORD_ONLY and params[name].default is build[name].default
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"policy_loss\(\) got an unexpected keyword argument 'old_logps'"):
        rlkernels.policy_loss(logp, torch.zeros(2), mask, presets.grpo(), old_logps=logp)
    with pytest.raises(TypeError, match=r"fused_policy_loss\(\) got an unexpected keyword argument 'chunk_size'"):
        rlkernels.fused_policy_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2), mask,
                                    presets.grpo(), chunk_size=4)
