"""The trainer (docs/design.md §10): short end-to-end runs per algorithm family, exact resume, the
non-finite guard, the log-probs it records, and errors for bad configs, rewards, files and
checkpoints (kills and signals: test_trainer_faults.py; several processes and gradient
checkpointing: test_trainer_parallel.py).

Runs use a 1-layer, 32-wide Llama on 1-digit addition: a few seconds each on 2 cores."""
import contextlib
import json
import math
import os
import re
import shutil

import pytest
import torch

from rlkernels.train import main
from rlkernels.trainer import Config, config_parts, from_args, generation, rewards, run_folder, task, train
from rlkernels.trainer import model as trainer_model

TINY = dict(n_layer=1, n_embd=32, n_head=2, digits=1, eval_size=16, warmup_steps=5, warmup_batch=16,
            prompts_per_step=4, num_generations=4, max_new_tokens=3, steps=3, eval_every=2, ckpt_every=2,
            progress=False)
REQUIRED = ("step", "reward_mean", "kl", "entropy", "clip_frac", "loss")


def run(tmp, **kw):
    cfg = Config(**{**TINY, "out": str(tmp), **kw})
    summary = train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))]
    return summary, rows


def check_run(tmp, summary, rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for k in REQUIRED:
            assert r[k] is not None and math.isfinite(r[k]), (k, r)
        assert r["skipped"] == 0
    on_disk = json.load(open(os.path.join(tmp, "summary.json")))
    for k in ("eval_reward_before", "eval_reward_after"):
        assert 0.0 <= summary[k] <= 1.0 and on_disk[k] == summary[k]
    assert os.path.getsize(os.path.join(tmp, "metrics.png")) > 1000
    ckpt = torch.load(os.path.join(tmp, "checkpoint.pt"), weights_only=True)  # what --resume loads
    assert ckpt["step"] == steps and ckpt["config"]["algo"] == summary["algo"]


@pytest.mark.parametrize("algo, extra", [
    ("grpo", {}),
    ("gspo", {"loss_path": "split"}),
    ("grpo", {"loss_path": "fused"}),
    ("ppo", {"critic": "shared", "kl_target": 0.01}),
    ("ppo", {"critic": "separate", "epochs": 2}),
])
def test_end_to_end(tmp_path, algo, extra):
    summary, rows = run(tmp_path, algo=algo, **extra)
    check_run(tmp_path, summary, rows, 3)
    # the first mini-batch of the first step is on-policy: ℓ_old was recorded by the same forward
    assert rows[0]["updates"] == 2 * extra.get("epochs", 1) and rows[0]["ratio_max"] < 3
    if algo == "ppo":
        assert "value_loss" in rows[0] and rows[0]["kl_coef"] > 0


@pytest.mark.parametrize("algo", ["dr_grpo", "dapo", "gspo_token", "fspo", "gepo", "cispo", "gmpo", "snis", "gpg",
                                  "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "dro", "luspo", "vespo"])
def test_every_preset_runs(tmp_path, algo):
    summary, rows = run(tmp_path, algo=algo, steps=2, eval_every=5)
    check_run(tmp_path, summary, rows, 2)


def test_warmup_stops_at_its_target_reached_twice_in_a_row(tmp_path, monkeypatch, capsys):
    """The demo's warm-up checks the held-out reward every warmup_eval_every steps (not at its last step, which the
    reward before RL measures) and stops at the second check in a row at or above the target."""
    real, script, calls = generation.evaluate, iter([0.5, 0.1, 0.6, 0.7]), []  # the checks at steps 5, 10, 15, 20

    def evaluate(*args, **kw):
        calls.append(1)
        value = next(script, None)
        return real(*args, **kw) if value is None else (value, [])

    monkeypatch.setattr(generation, "evaluate", evaluate)
    run(tmp_path / "a", steps=1, warmup_steps=40, warmup_eval_every=5, warmup_target=0.5)
    # 4 checks, then the evaluations before RL and after its step
    assert len(calls) == 4 + 2 and "warm-up: 20 supervised steps (stopped at the target twice" in capsys.readouterr().out
    calls.clear()
    run(tmp_path / "b", steps=1, warmup_steps=20, warmup_eval_every=5, warmup_target=2.0)
    assert len(calls) == 3 + 2  # at 5, 10, 15: none at the last step, which the evaluation before RL measures
    assert "warm-up: 20 supervised steps (stopped at --warmup-steps)" in capsys.readouterr().out
    calls.clear()
    run(tmp_path / "c", steps=1, warmup_steps=20, warmup_eval_every=5, warmup_target=None)
    assert len(calls) == 2 and "warm-up: 20 supervised steps (stopped at --warmup-steps)," in capsys.readouterr().out


def test_dr_grpo_divides_by_the_max_completion_length():
    cfg = config_parts.loss_config(Config(**{**TINY, "algo": "dr_grpo", "max_new_tokens": 7}), 4)
    assert (cfg.agg, cfg.norm_length) == ("constant", 7)
    assert config_parts.loss_config(Config(**{**TINY, "algo": "grpo"}), 4).norm_length is None


@pytest.mark.parametrize("extra", [
    {"pods_keep": 2},
    {"algo": "dapo", "dynamic_sampling": True, "overlong_buffer": 1},
    {"tree": True, "tree_roots": 2},
])
def test_options_run(tmp_path, extra):
    summary, rows = run(tmp_path, steps=2, eval_every=5, **extra)
    assert len(rows) == 2 and all(math.isfinite(r["reward_mean"]) for r in rows)
    if "pods_keep" in extra:
        assert rows[0]["rows_trained"] == TINY["prompts_per_step"] * 2


def _strip(rows):
    """The metrics, less the wall-clock fields (time_s, time/..., tokens_per_s)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s"))} for r in rows]


def test_resume_is_exact(tmp_path):
    _, full = run(tmp_path / "full", steps=4)
    run(tmp_path / "half", steps=2)
    summary = train(Config(resume=str(tmp_path / "half"), steps=4, progress=False))
    resumed = [json.loads(line) for line in open(tmp_path / "half" / "metrics.jsonl")]
    assert _strip(resumed) == _strip(full)
    assert summary["steps"] == 4


def strict_json(text):
    """json.loads without Python's NaN / Infinity extension."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))


def _with_loss_head(monkeypatch, change):
    real = trainer_model.loss_head

    def head(*args, **kw):
        out = real(*args, **kw)
        return type(out)(*change(out.loss, dict(out.metrics)))

    monkeypatch.setattr(trainer_model, "loss_head", head)


def test_non_finite_loss_never_reaches_the_weights(tmp_path, monkeypatch):
    _with_loss_head(monkeypatch, lambda loss, metrics: (loss * float("nan"), metrics))
    summary, rows = run(tmp_path, steps=1)
    assert rows[0]["skipped"] == 2 and rows[0]["updates"] == 0 and summary["skipped_steps"] == 2
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    for name, w in ckpt["model"].items():  # "ref" is the policy as RL started
        assert torch.equal(w, ckpt["ref"][name]), name


def test_metrics_are_strict_json(tmp_path, monkeypatch):
    """A non-finite metric is written as null, never as Python's bare NaN (invalid JSON)."""
    _with_loss_head(monkeypatch, lambda loss, metrics: (loss, {**metrics, "entropy": torch.tensor(float("nan"))}))
    run(tmp_path, steps=1)
    rows = [strict_json(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["entropy"] is None and rows[0]["updates"] == 2
    assert strict_json((tmp_path / "summary.json").read_text())["final_entropy"] is None


def nan_reward(prompt, completion, answer):
    return float("nan")


def inf_reward(prompt, completion, answer):
    return -math.inf


def huge_reward(prompt, completion, answer):  # finite in float64, inf in float32
    return 1e300


def none_reward(prompt, completion, answer):
    return None


def list_reward(prompt, completion, answer):
    return [1.0]


def tensor_reward(prompt, completion, answer):
    return torch.tensor(1.0)


def raising_reward(prompt, completion, answer):
    raise KeyError("no such answer")


@pytest.mark.parametrize("name, what", [
    ("nan_reward", "returned nan"), ("inf_reward", "returned -inf"), ("huge_reward", "returned 1e\\+300"),
    ("none_reward", "returned None"), ("list_reward", "returned \\[1.0\\]"), ("tensor_reward", "returned tensor"),
    ("raising_reward", "raised KeyError"),
])
def test_bad_rewards_are_errors_naming_the_reward_and_prompt(tmp_path, name, what):
    with pytest.raises(ValueError, match=rf"^--reward: module:test_trainer:{name} {what}.* on prompt '\d\+\d='"):
        run(tmp_path, warmup_steps=0, reward=f"module:test_trainer:{name}")


def zero_reward(prompt, completion, answer):
    return 0


def one_reward(prompt, completion, answer):
    return 1.0


CALLS = [0]


def half_varied_reward(prompt, completion, answer):
    """Alternating 0, 1 for prompts starting with an odd digit (a group of varied rewards), else 0."""
    CALLS[0] += 1
    return float(int(prompt[0]) % 2 == 1 and CALLS[0] % 2 == 0)


@pytest.mark.parametrize("reward", ["zero_reward", "one_reward"])
def test_dynamic_sampling_with_only_uniform_groups_skips_the_update(tmp_path, reward, capsys):
    summary, rows = run(tmp_path, steps=2, eval_every=5, dynamic_sampling=True, max_gen_batches=3,
                        reward=f"module:test_trainer:{reward}")
    for r in rows:
        assert (r["rows_trained"], r["groups"], r["updates"], r["gen_batches"]) == (0, 0, 0, 3), r
        assert r["reward_mean"] == float(reward == "one_reward") and r["loss"] is None
    assert "no group with unequal rewards in 3 rollout batches (--dynamic-sampling); update skipped" in capsys.readouterr().out
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    for name, w in ckpt["model"].items():
        assert torch.equal(w, ckpt["ref"][name]), name


def test_dynamic_sampling_refills_the_batch(tmp_path):
    """DAPO: rollouts continue until prompts_per_step groups with varied rewards are kept."""
    summary, rows = run(tmp_path, steps=2, eval_every=5, algo="dapo", dynamic_sampling=True, max_gen_batches=8,
                        reward="module:test_trainer:half_varied_reward")
    assert any(r["gen_batches"] > 1 for r in rows)
    for r in rows:
        assert r["groups"] == TINY["prompts_per_step"] and r["rows_trained"] == TINY["prompts_per_step"] * 4, r
        assert r["updates"] == 2


def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # unpickling would call os.mkdir(marker)
            return os.mkdir, (str(marker),)

    (tmp_path / "r").mkdir()
    torch.save({"config": {}, "step": 1, "model": Payload()}, tmp_path / "r" / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"--resume: refusing .*checkpoint.pt.*posix.mkdir"):
        train(Config(resume=str(tmp_path / "r")))
    assert main(["--resume", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlkernels.train: error: --resume: refusing") and err.count("\n") == 1
    assert not marker.exists()


def test_checkpoints_are_fsynced_and_stale_temp_files_removed(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b)))
    tmp = str(tmp_path / "checkpoint.pt.tmp")
    run_folder.write_atomically(str(tmp_path / "checkpoint.pt"), lambda f: torch.save({"step": 1}, f))
    assert events == [("fsync", tmp), ("replace", tmp)]
    # a kill during a save leaves the temp file: the resumed run removes it
    open(tmp, "wb").write(b"half a checkpoint")
    run_folder.prepare_out_dir(str(tmp_path), resuming=True).release()
    assert not os.path.exists(tmp) and os.path.exists(tmp_path / "checkpoint.pt")


@pytest.mark.parametrize("torch_says", ["[enforce fail at inline_container.cc:778] . basic_ios::clear: iostream error",
                                        "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"])
def test_a_full_disk_is_a_one_line_error(tmp_path, monkeypatch, torch_says):
    def full(obj, f):
        f.write(b"part")
        raise RuntimeError(torch_says)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ValueError, match=r"^--out: cannot write .*checkpoint.pt \(the disk is full or the file cannot "
                                         r"grow\)$"):
        run_folder.write_atomically(str(tmp_path / "checkpoint.pt"), lambda f: torch.save({"step": 1}, f))
    assert os.listdir(tmp_path) == []  # no half-written temp file left behind


def test_a_full_disk_while_logging_is_a_one_line_error(tmp_path, monkeypatch):
    import builtins

    def full(path, mode="r", *args, **kwargs):
        if "a" in mode or "w" in mode:
            raise OSError(28, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_folder, "open", full, raising=False)
    for name, mode in (("metrics.jsonl", "a"), ("summary.json", "w")):
        with pytest.raises(ValueError, match=rf"--out: cannot write .*{name} \(No space left on device\)"):
            run_folder.write_file(str(tmp_path / name), "{}", mode)


def test_recorded_logprobs_match_the_sampler():
    """ℓ_old from the forward pass equals log softmax(logits / τ) of generate's own logits."""
    torch.manual_seed(0)
    cfg = Config(**{**TINY, "temperature": 0.7})
    tok = task.CharTokenizer()
    model = task.tiny_model(tok, 6, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, max_new_tokens=cfg.max_new_tokens).eval()
    ids, attn = generation.left_pad([tok.encode("1+2="), tok.encode("13+4=")], tok.pad_id)  # left padding
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=0.7, top_k=None, top_p=1.0,
                         max_new_tokens=3, min_new_tokens=3, pad_token_id=tok.pad_id, eos_token_id=-1,
                         return_dict_in_generate=True, output_logits=True)
    seq = out.sequences
    P = ids.shape[1]
    gen = torch.stack(out.logits, 1).float()
    expected = torch.log_softmax(gen / 0.7, -1).gather(-1, seq[:, P:, None])[..., 0]
    got, _ = trainer_model.token_logp(model, seq, torch.cat([attn, torch.ones_like(seq[:, P:])], 1), P,
                             dict(temperature=0.7, softcap=None))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_an_on_policy_update_skips_the_behaviour_pass_and_trains_as_with_it(tmp_path, monkeypatch):
    """One optimizer step on all the rows, no reference and no critic: ℓ_old is not computed (the loss takes
    old_logp=None, ℓ_old = sg(ℓ), as TRL), and the step's weights and loss are those of a run that computes ℓ_old
    with the forward pass (the ratio is then 1 up to rounding)."""
    from rlkernels.trainer import loop

    on_policy = dict(TINY, steps=1, minibatches=1, epochs=1, kl_coef=0.0, eval_size=0, warmup_steps=0)

    def odd_length(prompt, completion, answer):  # about half the completions: advantages that are not all 0
        return float(len(completion) % 2)
    calls, real_token_logp = [], loop.token_logp
    monkeypatch.setattr(loop, "token_logp", lambda *a, **k: calls.append(1) or real_token_logp(*a, **k))
    train(Config(**on_policy, out=str(tmp_path / "skip")), reward_fn=odd_length)
    assert calls == []  # neither the policy's forward nor a reference's
    real_behaviour = loop.behaviour_logp

    def with_old_logp(run_, b):  # the same batch, with ℓ_old from the forward pass as before the shortcut
        batch = real_behaviour(run_, b)
        with run_.place.autocast():
            batch["old_logp"] = real_token_logp(run_.policy, batch["seq"], batch["attn"], batch["P"], run_.head_args)[0]
        return batch

    monkeypatch.setattr(loop, "behaviour_logp", with_old_logp)
    train(Config(**on_policy, out=str(tmp_path / "forward")), reward_fn=odd_length)
    skip, forward = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True) for name in ("skip", "forward"))
    for name, w in forward["model"].items():
        torch.testing.assert_close(skip["model"][name], w, rtol=0, atol=1e-6)
    (row,), (row_forward,) = ([json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
                              for name in ("skip", "forward"))
    assert row["updates"] == 1 and row["skipped"] == 0 and row["grad_norm"] > 0  # a step that moved the weights
    for k in ("loss", "grad_norm", "clip_frac"):
        assert row[k] == pytest.approx(row_forward[k], abs=1e-6), k


# ---- bad flags and files: clear errors naming the flag

@pytest.mark.parametrize("argv, message", [
    (["--algo", "ppoo"], "--algo: expected one of"),
    (["--stepz", "3"], "unknown flag --stepz; did you mean --steps?"),
    (["--steps", "three"], "--steps: expected an int, got 'three'"),
    (["--steps", "0"], "--steps: expected an int >= 1"),
    (["--temperature", "-1"], "--temperature"),
    (["--lr"], "--lr: expected a value"),
    (["--dataset", "/nonexistent.jsonl"], "--dataset: no such file or folder"),
    (["--model", "/nonexistent"], "--model"),
    (["--resume", "/nonexistent"], "--resume"),
    (["--reward", "fuzzy"], "--reward"),
    (["--pods-keep", "9"], "--pods-keep"),
    (["--config", "/nonexistent.json"], "--config: no such file"),
    (["positional"], "unexpected argument"),
    (["--lr", "inf"], "--lr: expected a finite number, got inf"),
    (["--warmup-lr", "-inf"], "--warmup-lr: expected a finite number"),
    (["--kl-coef", "nan"], "--kl-coef: expected a finite number, got nan"),
    (["--temperature", "1e-45"], "--temperature: expected a number >= 2.94e-39 (1/τ must fit float32)"),
    (["--temperature", "inf"], "--temperature: expected a finite number"),
    (["--lora-alpha", "nan"], "--lora-alpha: expected a finite number, got nan"),
    (["--lora-alpha", "0"], "--lora-alpha: expected a number > 0"),
    (["--digits", "4"], "--digits: expected at most 3"),
    (["--seed", "100000000000000000000"], "--seed: expected an int from 0 to 2**32 - 1"),
    (["--seed", "-1"], "--seed: expected an int from 0"),
    (["--max-gen-batches", "0"], "--max-gen-batches: expected an int >= 1"),
    (["--device", "gpu"], "--device: expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["--dtype", "fp8"], "--dtype: expected one of auto, float32, bfloat16, float16, got 'fp8'"),
    (["--dtype", "float16"], "--dtype float16: not supported (float16 gradients underflow without loss scaling"),
    # refused when parsed, not after the model is built and warmed up (issue 26)
    (["--algo", "ppo", "--kl-target", "0"], "--kl-target: expected a number > 0 or none, got 0.0"),
    (["--vf-clip", "0"], "--vf-clip: expected a number > 0 or none, got 0.0"),
    (["--lr", "1e300"], "--lr: expected a number in (0, 1], got 1e"),
    (["--warmup-lr", "2"], "--warmup-lr: expected a number in (0, 1], got 2.0"),
    (["--weight-decay", "1e5"], "--weight-decay: expected a number in [0, 1 / --lr] (1e"),
    (["--temperature", "1e300"], "--temperature: expected a number >= 2.94e-39 (1/τ must fit float32) and <= 3.4e"),
    (["--num-generations", "1"], "--num-generations: expected an int >= 2 for --algo grpo, whose advantages compare"),
])
def test_bad_flags(argv, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_args(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.split(":")[0] in err and err.count("\n") == 1


def test_config_file_and_flag_precedence(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"algo": "gspo", "steps": 7, "kl_coef": None}))
    cfg, explicit = from_args(["--config", str(path), "--steps", "9", "--dynamic-sampling"])
    assert (cfg.algo, cfg.steps, cfg.kl_coef, cfg.dynamic_sampling) == ("gspo", 9, None, True)
    path.write_text(json.dumps({"algo": "gspo", "stepss": 7}))
    with pytest.raises(ValueError, match="unknown key 'stepss'; did you mean 'steps'"):
        from_args(["--config", str(path)])
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--config: .* is not valid JSON"):
        from_args(["--config", str(path)])
    path.write_bytes(b'{"algo": "gr\xe9po"}')  # Latin-1
    with pytest.raises(ValueError, match="--config: .* is not UTF-8 text"):
        from_args(["--config", str(path)])
    path.write_text(json.dumps({"seed": 1e20}))
    with pytest.raises(ValueError, match="--seed: expected an int from 0"):
        from_args(["--config", str(path)])


def test_bad_files(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+2=", "answer": "3"}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match="--dataset: .* row 1: expected a prompt that is a string or a conversation"):
        train(Config(**{**TINY, "dataset": str(bad), "out": str(tmp_path / "o")}))
    bad.write_text('{"prompt": "1*2=", "answer": "2"}\n{"prompt": "1*3=", "answer": "3"}\n')
    with pytest.raises(ValueError, match="not in the demo vocabulary"):
        train(Config(**{**TINY, "dataset": str(bad), "out": str(tmp_path / "o")}))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoint.pt").write_text("garbage")
    with pytest.raises(ValueError, match="--resume: cannot read checkpoint"):
        train(Config(resume=str(tmp_path / "r")))
    with pytest.raises(ValueError, match="--reward: cannot load"):
        rewards.make_reward("module:no_such_module_xyz:f")
    bad.write_bytes(b'{"prompt": "1+2=", "answer": "3"}\n{"prompt": "\xff", "answer": "3"}\n')
    with pytest.raises(ValueError, match="--dataset: cannot read .*p.jsonl"):
        train(Config(**{**TINY, "dataset": str(bad), "out": str(tmp_path / "o")}))


def _no_work(monkeypatch):
    """Fail the test if the trainer starts building its task (errors must come before any work)."""
    monkeypatch.setattr(task, "tiny_model", lambda *a, **k: pytest.fail("the trainer built its model"))


def test_out_dir_errors_come_first(tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    monkeypatch.setattr(task, "addition_task", lambda *a, **k: pytest.fail("the trainer built its task"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--out: .*file' is a file, not a folder"):
        train(Config(**{**TINY, "out": str(tmp_path / "file")}))
    assert main(["--out", str(tmp_path / "file"), "--progress", "false"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(ValueError, match="--out: cannot write in .*file/sub"):  # a file as a parent folder
        train(Config(**{**TINY, "out": str(tmp_path / "file" / "sub")}))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: simulate the refusal
        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(run_folder.tempfile, "TemporaryFile", refuse)
    with pytest.raises(ValueError, match="--out: cannot write in .*ro' \\(Permission denied\\)"):
        train(Config(**{**TINY, "out": str(ro)}))


def test_too_few_prompts_name_the_flag(tmp_path, monkeypatch):
    _no_work(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n" for a in range(6)))
    base = {**TINY, "dataset": str(prompts), "eval_size": 2, "out": str(tmp_path / "o")}
    with pytest.raises(ValueError, match=r"--prompts-per-step: 5 is more than the 4 training prompts in .*p.jsonl"):
        train(Config(**{**base, "prompts_per_step": 5}))
    with pytest.raises(ValueError, match=r"--warmup-batch: 16 is more than the 4 training prompts"):
        train(Config(**base))
    with pytest.raises(ValueError, match=r"--prompts-per-step: 90 is more than the 84 training prompts \(after 16"):
        train(Config(**{**TINY, "prompts_per_step": 90, "out": str(tmp_path / "o")}))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run (copy it before changing it)."""
    path = tmp_path_factory.mktemp("finished")
    run(path, steps=2)
    return path


def test_resume_refuses_changed_shape_algo_and_foreign_files(finished_run, tmp_path, capsys):
    for argv, message in [(["--algo", "ppo"], "--algo: the run in .* has 'grpo' and a resumed run keeps it"),
                          (["--n-embd", "64"], "--n-embd: the run in .* has 32")]:
        cfg, explicit = from_args(["--resume", str(finished_run), *argv])
        with pytest.raises(ValueError, match=message):
            train(cfg, explicit=explicit)
    assert main(["--resume", str(finished_run), "--algo", "gspo"]) == 2
    assert capsys.readouterr().err.startswith("rlkernels.train: error: --algo: the run in")
    (tmp_path / "f").mkdir()
    torch.save({"weight": torch.zeros(2)}, tmp_path / "f" / "checkpoint.pt")  # a plain state dict
    with pytest.raises(ValueError, match="--resume: .* is not a checkpoint of rlkernels.train \\(no config, step"):
        train(Config(resume=str(tmp_path / "f")))
    ckpt = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    ckpt["model"] = {k: v[..., :1] for k, v in ckpt["model"].items()}  # right keys, wrong shapes
    torch.save(ckpt, tmp_path / "f" / "checkpoint.pt")
    with pytest.raises(ValueError, match="--resume: the checkpoint in .* does not fit this run \\(RuntimeError: .*size"):
        train(Config(resume=str(tmp_path / "f"), progress=False))
    ckpt = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    ckpt["ref"], ckpt["config"]["kl_coef"] = None, 0.0  # a run without a KL term saves no reference
    torch.save(ckpt, tmp_path / "f" / "checkpoint.pt")
    with pytest.raises(ValueError, match="--kl-coef: the run in .* trained without a KL term"):
        train(Config(resume=str(tmp_path / "f"), kl_coef=0.04, progress=False))


def test_resume_of_a_finished_run_keeps_its_summary(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "run")
    before = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary = train(Config(resume=str(tmp_path / "run"), progress=False))
    after = json.loads((tmp_path / "run" / "summary.json").read_text())
    for d in (before, after, summary):  # the copy has another folder
        for k in ("wall_time_s", "out"):
            d.pop(k)
        for k in ("resume", "out"):
            d["config"].pop(k)
    assert after == before and summary == before and before["final_reward_mean"] is not None


def test_resume_from_a_checkpoint_file_continues_its_folder(finished_run, tmp_path, monkeypatch):
    shutil.copytree(finished_run, tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")  # `--resume checkpoint.pt` from inside the run folder
    summary = train(Config(resume="checkpoint.pt", steps=3, progress=False))
    assert summary["out"] == "." and summary["steps"] == 3 and not (tmp_path / "run" / "runs").exists()
    assert [json.loads(line)["step"] for line in open("metrics.jsonl")] == [1, 2, 3]
    # into another folder (--out): the metrics before the checkpoint come along
    train(Config(resume=str(tmp_path / "run" / "checkpoint.pt"), out=str(tmp_path / "other"), steps=4, progress=False))
    assert [json.loads(line)["step"] for line in open(tmp_path / "other" / "metrics.jsonl")] == [1, 2, 3, 4]


def _local_checkpoint(path, gpt2=False):
    """A tiny Llama (or GPT-2) and a character-level fast tokenizer saved as a Hugging Face folder (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *"0123456789+= "])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    if gpt2:  # another architecture: Conv1D projections named c_attn, c_proj, c_fc
        from transformers import GPT2Config, GPT2LMHeadModel
        GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)).save_pretrained(path)
        return
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)).save_pretrained(path)


def test_local_model_prompts_file_and_regex_reward(tmp_path):
    _local_checkpoint(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    # prompts of different lengths: left padding, positions from the attention mask
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                               for a in (1, 22, 333) for b in (4, 55)))
    summary, rows = run(tmp_path / "o", model=str(tmp_path / "m"), dataset=str(prompts), eval_size=2,
                        reward=r"regex:(\d+)", steps=2, prompts_per_step=2, algo="dapo")
    check_run(tmp_path / "o", summary, rows, 2)


def test_conversational_prompts_through_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from rlkernels.trainer.task import HFTokenizer

    _local_checkpoint(tmp_path / "m")
    hf = AutoTokenizer.from_pretrained(tmp_path / "m")
    hf.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}={% endfor %}"
    hf.save_pretrained(tmp_path / "m")
    tok = HFTokenizer(AutoTokenizer.from_pretrained(tmp_path / "m"))
    conversation = tok.encode([{"role": "user", "content": "12+3"}])
    assert conversation == [hf.bos_token_id, *hf("12+3=", add_special_tokens=False)["input_ids"]]
    hf._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", hf.bos_token_id)])  # a Llama-style tokenizer: adds BOS
    tok = HFTokenizer(hf)
    assert tok.encode("12+3=") == conversation  # a plain prompt gets the tokenizer's BOS
    assert tok.encode("<s>12+3=") == conversation  # a pre-templated one keeps its own: no second BOS
    assert tok.encode([{"role": "user", "content": "12+3"}]) == conversation  # the template's BOS only
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": a + b})
                               + "\n" for a in (1, 22, 3) for b in (4, 5)))
    summary, rows = run(tmp_path / "o", model=str(tmp_path / "m"), dataset=str(prompts), eval_size=2, steps=2,
                        prompts_per_step=2)
    check_run(tmp_path / "o", summary, rows, 2)
    with pytest.raises(ValueError, match="--dataset: conversational prompts need --model"):
        run(tmp_path / "d", dataset=str(prompts), eval_size=2, steps=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": 1}) + "\n")
    with pytest.raises(ValueError, match="row 0: expected a prompt"):
        run(tmp_path / "b", model=str(tmp_path / "m"), dataset=str(bad), eval_size=2, steps=1)


def _same_weights(model, state, prefix=""):
    got = model.state_dict()
    return all(torch.equal(got[k[len(prefix):]], v) for k, v in state.items() if k.startswith(prefix))


def test_run_folder_is_a_hugging_face_model(tmp_path):
    from transformers import AutoModelForCausalLM

    summary, rows = run(tmp_path, steps=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # the policy of the last checkpoint
    assert _same_weights(model, torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"])
    assert (tmp_path / "generation_config.json").exists() and not (tmp_path / ".hf.tmp").exists()


def test_lora(tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    summary, rows = run(tmp_path, lora_rank=4, steps=2)
    check_run(tmp_path, summary, rows, 2)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert any("lora_A" in k for k in ckpt["model"])
    # the demo's base model is not on disk: its run folder holds the merged weights
    assert not (tmp_path / "adapter_config.json").exists()
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("merge", [False, True])
def test_lora_on_a_local_model_saves_the_adapter_or_the_merged_model(tmp_path, merge):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _local_checkpoint(tmp_path / "m", gpt2=True)  # GPT-2: LoRA on every linear layer, whatever their names
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n" for a in (1, 2, 3)
                               for b in (4, 5)))
    out = tmp_path / "o"
    run(out, model=str(tmp_path / "m"), dataset=str(prompts), eval_size=2, steps=1, prompts_per_step=2,
        lora_rank=2, merge_lora=merge)
    assert (out / "adapter_config.json").exists() != merge
    model = AutoModelForCausalLM.from_pretrained(out)  # the adapter through peft on the base, or merged
    assert AutoTokenizer.from_pretrained(out).eos_token == "</s>"
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    assert any("lora_A" in k for k in ckpt)
    if merge:
        assert not any("lora" in k for k in model.state_dict())
    with pytest.raises(ValueError, match="--lora-target"):
        run(tmp_path / "x", model=str(tmp_path / "m"), dataset=str(prompts), eval_size=2, steps=1,
            prompts_per_step=2, lora_rank=2, lora_target="q_proj")


TRL_CALLS = []


def trl_style_reward(prompts, completions, answer, **kwargs):
    """TRL's signature: the batch's prompts and completions, the dataset's columns as keywords."""
    TRL_CALLS.append(len(prompts))
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def trl_style_short_reward(prompts, completions, **kwargs):
    return [1.0]


def test_rewards_with_trl_signature(tmp_path):
    TRL_CALLS.clear()
    summary, rows = run(tmp_path / "a", steps=1, reward="module:test_trainer:trl_style_reward")
    reference, _ = run(tmp_path / "b", steps=1)  # the same reward per sample: `exact`
    assert TRL_CALLS and max(TRL_CALLS) > 1  # whole batches, not one completion at a time
    assert summary["eval_reward_before"] == reference["eval_reward_before"]
    assert rows[0]["reward_mean"] == json.loads(open(tmp_path / "b" / "metrics.jsonl").readline())["reward_mean"]
    with pytest.raises(ValueError, match=r"^--reward: module:test_trainer:trl_style_short_reward returned \[1.0\] "
                                         r"for \d+ completions"):
        run(tmp_path / "c", steps=1, warmup_steps=0, reward="module:test_trainer:trl_style_short_reward")


class _Place:
    device = torch.device("cpu")

    def autocast(self):
        return contextlib.nullcontext()


class _CappedLlama(__import__("transformers").LlamaForCausalLM):
    """A forward that changes its logits with no config attribute saying so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2 * torch.tanh(out.logits / 2)
        return out


def test_the_trainer_reads_a_model_head_as_generate_samples_it():
    """`generate` samples through the model's forward; the trainer reads trunk and lm_head: a logit scale is folded
    into the temperature (Granite divides its logits by logits_scaling), a final-logit cap is the ops' softcap
    (Gemma 2), anything else is refused before training."""
    import transformers

    from rlkernels.trainer.model import output_head_of, token_logp

    small = dict(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**small, logits_scaling=4.0)).eval()
    with torch.no_grad():
        granite.lm_head.weight.mul_(30)
    head_args = output_head_of(granite, 0.7, _Place())
    assert head_args == {"temperature": pytest.approx(0.7 * 4.0), "softcap": None}
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def model_logp(model):
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]

    torch.testing.assert_close(token_logp(granite, ids, mask, 1, head_args)[0], model_logp(granite), rtol=1e-5, atol=1e-5)

    capped = _CappedLlama(transformers.LlamaConfig(**small))
    with torch.no_grad():
        capped.lm_head.weight.mul_(30)
    with pytest.raises(ValueError, match="_CappedLlama.*nats away"):
        output_head_of(capped, 1.0, _Place())
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small, head_dim=8, final_logit_softcapping=3.0))
    with torch.no_grad():
        gemma.lm_head.weight.mul_(30)  # the cap at 3 binds
    head_args = output_head_of(gemma.eval(), 0.7, _Place())
    assert head_args == {"temperature": pytest.approx(0.7), "softcap": 3.0}
    torch.testing.assert_close(token_logp(gemma, ids, mask, 1, head_args)[0], model_logp(gemma), rtol=1e-5, atol=1e-5)


def test_a_malformed_prompts_file_fails_before_any_model_loads(tmp_path, monkeypatch):
    from rlkernels.trainer import rewards, task

    _local_checkpoint(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2=", "answer": 3}) + "\n{not json\n")
    loaded = []
    monkeypatch.setattr(task, "load_model", lambda *a: loaded.append("policy"))
    monkeypatch.setattr(rewards, "build", lambda *a: loaded.append("rewards"))
    with pytest.raises(ValueError, match=r"--dataset: cannot read .*p.jsonl"):
        run(tmp_path / "o", model=str(tmp_path / "m"), dataset=str(prompts))
    assert not loaded
