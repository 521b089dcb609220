"""The trainer's command line: transformers.HfArgumentParser on Config (help, config files, demo-only flags,
errors before any model is built). All fast: nothing here trains."""
import dataclasses
import json

import pytest

from rlkernels.train import main
from rlkernels.trainer import Config, from_args, loop, task
from rlkernels.trainer import config as C


def test_help_lists_every_field_hyphenated_with_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(Config):
        assert f.metadata.get("help"), f"{f.name} has no help line"
        flag = C._flag(f.name)
        assert any(line.split()[0] == flag for line in out.splitlines() if line.startswith("  --")), flag
        if "_" in f.name:
            assert "--" + f.name not in out  # only the hyphenated spelling is shown
    assert "--config FILE" in out and "--reward-model" in out


@pytest.mark.parametrize("argv", [["--steps", "3", "--help"], ["--stepz", "-h"], ["--steps", "three", "--help"]])
def test_help_anywhere(argv, capsys):
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "--reward-weights" in captured.out and captured.err == ""


def test_both_spellings_and_bools():
    cfg, explicit = from_args(["--reward_model", "", "--kl_coef", "none", "--no-progress", "--tree",
                               "--warmup-lr", "2e-3"])
    assert (cfg.kl_coef, cfg.progress, cfg.tree, cfg.warmup_lr) == (None, False, True, 2e-3)
    assert explicit == {"reward_model", "kl_coef", "progress", "tree", "warmup_lr"}
    assert from_args([])[0] == Config() and from_args([])[1] == set()


@pytest.mark.parametrize("suffix, text", [
    (".json", json.dumps({"algo": "gspo", "steps": 7, "kl_coef": None, "reward": ["exact", "regex:(\\d+)"]})),
    (".yaml", "algo: gspo\nsteps: 7\nkl_coef: null\nreward:\n  - exact\n  - 'regex:(\\d+)'\n"),
    (".yml", "algo: gspo\nsteps: 7\nkl_coef: none\nreward: [exact, 'regex:(\\d+)']\n"),
])
def test_config_file_json_and_yaml_with_flag_override(tmp_path, suffix, text):
    path = tmp_path / ("c" + suffix)
    path.write_text(text)
    cfg, explicit = from_args(["--steps", "9", "--config", str(path), "--reward", "exact"])
    assert (cfg.algo, cfg.steps, cfg.kl_coef, cfg.reward) == ("gspo", 9, None, ["exact"])
    assert {"algo", "steps", "kl_coef", "reward"} <= explicit
    cfg, _ = from_args(["--config", str(path)])
    assert (cfg.steps, cfg.reward) == (7, ["exact", "regex:(\\d+)"])


def test_bad_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo: [gspo\n")
    with pytest.raises(ValueError, match="--config: .* is not valid YAML"):
        from_args(["--config", str(path)])
    path.write_text("- steps\n")
    with pytest.raises(ValueError, match="--config: .* must hold a YAML object"):
        from_args(["--config", str(path)])
    path.write_text("stepss: 3\n")
    with pytest.raises(ValueError, match="unknown key 'stepss'; did you mean 'steps'"):
        from_args(["--config", str(path)])


@pytest.mark.parametrize("name", C.DEMO_ONLY)
def test_demo_only_flag_with_model_names_the_flag(tmp_path, name, capsys, monkeypatch):
    monkeypatch.setattr(task, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    argv = ["--model", str(tmp_path), "--prompts", str(prompts), C._flag(name), "2"]
    with pytest.raises(ValueError, match=f"^{C._flag(name)}: applies only to the built-in demo model"):
        from_args(argv)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"rlkernels.train: error: {C._flag(name)}: applies only")
    path = tmp_path / "c.json"  # from a config file too
    path.write_text(json.dumps({"model": str(tmp_path), "prompts": str(prompts), name: 2}))
    with pytest.raises(ValueError, match=f"^{C._flag(name)}: applies only"):
        from_args(["--config", str(path)])


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "/nonexistent.jsonl"], "--prompts: no such file"),
    (["--model", "{tmp}"], "--prompts: required with --model"),
])
def test_file_errors_before_any_model_is_built(tmp_path, argv, message, capsys, monkeypatch):
    boom = lambda *a, **k: pytest.fail("a model was built")  # noqa: E731
    monkeypatch.setattr(task, "tiny_model", boom)
    monkeypatch.setattr(task, "load_model", boom)
    monkeypatch.setattr(loop.rewards_lib, "build", boom)  # the reward model loads there
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"rlkernels.train: error: {message}")
    assert not (tmp_path / "o").exists()
