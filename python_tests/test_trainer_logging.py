"""What a run logs besides metrics.jsonl (docs/design.md §10): TensorBoard and W&B (`--report-to`), the eval's
sample completions (completions.jsonl), and the loss head's share of the update step (`time/...`).

Runs reuse test_trainer's tiny config: a few seconds each on 2 cores."""
import importlib.machinery
import json
import math
import sys
import time
import types

import numpy as np
import pytest
import torch
from test_trainer import TINY, run

from rlkernels.train import main
from rlkernels.trainer import Config, from_args, train
from rlkernels.trainer import model as trainer_model


def _lines(path):
    return [json.loads(line) for line in open(path)]


def test_tensorboard_holds_the_metrics_and_completions(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, rows = run(tmp_path, report_to=["tensorboard"])
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected = {}  # every finite number of metrics.jsonl, as TensorBoard stores it (float32)
    for r in rows:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                expected.setdefault(k, []).append((r["step"], float(np.float32(v))))
    assert sorted(events.Tags()["scalars"]) == sorted(expected) and "time/loss_head_share" in expected
    for tag, points in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(tag)] == points, tag
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("completions/text_summary")}
    completions = _lines(tmp_path / "completions.jsonl")
    assert sorted(texts) == sorted({c["step"] for c in completions}) == [0, 2, 3]  # before RL, eval_every 2, the end
    for c in completions:
        assert f"| {c['prompt']} | {c['completion']} | {c['answer']} | {c['reward']} |" in texts[c["step"]]


def test_completions_are_the_first_held_out_prompts_with_their_rewards(tmp_path):
    summary, rows = run(tmp_path, eval_completions=TINY["eval_size"])
    completions = _lines(tmp_path / "completions.jsonl")
    evals = {0: summary["eval_reward_before"], **{r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r}}
    assert sorted({c["step"] for c in completions}) == sorted(evals)
    for step, score in evals.items():
        at = [c for c in completions if c["step"] == step]
        assert len(at) == TINY["eval_size"] and len({c["prompt"] for c in at}) == len(at)
        for c in at:  # `exact`: the reward is whether the completion is the sum
            a, b = c["prompt"][:-1].split("+")
            assert c["answer"] == str(int(a) + int(b)) and c["reward"] == float(c["completion"].strip() == c["answer"])
        assert sum(c["reward"] for c in at) / len(at) == pytest.approx(score)  # every held-out prompt: the accuracy
    run(tmp_path / "none", steps=1, eval_completions=0)
    assert (tmp_path / "none" / "completions.jsonl").read_text() == ""


def test_a_resumed_run_keeps_the_completions_up_to_its_checkpoint(tmp_path):
    run(tmp_path / "full", steps=4)
    run(tmp_path / "half", steps=2)
    train(Config(resume=str(tmp_path / "half"), steps=4, progress=False))
    full = _lines(tmp_path / "full" / "completions.jsonl")
    assert _lines(tmp_path / "half" / "completions.jsonl") == full and {c["step"] for c in full} == {0, 2, 4}


def _fake_wandb(calls):
    """A stand-in for the wandb package that records what the trainer asks of it."""
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    wandb.init, wandb.Table = init, Table
    return wandb


def test_wandb_is_offline_unless_asked_and_gets_metrics_and_tables(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    summary, rows = run(tmp_path, report_to=["wandb"])
    (_, init), *logged, finish = calls
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["config"]["algo"] == "grpo"
    assert finish == ("finish",)
    metrics = [(step, data) for _, step, data in logged if "completions" not in data]
    assert [step for step, _ in metrics] == [r["step"] for r in rows]
    for (_, data), r in zip(metrics, rows):
        assert data == {k: v for k, v in r.items() if k != "step" and v is not None}
    tables = {step: data["completions"] for _, step, data in logged if "completions" in data}
    completions = _lines(tmp_path / "completions.jsonl")
    assert sorted(tables) == [0, 2, 3]
    for step, table in tables.items():
        assert table.columns == ["step", "prompt", "completion", "answer", "reward"]
        assert table.data == [[c[k] for k in table.columns] for c in completions if c["step"] == step]
    calls.clear()
    monkeypatch.setenv("WANDB_MODE", "online")
    run(tmp_path / "online", steps=1, report_to=["wandb"])
    assert calls[0][1]["mode"] == "online"


@pytest.mark.parametrize("argv, message", [
    (["--report-to", "wandb"], "--report-to wandb: needs the optional package wandb (pip install wandb), which is "
                               "not installed"),
    (["--report-to", "tensorboard"], "--report-to tensorboard: needs the optional package tensorboard"),
    (["--report-to", "none", "tensorboard"], "--report-to: none with others (none tensorboard)"),
    (["--report-to", "tb"], "--report-to: expected none, tensorboard, wandb, got 'tb'"),
    (["--eval-completions", "-1"], "--eval-completions: expected an int >= 0"),
])
def test_report_to_errors_name_the_flag(argv, message, monkeypatch, capsys):
    for package in ("wandb", "tensorboard"):
        monkeypatch.setitem(sys.modules, package, None)  # not installed
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        from_args(argv)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"rlkernels.train: error: {message}")


class _SleepInBackward(torch.autograd.Function):
    """The identity, whose backward sleeps `seconds`."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def test_loss_head_time_holds_its_forward_and_backward_and_not_the_trunk(tmp_path, monkeypatch):
    """A head that sleeps 0.05 s forward and 0.1 s backward, a trunk that sleeps 0.3 s backward: the loss head's time
    holds the head's 0.15 s (and its own work), never the trunk's 0.3 s; the update holds both."""
    real_head, real_hidden = trainer_model.loss_head, trainer_model.hidden_states

    def head(model, hidden, *args, **kw):
        time.sleep(0.05)
        return real_head(model, _SleepInBackward.apply(hidden, 0.1), *args, **kw)

    def hidden_states(*args):
        return _SleepInBackward.apply(real_hidden(*args), 0.3)

    monkeypatch.setattr(trainer_model, "loss_head", head)
    monkeypatch.setattr(trainer_model, "hidden_states", hidden_states)
    summary, rows = run(tmp_path, steps=1)
    r = rows[0]
    assert 0.15 <= r["time/loss_head_s"] < 0.3 and r["time/update_s"] >= 0.45
    assert r["time/loss_head_share"] == r["time/loss_head_s"] / r["time/update_s"]


def test_loss_head_share_of_a_plain_run(tmp_path):
    summary, rows = run(tmp_path, steps=2)
    for r in rows:
        assert 0 < r["time/loss_head_s"] < r["time/update_s"] and 0 < r["time/loss_head_share"] < 1
