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
