"""`--plugin` (issue 32 item 2): an objective and a preset registered in the user's own file, trained from the
command line; a missing file, a failing import and a name the plugin does not register are errors naming the flag."""
import json
import os
import textwrap

import pytest

from rlkernels import presets
from rlkernels.losses import objectives
from rlkernels.train import main

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--digits", "1", "--eval-size", "16",
        "--warmup-steps", "5", "--warmup-batch", "16", "--prompts-per-step", "4", "--num-generations", "4",
        "--max-new-tokens", "3", "--eval-every", "5", "--ckpt-every", "1", "--no-progress"]

PLUGIN = '''
import torch
import rlkernels
from rlkernels import presets

CALLS = []


def {objective}(*, ratio, advantages, config, **_):
    """PPO's clipped surrogate, written as a user would."""
    CALLS.append(1)
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    w = ratio.detach()
    return loss, (w < 1 - config.clip_low) & (advantages < 0), (w > 1 + config.clip_high) & (advantages > 0)


rlkernels.register_objective("{objective}", {objective}, ratios=("token",), clip=True)
presets.register("{preset}", objective="{objective}", clip_low=0.2, clip_high=0.28, agg="token_mean")
'''


@pytest.fixture
def plugin_file(tmp_path):
    names = dict(objective="cli_clip", preset="cli_dapo")
    path = tmp_path / "my_obj.py"
    path.write_text(PLUGIN.format(**names))
    yield str(path), names
    if names["preset"] in presets.NAMES:
        presets.unregister(names["preset"])
    if names["objective"] in objectives.names():
        objectives.unregister_objective(names["objective"])


def test_a_plugin_preset_trains_from_the_command_line(plugin_file, tmp_path, capsys):
    path, names = plugin_file
    out = str(tmp_path / "run")
    assert main([*TINY, "--steps", "2", "--plugin", path, "--algo", names["preset"], "--out", out]) == 0, capsys.readouterr().err
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["algo"] == names["preset"] and summary["config"]["plugin"] == [path]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 2 and all(r["loss"] is not None for r in rows)


def test_the_plugin_objective_is_what_the_loss_calls(plugin_file, tmp_path, capsys):
    path, names = plugin_file
    from rlkernels.trainer import plugins

    out = str(tmp_path / "run")
    assert main([*TINY, "--steps", "1", "--plugin", path, "--algo", names["preset"], "--out", out]) == 0
    module = plugins._LOADED[os.path.realpath(path)]
    assert module.CALLS, "the registered objective never ran"
    # a resumed run that names the plugin again (the checkpoint's alone is refused, issue 37 item 10): loaded once,
    # so registered once
    assert main(["--resume", out, "--steps", "2"]) == 2 and "--trust-checkpoint-code" in capsys.readouterr().err
    assert main(["--resume", out, "--steps", "2", "--plugin", path]) == 0, capsys.readouterr().err
    assert len([json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]) == 2


@pytest.mark.parametrize("source, argv, message", [
    (None, ["--plugin", "missing.py"], "--plugin: no such file 'missing.py'"),
    (None, ["--plugin", "no_such_module_anywhere"], "--plugin: no module named 'no_such_module_anywhere'"),
    ("raise RuntimeError('boom')\n", [], "--plugin {path}: importing it raised RuntimeError (boom)"),
    ("import not_a_module_xyz\n", [], "--plugin {path}: importing it raised ModuleNotFoundError"),
    ("def f(:\n", [], "--plugin {path}: {path}, line 1:"),
    ("x = 1\n", ["--algo", "never_registered"], "--algo: expected one of"),
])
def test_plugin_errors_name_the_flag(tmp_path, capsys, monkeypatch, source, argv, message):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "plug.py")
    if source is not None:
        (tmp_path / "plug.py").write_text(source)
        argv = ["--plugin", path, *argv]
    assert main([*TINY, *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err, err
    assert not os.path.exists(tmp_path / "o")  # refused before any run folder or model


def test_plugin_flag_is_listed_in_help(capsys):
    assert main(["--help"]) == 0
    assert "--plugin PLUGIN [PLUGIN ...]" in capsys.readouterr().out


def test_the_plugin_file_is_named_in_the_never_registered_error(tmp_path, capsys):
    path = tmp_path / "plug.py"
    path.write_text(textwrap.dedent("x = 1\n"))
    assert main([*TINY, "--plugin", str(path), "--algo", "nope_preset", "--out", str(tmp_path / "o")]) == 2
    assert "presets.register it in a --plugin file" in capsys.readouterr().err
