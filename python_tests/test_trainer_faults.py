"""Fault injection for the trainer: a run killed with SIGKILL at a random point, or stopped with
SIGTERM or Ctrl-C (during RL, the warm-up or the evaluation before RL), then resumed, ends exactly as an
uninterrupted run; a second signal exits at once without a traceback; a torn last line of metrics.jsonl
does not block --resume.

The interrupted runs are `rlkernels.train.main` in a child forked from this process, where torch
and transformers are already imported (a fresh interpreter takes 10-15 s to import them on 2
cores); the model is test_trainer's tiny Llama on 1-digit addition, checkpointed every step."""
import json
import os
import random
import signal
import sys
import time

import pytest
import torch

from rlkernels.train import main
from rlkernels.trainer import Config, train

TINY = dict(n_layer=1, n_embd=32, n_head=2, digits=1, eval_size=16, warmup_steps=5, warmup_batch=16,
            prompts_per_step=4, num_generations=4, max_new_tokens=3, steps=6, eval_every=3, ckpt_every=1,
            progress=False)
ARGV = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    path = tmp_path_factory.mktemp("reference")
    train(Config(**TINY, out=str(path)))
    return path


def _rows(path):
    """The metrics, less the wall-clock fields."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time", "tokens_per_s"))}
            for line in open(path / "metrics.jsonl")]


def assert_same_run(path, reference, where):
    assert _rows(path) == _rows(reference), where
    got, want = (torch.load(p / "checkpoint.pt", weights_only=True) for p in (path, reference))
    assert got["step"] == want["step"] == TINY["steps"], where
    for name, w in want["model"].items():
        assert torch.equal(got["model"][name], w), (where, name)
    assert json.loads((path / "summary.json").read_text())["steps"] == TINY["steps"], where


def start_run(out, log, fault=None):
    """`python -m rlkernels.train` with the TINY flags and `--out out` in a forked child (after
    `fault()` there): its pid."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            sys.stdout = sys.stderr = open(log, "w", buffering=1)
            if fault is not None:
                fault()
            code = main([*ARGV, "--out", str(out)])
        finally:
            sys.stdout.flush()
            os._exit(code)
    return pid


def wait_for_steps(out, n, pid, timeout=120):
    """Wait until the child has written the metrics of `n` steps (0: its metrics file exists, after
    warm-up and the first evaluation); its exit status if it ended first, else None."""
    path, t0 = out / "metrics.jsonl", time.time()
    while time.time() - t0 < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if path.exists() and path.read_text().count("\n") >= n:
            return None
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the run wrote no metrics of step {n} in {timeout} s")


def die_in_third_checkpoint_write():
    """SIGKILL the process when it is about to rename its third checkpoint into place."""
    real_replace, calls = os.replace, []

    def replace(src, dst):
        if str(dst).endswith("checkpoint.pt"):  # not the model files moved in beside it
            calls.append(src)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = replace


@pytest.mark.parametrize("when", ["at random", "in a checkpoint write"])
def test_kill_9_then_resume(reference, tmp_path, when):
    out = tmp_path / "run"
    if when == "at random":
        rnd = random.Random()
        after, delay = rnd.randint(0, TINY["steps"] - 1), rnd.uniform(0, 0.4)
        where = f"killed {delay:.2f} s after the metrics of step {after}"
        pid = start_run(out, tmp_path / "log")
        if wait_for_steps(out, after, pid) is None:
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    else:
        where = "killed before renaming the checkpoint of step 3"
        pid = start_run(out, tmp_path / "log", die_in_third_checkpoint_write)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL
        assert (out / "checkpoint.pt.tmp").exists() and torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2
    if (out / "checkpoint.pt").exists():  # a stale checkpoint.pt.tmp and a torn metrics line are fine
        train(Config(resume=str(out), progress=False))
    else:  # killed before its first checkpoint: start again, as a scheduler would
        train(Config(**TINY, out=str(out)))
    assert not (out / "checkpoint.pt.tmp").exists(), where
    assert_same_run(out, reference, where)


def test_sigterm_finishes_the_step_saves_and_exits(reference, tmp_path):
    out = tmp_path / "run"
    pid = start_run(out, tmp_path / "log")
    assert wait_for_steps(out, 1, pid) is None
    os.kill(pid, signal.SIGTERM)
    status = os.waitpid(pid, 0)[1]
    log = (tmp_path / "log").read_text()
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM, log  # not a finished run, for a scheduler
    step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    assert 1 <= step < TINY["steps"] and len(_rows(out)) == step
    assert "SIGTERM: finishing this step, then saving a checkpoint" in log and f"stopped at step {step}" in log
    assert f"continue with: rlkernels train --resume {out}" in log
    train(Config(resume=str(out), progress=False))
    assert_same_run(out, reference, f"SIGTERM at step {step}")


def test_a_torn_metrics_line_does_not_block_resume(reference, tmp_path):
    train(Config(**{**TINY, "steps": 3}, out=str(tmp_path)))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward_mean": 0.2')  # the write of step 4 cut short by a kill
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropping its unparsable last line 4"):
        train(Config(resume=str(tmp_path), steps=TINY["steps"], progress=False))
    assert_same_run(tmp_path, reference, "a torn line after step 3")


def signal_in(where, sig, times=1):
    """Send `sig` to this process `times` times when it enters `where`: the warm-up's second batch, or the
    evaluation before RL (the first evaluation: TINY's warm-up makes no checks)."""
    from rlkernels.trainer import generation, task

    module, name, call = (task, "supervised_batch", 2) if where == "warm-up" else (generation, "evaluate", 1)
    real, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            for _ in range(times):
                os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    return lambda: setattr(module, name, patched)


@pytest.mark.parametrize("where, sig", [("warm-up", signal.SIGTERM), ("evaluation", signal.SIGINT)])
def test_a_signal_before_rl_saves_where_rl_starts(reference, tmp_path, where, sig):
    out = tmp_path / "run"
    pid = start_run(out, tmp_path / "log", signal_in(where, sig))
    status = os.waitpid(pid, 0)[1]
    log = (tmp_path / "log").read_text()
    assert os.waitstatus_to_exitcode(status) == 128 + sig, log  # 130 for Ctrl-C, 143 for SIGTERM
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert f"{name}: finishing the warm-up and the evaluation before RL, then saving a checkpoint" in log
    assert "stopped before step 1" in log and "Traceback" not in log
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 0 and _rows(out) == []
    train(Config(resume=str(out), progress=False))
    assert_same_run(out, reference, f"{name} in the {where}")


def test_a_second_signal_interrupts_at_once_without_a_traceback(tmp_path):
    pid = start_run(tmp_path / "run", tmp_path / "log", signal_in("warm-up", signal.SIGINT, times=2))
    status = os.waitpid(pid, 0)[1]
    log = (tmp_path / "log").read_text()
    assert os.waitstatus_to_exitcode(status) == 130, log
    assert "rlkernels.train: interrupted;" in log and "Traceback" not in log


def test_resume_re_exports_a_model_older_than_its_checkpoint(tmp_path, capsys):
    """Issue 33: a SIGKILL after the last step's checkpoint.pt and before the model export left the run folder's
    model one checkpoint behind for good (--resume found no step left and exported nothing)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    train(Config(**{**TINY, "steps": 2}, out=str(out)))
    weights = out / "model.safetensors"
    before = load_file(weights)
    train(Config(resume=str(out), steps=3, progress=False))
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    stale = os.path.getmtime(out / "checkpoint.pt") - 60
    from safetensors.torch import save_file
    save_file(before, weights)  # the export of step 2, as a kill before step 3's export would leave it
    os.utime(weights, (stale, stale))
    capsys.readouterr()
    train(Config(resume=str(out), progress=False))
    assert "exported the model of step 3" in capsys.readouterr().out
    after = load_file(weights)
    assert all(torch.equal(after[k], saved[k]) for k in after) and any(not torch.equal(after[k], before[k]) for k in after)
