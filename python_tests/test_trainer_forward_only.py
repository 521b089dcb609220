"""Issue 37's memory section: a forward of an op with grad enabled and no backward writes (two-pass) or keeps
(three-pass) what the backward needs, the whole N × V gradient on the default two-pass path. The trainer must never
pay it: every op call whose outputs are in an autograd graph has its backward run, and the forward-only ones (ℓ_old,
the reference, evaluation, the head check) run without a graph. Counted on real runs of each loss path (the TRL
drop-in: test_integration_trl.py)."""
import pytest
from op_calls import count_op_calls, forward_only_in_a_graph
from test_trainer import run

import rlkernels

OPS = ("token_logprobs", "fused_policy_loss", "fused_linear_policy_loss", "linear_token_logprobs")


@pytest.mark.parametrize("loss_path", ["linear", "fused", "split"])
def test_every_op_call_in_a_graph_gets_its_backward(tmp_path, monkeypatch, loss_path):
    calls = count_op_calls(monkeypatch, rlkernels, OPS)
    run(tmp_path, steps=2, loss_path=loss_path)
    assert any(c["graph"] for c in calls) and not all(c["graph"] for c in calls)  # updates, and forward-only calls
    assert not forward_only_in_a_graph(calls)
