"""`--dataset` as TRL reads datasets (rlkernels/trainer/data.py): local JSON/JSONL/CSV/Parquet files and `datasets`
folders, a split and a prompt column, `answer` optional, every column to the reward functions, and a separate
held-out set. The runs reuse test_trainer's tiny demo model: seconds each."""
import json

import pytest
from test_trainer import TINY, run

datasets = pytest.importorskip("datasets")

from rlkernels.trainer import Config, data  # noqa: E402

ROWS = [{"question": f"{a}+{b}=", "answer": str(a + b), "difficulty": a} for a in range(4) for b in range(5)]


def _written(tmp_path, kind):
    """ROWS in the form `kind`, and the split --dataset-split reads."""
    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "csv":
        ds.to_csv(str(path))
    elif kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "saved":  # save_to_disk's folder, a DatasetDict
        datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(path))
    elif kind == "files":  # a folder of data files, one per split
        path.mkdir()
        (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved", "files"])
def test_every_form_reads_the_same_examples(tmp_path, kind):
    got = data.examples(_written(tmp_path, kind), "train", "question", "--dataset", "--dataset-split")
    expected = [{"prompt": r["question"], "answer": r["answer"], "difficulty": r["difficulty"]} for r in ROWS]
    if kind == "csv":  # CSV has no types: the sums are read back as numbers
        got = [{**r, "answer": str(r["answer"])} for r in got]
    assert got == expected


def test_dataset_errors_name_the_flag(tmp_path):
    path = _written(tmp_path, "saved")
    with pytest.raises(ValueError, match="^--dataset-split: .* has no split 'validation' \\(it has train, test\\)"):
        data.examples(path, "validation", "question", "--dataset", "--dataset-split")
    with pytest.raises(ValueError, match="^--prompt-column: .* has no column 'prompt' \\(its columns: question, answer"):
        data.examples(path, "train", "prompt", "--dataset", "--dataset-split")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="^--eval-dataset: expected a .json, .jsonl, .csv or .parquet file"):
        data.examples(str(tmp_path / "x.txt"), "train", "prompt", "--eval-dataset", "--eval-split")


def test_held_out_rows_are_stated_or_come_from_the_eval_dataset(tmp_path, capsys):
    path = _written(tmp_path, "saved")
    base = dict(dataset=path, prompt_column="question", prompts_per_step=4, warmup_batch=8)
    run(tmp_path / "a", steps=1, eval_size=6, **base)
    assert "14 training prompts, 6 of the 20 prompts of" in capsys.readouterr().out  # the split, said
    run(tmp_path / "b", steps=1, eval_split="test", **base)
    assert "20 training prompts, 3 held-out prompts from" in capsys.readouterr().out
    other = _written(tmp_path, "jsonl")
    run(tmp_path / "c", steps=1, eval_dataset=other, eval_size=5, **base)
    out = capsys.readouterr().out
    assert f"20 training prompts, 5 held-out prompts from {other} (train)" in out


SEEN = []


def difficulty_reward(prompts, completions, difficulty, answer, **kwargs):  # TRL's signature
    SEEN.append((len(prompts), list(difficulty), sorted(kwargs)))
    return [float(c.strip() == a) + 0.01 * d for c, a, d in zip(completions, answer, difficulty)]


def test_every_column_reaches_the_reward_in_a_run(tmp_path):
    SEEN.clear()
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["question"], "answer": r["answer"], "difficulty": r["difficulty"],
                                        "source": "sums"}) + "\n" for r in ROWS))
    run(tmp_path / "o", steps=1, dataset=str(path), eval_size=4, prompts_per_step=4, warmup_batch=8,
        reward=["test_trainer_data:difficulty_reward"])
    assert SEEN and all(kw == ["completion_ids", "log_extra", "log_metric", "source", "trainer_state"]  # TRL's too
                        for _, _, kw in SEEN)
    assert any(n == 4 * TINY["num_generations"] for n, _, _ in SEEN)  # a rollout batch, the groups' rows


def test_answer_is_optional_with_a_reward_that_needs_none(tmp_path):
    path = tmp_path / "d.csv"
    datasets.Dataset.from_list([{"prompt": r["question"]} for r in ROWS]).to_csv(str(path))
    summary, rows = run(tmp_path / "o", steps=1, dataset=str(path), eval_size=4, prompts_per_step=4, warmup_steps=0,
                        reward=["test_trainer_rewards:length_reward"])
    assert rows and summary["steps"] == 1
    with pytest.raises(ValueError, match="^--warmup-steps: the demo's supervised warm-up trains on the answer column"):
        run(tmp_path / "p", steps=1, dataset=str(path), eval_size=4, prompts_per_step=4,
            reward=["test_trainer_rewards:length_reward"])


def test_prompts_beyond_the_context_are_refused_or_cut_as_trl(tmp_path, capsys):
    """Issue 33: a 204-token prompt trained silently on a 16-position model; max_prompt_length was unknown."""
    from test_trainer import _local_checkpoint  # max_position_embeddings 32

    _local_checkpoint(tmp_path / "m")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1+" * n + "1=", "answer": str(n + 1)}) + "\n" for n in (1, 2, 30, 3)))
    common = dict(model=str(tmp_path / "m"), dataset=str(path), eval_size=1, prompts_per_step=2, steps=1,
                  max_new_tokens=4, reward=[r"regex:(\d+)"])
    with pytest.raises(ValueError, match=r"^--max-new-tokens: the longest prompt is 62 tokens, and 62 \+ 4 is more than "
                                         r"the 32 positions of the model .*give --max-prompt-length"):
        run(tmp_path / "o", **common)
    summary, rows = run(tmp_path / "p", **common, max_prompt_length=16)
    assert summary["steps"] == 1
    assert "1 of 4 prompts are longer than --max-prompt-length 16 tokens: they keep their last 16" in capsys.readouterr().out


def test_a_dataset_that_does_not_parse_names_the_cause(tmp_path):
    """Issue 33: "DatasetGenerationError: An error occurred while generating the dataset", without the cause."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"prompt": oops}\n')
    with pytest.raises(ValueError) as err:
        data.load(Config(dataset=str(path)))
    assert str(err.value).startswith(f"--dataset: cannot read {str(path)!r}") and "An error occurred" not in str(err.value)
