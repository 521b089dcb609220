"""settings.py declares each trainer setting once (issue 40 item 12); what is derived from it agrees with it: the
docs' table, the TRL names the docs list, the parts of a run that read a setting, and the checks of its range."""
import dataclasses
import pathlib
import re

import pytest

from rlkernels.trainer import config_parts, run_config, settings, settings_docs, trl_names

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINER_MD = (ROOT / "docs" / "trainer.md").read_text()


def test_docs_table_is_the_settings():
    start = TRAINER_MD.index(settings_docs.TABLE_HEAD[0])
    end = TRAINER_MD.index(settings_docs.END, start)
    assert TRAINER_MD[start:end] == settings_docs.markdown_table(), \
        "docs/trainer.md: rewrite the table with `python -m rlkernels.trainer.settings_docs`"


def test_docs_trl_section_names_every_trl_name():
    start = TRAINER_MD.index("## TRL's names")
    section = TRAINER_MD[start:TRAINER_MD.index("\n## ", start)]
    named = set(re.findall(r"`(\w+)`", section))
    aliases = [a for a in trl_names.RENAMED if a not in trl_names.FORMER]
    assert not [a for a in aliases + list(trl_names.SAME_NAME) if a not in named]


def test_each_part_reads_settings_that_say_so():
    parts = {"data": config_parts.Data, "warmup": config_parts.Warmup, "sampling": config_parts.Sampling,
             "optimization": config_parts.Optimization, "logging": config_parts.Logging,
             "advantages": config_parts.Advantages}
    for name, field in settings.FIELDS.items():
        assert field.metadata["reads"] and set(field.metadata["reads"]) <= set(settings.READERS), name
    for part, cls in parts.items():
        for f in dataclasses.fields(cls):
            if f.name in settings.FIELDS:
                assert part in settings.FIELDS[f.name].metadata["reads"], (part, f.name)


@pytest.mark.parametrize("name, value, message", [  # written out here, not built from the bounds
    ("adam_beta1", 1.0, "--adam-beta1: expected a number in [0, 1), got 1.0"),
    ("gamma", 1.5, "--gamma: expected a number in [0, 1], got 1.5"),
    ("lam", -0.1, "--lam: expected a number in [0, 1], got -0.1"),
    ("lora_dropout", 1.0, "--lora-dropout: expected a number in [0, 1), got 1.0"),
    ("train_epochs", 2e6, "--train-epochs: expected a number in (0, 1e6] or none, got 2000000.0"),
    ("max_prompt_length", 0, "--max-prompt-length: expected an int >= 1 or none, got 0"),
    ("eval_size", -1, "--eval-size: expected an int >= 0, got -1"),
    ("lr", 0.0, "--lr: expected a number in (0, 1], got 0.0"),
    ("weight_decay", -1.0, "--weight-decay: expected a number >= 0, got -1.0"),
    ("seed", 2**32, "--seed: expected an int from 0 to 2**32 - 1, got 4294967296"),
])
def test_a_value_out_of_its_bounds_is_refused_by_name(name, value, message):
    with pytest.raises(ValueError) as e:
        run_config.validate(settings.Config(**{name: value}))
    assert str(e.value) == message


def test_every_bounded_default_is_within_its_bounds():
    demo = settings.Config()
    for name, bounds in settings.BOUNDS.items():
        assert getattr(demo, name) is None or bounds.holds(getattr(demo, name)), name
