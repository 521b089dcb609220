"""The trainer's command line: transformers.HfArgumentParser on Config (help, config files, demo-only flags,
errors before any model is built). All fast: nothing here trains."""
import dataclasses
import json

import pytest
import yaml

from rlkernels.train import main
from rlkernels.trainer import Config, from_args, rewards, task
from rlkernels.trainer import run_config as C


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


def _alias_bomb(levels=9):
    """A few hundred bytes of YAML whose `reward` list, expanded, holds 9^levels strings."""
    lines, prev = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'], "a0"
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*{prev}'] * 9)}]")
        prev = f"a{i}"
    return "\n".join(lines + [f"reward: [{', '.join([f'*{prev}'] * 9)}]"]) + "\n"


@pytest.mark.parametrize("suffix, text, message", [
    (".yaml", _alias_bomb(), r"key 'reward': expected a string \(each item\), got a list"),
    (".yaml", "reward: [&a [x, x], *a]\n", r"nests deeper than a config needs at line 1"),
    (".yaml", "model: {path: m}\n", r"key 'model': expected a string, got a dict"),
    (".yaml", "reward: " + "[" * 5000 + "]" * 5000 + "\n", r"nests deeper than a config needs at line 1"),
    (".json", '{"steps": 3,\n "reward": ' + "[" * 100000 + "]" * 100000 + "}", r"nests deeper .* at line 2"),
    (".json", '{"model": ["m"]}', r"key 'model': expected a string, got a list"),
])
def test_config_values_that_are_not_scalars_are_refused_before_converting(tmp_path, suffix, text, message):
    """An alias bomb expands to gigabytes when converted, and a deep file is a RecursionError in the parser."""
    path = tmp_path / ("c" + suffix)
    path.write_text(text)
    with pytest.raises(ValueError, match=r"^--config.*" + message):
        from_args(["--config", str(path)])


def test_brackets_in_json_strings_are_not_nesting(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"reward": ["regex:[[[{{{(\\d+)"]}))
    assert from_args(["--config", str(path)])[0].reward == ["regex:[[[{{{(\\d+)"]


def test_ppo_takes_one_generation_per_prompt():
    assert from_args(["--algo", "ppo", "--num-generations", "1"])[0].num_generations == 1


@pytest.mark.parametrize("name", C.DEMO_ONLY)
def test_demo_only_flag_with_model_names_the_flag(tmp_path, name, capsys, monkeypatch):
    monkeypatch.setattr(task, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    argv = ["--model", str(tmp_path), "--dataset", str(prompts), C._flag(name), "2"]
    with pytest.raises(ValueError, match=f"^{C._flag(name)}: applies only to the built-in demo model"):
        from_args(argv)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"rlkernels.train: error: {C._flag(name)}: applies only")
    path = tmp_path / "c.json"  # from a config file too
    path.write_text(json.dumps({"model": str(tmp_path), "dataset": str(prompts), name: 2}))
    with pytest.raises(ValueError, match=f"^{C._flag(name)}: applies only"):
        from_args(["--config", str(path)])


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "/nonexistent.jsonl"], "--dataset: no such file or folder"),
    (["--prompts", "/nonexistent.jsonl"], "--dataset: no such file or folder"),  # the flag's old name
    (["--model", "{tmp}"], "--model: expected a local Hugging Face model folder (save_pretrained's, with config.json) "
                           "or a Hub name in the local cache, got '{tmp}': a folder without config.json"),
    (["--model", "{tmp}/m"], "--dataset: required with --model"),
    (["--reward-model", "{tmp}", "--reward", "exact"], "--reward-model: expected a local Hugging Face model folder"),
    (["--reward", "myrewards"], "--reward: expected exact | regex:PATTERN | package.module:function | "
                                "path/to/file.py:function | trl grpo's accuracy_reward, "
                                "reasoning_accuracy_reward, think_format_reward or get_soft_overlong_punishment, got "
                                "'myrewards'"),
    (["--fsdp"], "--fsdp: shards the models over the processes of torchrun"),
])
def test_file_errors_before_any_model_is_built(tmp_path, argv, message, capsys, monkeypatch):
    boom = lambda *a, **k: pytest.fail("a model was built")  # noqa: E731
    monkeypatch.setattr(task, "tiny_model", boom)
    monkeypatch.setattr(task, "load_model", boom)
    monkeypatch.setattr(rewards, "build", boom)  # the reward model loads there
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--out", str(tmp_path / "o")]
    message = message.replace("{tmp}", str(tmp_path))
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"rlkernels.train: error: {message}")
    assert not (tmp_path / "o").exists()


# ---- TRL's names (trl_names.py) ------------------------------------------------------------------------------

def test_trl_names_as_flags_set_our_fields():
    cfg, explicit = from_args(["--learning_rate", "3e-6", "--beta", "0.01", "--output-dir", "o", "--max_completion_length",
                               "12", "--num_generations", "4", "--loss_type", "dapo", "--epsilon", "0.1",
                               "--epsilon_high", "0.3", "--scale_rewards", "batch", "--logging_steps", "5",
                               "--save_steps", "7", "--seed", "3", "--report_to", "none", "--max_steps", "9",
                               "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
                               "--steps_per_generation", "4", "--bf16", "false", "--temperature", "0.9"])
    assert (cfg.lr, cfg.kl_coef, cfg.out, cfg.max_new_tokens, cfg.num_generations, cfg.algo) == (3e-6, 0.01, "o", 12, 4,
                                                                                              "dapo")
    assert (cfg.clip_low, cfg.clip_high, cfg.scale_rewards, cfg.logging_steps, cfg.ckpt_every) == (0.1, 0.3, "batch", 5, 7)
    assert (cfg.seed, cfg.steps, cfg.dtype, cfg.temperature) == (3, 9, "float32", 0.9)
    # 8 completions per micro-batch × 4 micro-batches per rollout = 32 completions = 8 prompts of 4; 4 / 2 updates
    assert (cfg.prompts_per_step, cfg.minibatches) == (8, 2)
    assert {"lr", "kl_coef", "algo", "prompts_per_step", "minibatches", "dtype"} <= explicit


@pytest.mark.parametrize("trl, ours", [
    ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
     {"algo": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}),
    ({"loss_type": "cispo", "epsilon": 0.2, "epsilon_high": 5.0}, {"algo": "cispo", "clip_low": None, "clip_high": 4.0}),
    ({"loss_type": "dr_grpo", "scale_rewards": False}, {"algo": "dr_grpo", "scale_rewards": "none"}),
    ({"use_peft": True, "lora_target_modules": ["q_proj", "v_proj"]}, {"lora_rank": 16, "lora_target": "q_proj,v_proj"}),
    ({"use_peft": False, "lora_r": 8}, {"lora_rank": 0}),  # TRL reads lora_r only with use_peft
    ({"warmup_ratio": 0.1, "max_steps": 50, "num_train_epochs": 3}, {"lr_warmup_steps": 5, "steps": 50}),
    ({"eval_strategy": "no", "max_steps": 30}, {"eval_size": 0, "steps": 30}),
    ({"use_cpu": True, "disable_tqdm": True, "top_k": 0, "top_p": 1.0, "use_vllm": False}, {"device": "cpu",
                                                                                          "progress": False}),
])
def test_trl_options_in_a_config_file(tmp_path, trl, ours):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(trl))
    cfg, _ = from_args(["--config", str(path)])
    assert {k: getattr(cfg, k) for k in ours} == ours


def test_a_flag_wins_over_the_recipes_trl_setting(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("loss_type: dapo\nlearning_rate: 1.0e-5\n")
    cfg, _ = from_args(["--config", str(path), "--algo", "gspo", "--lr", "2e-5"])
    assert (cfg.algo, cfg.lr) == ("gspo", 2e-5)
    with pytest.raises(ValueError, match="^loss_type: sets --algo, which is given too"):
        from_args(["--loss-type", "dapo", "--algo", "gspo"])


def test_a_trl_recipe_runs_unchanged_and_the_rest_is_named_in_one_error(tmp_path):
    """A GRPO recipe as TRL's own parser reads it (checked with TrlParser): every key this trainer has is taken,
    and the keys it has no counterpart for are named together."""
    trl_scripts = pytest.importorskip("trl.scripts.grpo")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    recipe = RECIPE.format(model=tmp_path / "m", data=tmp_path / "d.jsonl", out=tmp_path / "o")
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    trl_scripts.make_parser().parse_args_and_config(["--config", str(path)])  # a valid TRL recipe
    cfg, _ = from_args(["--config", str(path)])
    assert (cfg.model, cfg.dataset, cfg.out, cfg.algo, cfg.lr, cfg.kl_coef) == (
        str(tmp_path / "m"), str(tmp_path / "d.jsonl"), str(tmp_path / "o"), "dapo", 1e-6, 0.0)
    assert (cfg.max_new_tokens, cfg.num_generations, cfg.prompts_per_step, cfg.minibatches) == (64, 4, 4, 1)
    assert (cfg.lr_scheduler_type, cfg.lr_warmup_steps, cfg.dtype, cfg.reward, cfg.gradient_checkpointing) == (
        "cosine", 10, "float32", ["rewards.py:accuracy"], True)
    path.write_text(recipe.replace("use_vllm: false", "use_vllm: true") + "hub_model_id: me/x\nattn_implementaton: sdpa\n")
    with pytest.raises(ValueError) as err:
        from_args(["--config", str(path)])
    assert all(k in str(err.value) for k in ("attn_implementaton", "use_vllm=True")) and "hub_model_id" not in \
        str(err.value)  # hub_model_id has no effect here: accepted, and named in the log
    path.write_text(recipe + "hub_model_id: me/x\nattn_implementaton: sdpa\nlora_dropot: 0.1\n")
    with pytest.raises(ValueError, match="unknown keys 'attn_implementaton', 'lora_dropot' .not a setting of this"):
        from_args(["--config", str(path)])
    path.write_text(recipe + "attn_implementation: sdpa\nlora_dropout: 0.1\n")  # ModelConfig's (issue 40 item 1)
    assert from_args(["--config", str(path)])[0].attn_implementation == "sdpa"


RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
dataset_train_split: train
output_dir: {out}
bf16: false
gradient_checkpointing: true
learning_rate: 1.0e-6
lr_scheduler_type: cosine
warmup_steps: 10
max_steps: 100
num_train_epochs: 1
per_device_train_batch_size: 16
gradient_accumulation_steps: 1
num_generations: 4
max_completion_length: 64
temperature: 1.0
loss_type: dapo
beta: 0.0
epsilon: 0.2
epsilon_high: 0.28
scale_rewards: group
reward_funcs: [rewards.py:accuracy]
logging_steps: 5
save_strategy: steps
save_steps: 50
seed: 42
report_to: none
use_vllm: false
"""


def test_unknown_flags_are_named_together():
    with pytest.raises(ValueError, match="^unknown flags --foo, --bar-baz "):
        from_args(["--foo", "1", "--bar-baz", "2"])
    with pytest.raises(ValueError, match="^unknown flag --stepz; did you mean --steps"):
        from_args(["--stepz", "1"])


def test_help_shows_trl_names_and_reward_forms(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--lr LR, --learning-rate LR", "--kl-coef KL_COEF, --beta KL_COEF", "--out OUT, --output-dir OUT",
                 "--loss-type LOSS_TYPE", "--max-new-tokens MAX_NEW_TOKENS, --max-completion-length MAX_NEW_TOKENS",
                 "package.module:function", "path/to/file.py:function"):
        assert text in out, text


def test_model_runs_get_model_defaults(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q"}\n')
    demo, _ = from_args([])
    cfg, explicit = from_args(["--model", str(tmp_path), "--dataset", str(data)])
    for name, (demo_value, model_value) in C.MODE_DEFAULTS.items():
        assert (getattr(demo, name), getattr(cfg, name)) == (demo_value, model_value), name
        assert name not in explicit
    assert from_args(["--model", str(tmp_path), "--dataset", str(data), "--max-new-tokens", "9"])[0].max_new_tokens == 9
    # with --model, --warmup-steps is TRL's learning-rate warm-up
    assert from_args(["--model", str(tmp_path), "--dataset", str(data), "--warmup_steps", "3"])[0].lr_warmup_steps == 3


def test_console_script_commands(capsys):
    from rlkernels import cli

    assert cli.main(["train", "--help"]) == 0 and "--learning-rate" in capsys.readouterr().out
    assert cli.main(["demo", "--model", "m"]) == 2 and "rlkernels train --model" in capsys.readouterr().err
    assert cli.main(["trl", "sft"]) == 2 and "rlkernels trl grpo" in capsys.readouterr().err
    assert cli.main(["fly"]) == 2 and "expected one of train, demo, bench, trl" in capsys.readouterr().err
    assert cli.main([]) == 2 and "rlkernels train [FLAGS]" in capsys.readouterr().out


def test_each_entry_point_validates_once(tmp_path, monkeypatch, capsys):
    """`rlkernels train` checks its config in from_args, `train(config)` in train(): once each, none lost."""
    from rlkernels.trainer import device, loop

    calls = []

    def counted(spec, dtype, check=device.check):  # validate's device check: one call per validate
        calls.append(spec)
        check(spec, dtype)

    def stop(*args, **kwargs):  # the set-up's next step after the config
        raise ValueError("stopped before the run")

    monkeypatch.setattr(device, "check", counted)
    monkeypatch.setattr(rewards, "reward_functions", stop)
    assert main(["--out", str(tmp_path / "o")]) == 2 and "stopped before the run" in capsys.readouterr().err
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ValueError, match="stopped before the run"):
        loop.train(Config(out=str(tmp_path / "o")))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="^--steps: expected an int >= 1"):
        loop.train(Config(steps=0))
    assert main(["--steps", "0"]) == 2 and "--steps: expected an int >= 1" in capsys.readouterr().err


def test_help_and_flag_errors_import_neither_torch_nor_transformers():
    """Issue 33 item 6: `--help` and flag errors took 4.5-25 s, importing torch and transformers first
    (benchmarks/cli_startup.py times them)."""
    import subprocess
    import sys

    script = """if True:
        import contextlib, io, sys
        from rlkernels.cli import main
        for argv in (["--help"], ["train", "--help"], ["demo", "--help"], ["trl", "--help"], ["train", "--stepz", "1"],
                     ["train", "--lr", "x"], ["train", "--steps", "0"], ["train", "--lr", "1e-4", "--learning-rate", "1"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                code = main(argv)
            print(argv, code, sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["[]"] * 8, lines
    assert [int(line.split("] ")[1].split()[0]) for line in lines] == [0, 0, 0, 0, 2, 2, 2, 2], lines


def test_a_setting_given_twice_is_an_error_on_the_command_line_as_in_a_file(tmp_path):
    """One rule (issue 33): `--lr` with `--learning_rate` kept the last silently, while the same pair in a file was
    an error; a key twice in one file was kept silently too. List settings add up when repeated."""
    with pytest.raises(ValueError, match="^--lr and --learning_rate set the same option; give it once"):
        from_args(["--lr", "1e-4", "--learning_rate", "2e-4"])
    with pytest.raises(ValueError, match="^--steps is given twice; give it once"):
        from_args(["--steps", "3", "--steps=4"])
    with pytest.raises(ValueError, match="^--progress and --no-progress set the same option"):
        from_args(["--progress", "--no-progress"])
    assert from_args(["--reward", "exact", "--reward", "regex:(\\d+)"])[0].reward == ["exact", "regex:(\\d+)"]
    (tmp_path / "c.yaml").write_text("lr: 1.0e-4\nlearning_rate: 2.0e-4\n")
    with pytest.raises(ValueError, match="keys 'lr' and 'learning_rate' set the same option"):
        from_args(["--config", str(tmp_path / "c.yaml")])
    for name, text in (("d.yaml", "steps: 3\nalgo: grpo\nsteps: 4\n"), ("d.json", '{"steps": 3, "steps": 4}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"^--config {tmp_path / name}: key 'steps' is given twice; give it once"):
            from_args(["--config", str(tmp_path / name)])


def test_each_subcommand_has_its_own_help(capsys):
    from rlkernels import cli

    assert cli.main(["trl", "--help"]) == 0 and "rlkernels trl grpo [ARGS]" in capsys.readouterr().out
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`rlkernels demo [FLAGS]`") and "usage: rlkernels demo" in out
    assert cli.main(["train", "--help"]) == 0 and "usage: rlkernels train" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: rlkernels bench") and "vocabulary size V" in out


def test_threads_beyond_the_machine_are_refused():
    """`--threads 100000` crashed the process with SIGSEGV inside torch.set_num_threads (issue 33)."""
    import os

    with pytest.raises(ValueError, match=r"^--threads: expected at most 4 × the \d+ CPUs"):
        from_args(["--threads", "100000"])
    assert from_args(["--threads", str(os.cpu_count())])[0].threads == os.cpu_count()


def test_a_hub_name_resolves_through_the_local_cache_or_says_how_to_fetch_it(tmp_path, monkeypatch):
    """Issue 33 item 5: `--model Qwen/Qwen2.5-0.5B-Instruct` was "no such folder" even when cached."""
    from test_readme_quickstart import _stand_in

    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "1+2="}\n')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    argv = ["--model", "someone/tiny-model", "--dataset", str(tmp_path / "d.jsonl")]
    with pytest.raises(ValueError, match=r"^--model: .*got 'someone/tiny-model': no such folder; as a Hugging Face "
                                         r"Hub name it is not in the local cache either: fetch it first \(`hf download "
                                         r"someone/tiny-model`\)"):
        from_args(argv)
    _stand_in(tmp_path / "hub", "someone/tiny-model")
    assert from_args(argv)[0].model == "someone/tiny-model"
    import os
    import subprocess
    import sys

    load = "from rlkernels.trainer import task; print(task.load_model('someone/tiny-model')[0].config.hidden_size)"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}  # read when HF is imported
    out = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "32", out.stderr[-2000:]


def test_trl_grpo_runs_with_the_threads_accelerate_launch_gives(monkeypatch, tmp_path):
    """Issue 33 item 4: `trl grpo` goes through `accelerate launch` (OMP_NUM_THREADS, 1 unless set); `rlkernels trl
    grpo` ran in-process with torch's default threads (11.25 s against 0.37 s of train_runtime on a busy machine)."""
    import os

    import torch
    from trl.scripts import grpo

    from rlkernels import cli
    from rlkernels.integrations import trl as integration

    seen = {}
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    monkeypatch.setattr(integration, "apply", lambda: None)  # no patching of TRL in this process
    monkeypatch.setattr(grpo, "main", lambda *args: seen.update(threads=torch.get_num_threads(),
                                                                env=os.environ["OMP_NUM_THREADS"]))
    before = torch.get_num_threads()
    try:
        assert cli.main(["trl", "grpo", "--output_dir", str(tmp_path), "--bf16", "false"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == {"threads": 1, "env": "1"}


def test_trl_grpo_imports_a_plugin_before_trl_reads_loss_type(monkeypatch, tmp_path, capsys):
    """`rlkernels trl grpo --plugin FILE.py --loss_type rlkernels_<preset>`: the file is imported before TRL's script
    runs (TRL's parser refused the flag), and TRL gets the other arguments unchanged; a missing
    file, a value-less --plugin or a plugin that raises is an error naming the flag."""
    from trl.scripts import grpo

    from rlkernels import cli, presets
    from rlkernels.integrations import trl as integration

    plugin = tmp_path / "my_trl_plugin.py"
    plugin.write_text("from rlkernels import presets\npresets.register('my_trl_dapo', objective='clip', ratio='token', "
                      "clip_low=0.2, clip_high=0.28, agg='token_mean')\n")
    seen = {}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(integration, "apply", lambda: seen.update(registered="my_trl_dapo" in presets.NAMES))
    monkeypatch.setattr(grpo, "main", lambda *parsed: seen.update(loss_type=parsed[1].loss_type))
    try:
        assert cli.main(["trl", "grpo", "--output_dir", str(tmp_path), "--plugin", str(plugin),
                         "--loss_type", "rlkernels_my_trl_dapo", "--bf16", "false"]) == 0
        assert seen == {"registered": True, "loss_type": "rlkernels_my_trl_dapo"}
    finally:
        if "my_trl_dapo" in presets.NAMES:
            presets.unregister("my_trl_dapo")
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    for args, message in (([f"--plugin={tmp_path / 'nope.py'}"], "--plugin: no such file"),
                          (["--plugin"], "--plugin: expected a Python file or a module"),
                          (["--plugin", "--bf16", "false"], "--plugin: expected a Python file or a module"),
                          (["--plugin", str(broken)], "importing it raised RuntimeError")):
        seen.clear()
        assert cli.main(["trl", "grpo", "--output_dir", str(tmp_path), *args]) == 2 and not seen, args
        assert message in capsys.readouterr().err, args
