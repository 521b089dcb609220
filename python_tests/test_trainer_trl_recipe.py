"""A TRL recipe runs unchanged (issue 33 items 2, 3): every GRPOConfig setting of the TRL version we support is a
setting here, refused by name with a reason, or accepted as having no effect and named once in the log; null is
TRL's default; a recipe gets GRPOConfig's defaults (batch, loss type, β, no held-out split), not this trainer's."""
import dataclasses
import json

import pytest
import yaml
from test_trainer import _local_checkpoint

from rlkernels.train import main
from rlkernels.trainer import from_args
from rlkernels.trainer import run_config as C
from rlkernels.trainer import trl_names

trl = pytest.importorskip("trl")


def _defaults(*classes) -> dict:
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.init:
                out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def grpo_defaults() -> dict:
    """Every GRPOConfig setting at its default, as a recipe would spell it."""
    return _defaults(trl.GRPOConfig)


def script_defaults() -> dict:
    """The other three dataclasses `trl grpo` reads a recipe into (issue 40 item 1: their keys were unknown here)."""
    from trl.scripts.grpo import GRPOScriptArguments

    return _defaults(trl.ModelConfig, trl.ScriptArguments, GRPOScriptArguments)


@pytest.mark.parametrize("defaults", [grpo_defaults, script_defaults])
def test_every_setting_trl_grpo_reads_has_a_place_here(defaults):
    homeless = [name for name in defaults() if name not in C.FIELDS and trl_names.kind(
        trl_names.RENAMED.get(name, name)) is None and name not in trl_names.RENAMED]
    assert not homeless, homeless
    if defaults is grpo_defaults:
        assert set(trl_names.SAME_NAME) == set(grpo_defaults()) & set(C.FIELDS)
    for name, default in defaults().items():  # TRL's default is accepted wherever only some values are
        if name in trl_names.SAME_AS_HERE and default is not None:
            assert default in trl_names.SAME_AS_HERE[name][1], (name, default)


@pytest.fixture
def recipe_of_defaults(tmp_path):
    _local_checkpoint(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                              for a in range(4) for b in range(4)))
    values = {**grpo_defaults(), **script_defaults(), "output_dir": str(tmp_path / "out"), "max_steps": 1,
              "max_completion_length": 4}
    values.update(model_name_or_path=str(tmp_path / "m"), dataset_name=str(tmp_path / "d.jsonl"),
                  reward_funcs=[r"regex:(\d+)"])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_a_recipe_of_every_default_gets_trls_defaults(recipe_of_defaults):
    notes = []
    cfg, _ = from_args(["--config", str(recipe_of_defaults)], notes)
    # GRPOConfig: 8 completions per device and step, 8 per prompt, one optimizer step; dapo, β 0, ε 0.2 both ways
    assert (cfg.prompts_per_step, cfg.num_generations, cfg.minibatches) == (1, 8, 1)
    assert (cfg.algo, cfg.kl_coef, cfg.clip_low, cfg.clip_high, cfg.scale_rewards) == ("dapo", 0.0, 0.2, 0.2, "group")
    assert (cfg.lr, cfg.lr_scheduler_type, cfg.lr_warmup_steps, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon) == (
        1e-6, "linear", 0, 0.9, 0.999, 1e-8)
    assert (cfg.temperature, cfg.seed, cfg.logging_steps, cfg.ckpt_every, cfg.gradient_checkpointing) == (
        1.0, 42, 10, 500, True)
    assert cfg.eval_size == 0  # eval_strategy no: no evaluation at all, every prompt trains (issue 40 item 6)
    ignored, differs = notes
    assert ignored.startswith("TRL settings with no effect here: ") and "use_liger_kernel" in ignored
    assert differs.startswith("TRL recipe: trains as trl grpo does but ")


def test_a_recipe_of_every_default_trains(recipe_of_defaults, capsys, monkeypatch):
    from rlkernels.trainer import generation

    evaluated = []
    monkeypatch.setattr(generation, "evaluate", lambda *a, **k: evaluated.append(1) or (0.0, []))
    assert main(["--config", str(recipe_of_defaults), "--progress", "false"]) == 0
    out = capsys.readouterr().out
    assert out.count("TRL settings with no effect here") == 1 and "16 training prompts" in out
    summary = json.loads((recipe_of_defaults.parent / "out" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["config"]["algo"] == "dapo"
    # issue 40 item 6: TRL's defaults ask for no evaluation, and none runs (64 greedy completions before and after)
    assert evaluated == [] and summary["eval_reward_before"] is None and summary["eval_reward_after"] is None


def test_null_is_trls_default_and_other_values_are_refused_by_name(tmp_path):
    _local_checkpoint(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n')
    base = {"model_name_or_path": str(tmp_path / "m"), "dataset_name": str(tmp_path / "d.jsonl"), "max_steps": 2}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**base, "activation_checkpointing": None, "epsilon_high": None, "beta": None}))
    cfg, _ = from_args(["--config", str(path)])
    assert (cfg.gradient_checkpointing, cfg.clip_high, cfg.kl_coef) == (True, 0.2, 0.0)
    path.write_text(yaml.safe_dump({**base, "off_policy_mask_threshold": 0.5, "optim": "sgd"}))
    with pytest.raises(ValueError) as err:
        from_args(["--config", str(path)])
    for text in ("off_policy_mask_threshold=0.5 (no off-policy", "optim='sgd' (the optimizer is"):
        assert text in str(err.value)


def test_trls_loss_settings_reach_the_loss(tmp_path):
    """delta, top_entropy_quantile, use_bias_correction_kl, sapo_temperature_* and vespo_* are PolicyLossConfig's
    fields, as rlkernels.integrations.trl maps them for TRL's own trainer."""
    from rlkernels.trainer.config_parts import loss_config

    _local_checkpoint(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n')
    base = {"model_name_or_path": str(tmp_path / "m"), "dataset_name": str(tmp_path / "d.jsonl"), "max_steps": 2}
    for settings, expected in (
            ({"loss_type": "grpo", "delta": 1.5, "top_entropy_quantile": 0.2, "beta": 0.04,
              "use_bias_correction_kl": True}, dict(delta=1.5, top_entropy_quantile=0.2, kl_bias_correction=True)),
            ({"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
             dict(sapo_tau_pos=0.5, sapo_tau_neg=2.0)),
            ({"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 4.0}, dict(vespo_k_pos=1.0, vespo_lambda_neg=4.0))):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({**base, **settings}))
        cfg, _ = from_args(["--config", str(path)])
        got = loss_config(cfg, cfg.num_generations)
        assert {k: getattr(got, k) for k in expected} == expected, settings
    path.write_text(yaml.safe_dump({**base, "loss_type": "grpo", "delta": -1.0}))
    with pytest.raises(ValueError, match="^the loss of --algo grpo: delta"):
        from_args(["--config", str(path)])


def test_a_recipe_asking_for_evaluation_holds_prompts_out(tmp_path):
    _local_checkpoint(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "m"), "dataset_name": str(tmp_path / "d.jsonl"),
                                    "max_steps": 40, "eval_strategy": "steps", "eval_steps": 10}))
    cfg, _ = from_args(["--config", str(path)])
    assert (cfg.eval_holdout, cfg.eval_every) == (True, 10)
