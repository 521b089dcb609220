"""Issue 40 items 1 and 4: the keys of the three dataclasses `trl grpo` reads besides GRPOConfig (ModelConfig,
ScriptArguments, GRPOScriptArguments) and open-r1's script keys, which a recipe refused as unknown. Each is
implemented here, or refused by name with why (quantisation), or accepted as without effect."""
import pytest
import yaml
from test_trainer import _local_checkpoint

from rlkernels.trainer import data, from_args, rewards, task
from rlkernels.trainer import model as trainer_model

trl = pytest.importorskip("trl")
pytest.importorskip("peft")


def _recipe(tmp_path, **keys):
    if not (tmp_path / "m").exists():
        _local_checkpoint(tmp_path / "m")
        (tmp_path / "d.jsonl").write_text('{"problem": "1+1=", "answer": "2"}\n{"problem": "1+2=", "answer": "3"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "m"), "dataset_name": str(tmp_path / "d.jsonl"),
                                    "dataset_prompt_column": "problem", **keys}))
    return from_args(["--config", str(path)])[0]


def test_model_config_keys_reach_the_model_and_its_adapters(tmp_path):
    cfg = _recipe(tmp_path, attn_implementation="eager", use_peft=True, lora_r=4, lora_dropout=0.1, use_rslora=True,
                  lora_modules_to_save=["lm_head"], chat_template="{{ messages[0]['content'] }}")
    assert (cfg.prompt_column, cfg.lora_rank, cfg.lora_alpha) == ("problem", 4, 32.0)  # ModelConfig's lora_alpha
    model, tok = task.load_model(cfg.model, cfg.attn_implementation, cfg.chat_template)
    assert model.config._attn_implementation == "eager" and tok.hf().chat_template == cfg.chat_template
    wrapped = trainer_model.add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target, lora_dropout=cfg.lora_dropout,
                            target_parameters=cfg.lora_target_parameters, modules_to_save=cfg.lora_modules_to_save,
                            use_rslora=cfg.use_rslora, use_dora=cfg.use_dora)
    lora = wrapped.peft_config["default"]
    assert (lora.lora_dropout, lora.use_rslora, lora.use_dora, set(lora.modules_to_save)) == (0.1, True, False,
                                                                                             {"lm_head"})
    with pytest.raises(ValueError, match="^--attn-implementation: cannot load"):
        task.load_model(cfg.model, "no_such_attention")


def test_quantisation_and_streaming_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError) as err:
        _recipe(tmp_path, load_in_4bit=True, dataset_streaming=True, lora_task_type="SEQ_CLS")
    for text in ("load_in_4bit=True (the policy trains from float weights", "dataset_streaming=True (prompts are drawn",
                 "lora_task_type='SEQ_CLS' (the policy is a causal LM)"):
        assert text in str(err.value)
    _recipe(tmp_path, load_in_4bit=False, bnb_4bit_quant_type="nf4", ignore_bias_buffers=False)  # defaults: accepted


def test_open_r1_system_prompt_and_prompt_column(tmp_path):
    cfg = _recipe(tmp_path, system_prompt="Think first.")
    train, _, _ = data.load(type("Source", (), {**{f: getattr(cfg, f) for f in (
        "dataset", "dataset_config", "dataset_split", "prompt_column", "system_prompt", "eval_dataset", "eval_split",
        "eval_holdout", "seed")}, "eval_size": 0})())
    assert sorted(ex["prompt"][1]["content"] for ex in train) == ["1+1=", "1+2="]
    assert all(ex["prompt"][0] == {"role": "system", "content": "Think first."} for ex in train)


def test_a_hub_dataset_is_loaded_as_trl_grpo_loads_it(monkeypatch):
    import datasets

    calls = []

    def load_dataset(path, name=None, **kw):
        calls.append((path, name))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x", "answer": "y"}])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = data.examples("open-r1/some-math", "train", "prompt", "--dataset", "--dataset-split", "default")
    assert calls == [("open-r1/some-math", "default")] and rows == [{"prompt": "x", "answer": "y"}]


def test_trl_grpo_reward_functions_by_name():
    from trl import rewards as trl_rewards

    assert rewards.make_reward("think_format_reward") is trl_rewards.think_format_reward
    overlong = rewards.make_reward("get_soft_overlong_punishment")  # trl grpo's: max 1280, cache 256
    assert overlong(completion_ids=[[0] * 1024, [0] * 1152, [0] * 1281]) == [0.0, -0.5, -1.0]
    from_args(["--reward", "accuracy_reward", "--reward", "get_soft_overlong_punishment"])
