"""The prompts of a `--dataset` run, as TRL reads them: a local JSON/JSONL/CSV/Parquet file or a `datasets`
folder (`save_to_disk`'s, or a folder of data files) or a Hub dataset id, a split, and a prompt column.

Every example is a dict of the row's columns, the prompt under "prompt" (from `--prompt-column`), a string or
a conversation (a list of {"role": str, "content": str}); the other columns (`answer`, `solution`, ...) reach
the reward functions as keyword arguments, as in TRL. Held out: `--eval-dataset` (or `--eval-split`), else the
last `--eval-size` rows of a seeded shuffle of the training split, at most half of them.
"""
from __future__ import annotations

import os
import random
import re
from typing import List, Optional, Tuple

FILE_KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMS = "a .json, .jsonl, .csv or .parquet file, a datasets folder, or a Hub dataset id (owner/name)"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # and no such file or folder here


def _load(path: str, split: str, flag: str, split_flag: str, subset: Optional[str] = None) -> List[dict]:
    """The rows of `split` of the dataset at `path`: a local file or folder, or a Hub dataset's id, loaded as
    `trl grpo` loads it (`load_dataset(id, name=subset)`; needs the network or the datasets cache)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # no "Generating train split" bars in the run's log
    try:
        if os.path.isdir(path):
            saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
            ds = datasets.load_from_disk(path) if saved else datasets.load_dataset(path, name=subset)
        elif not os.path.exists(path) and HUB_ID.fullmatch(path):
            ds = datasets.load_dataset(path, name=subset)
        else:
            kind = FILE_KINDS.get(os.path.splitext(path)[1].lower())
            if kind is None:
                raise ValueError(f"{flag}: expected {FORMS}, got {path!r}")
            if os.path.getsize(path) == 0:  # datasets says only "StopIteration"
                raise ValueError(f"{flag}: {path!r} is empty (no prompts)")
            ds = datasets.load_dataset(kind, data_files=path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{split_flag}: {path!r} has no split {split!r} (it has {', '.join(ds)})")
            ds = ds[split]
        return ds.to_list()  # the rows are decoded here (a file that is not UTF-8 fails here)
    except ValueError as e:
        if str(e).startswith((flag, split_flag)):
            raise
        raise ValueError(f"{flag}: cannot read {path!r} ({' '.join(str(e).split())[:300]})") from None
    except Exception as e:  # pyarrow's parse errors, a folder without data files, ...
        while e.__cause__ is not None and str(e).startswith("An error occurred"):  # datasets' generic wrapper
            e = e.__cause__
        raise ValueError(f"{flag}: cannot read {path!r} as {FORMS} ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]})") from None
    finally:
        if bars:
            datasets.enable_progress_bars()


def _is_conversation(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def examples(path: str, split: str, prompt_column: str, flag: str, split_flag: str, subset: Optional[str] = None,
             system_prompt: Optional[str] = None) -> List[dict]:
    """The rows of a dataset as examples (module docstring), checked; with `system_prompt` (open-r1's) every prompt
    a conversation that starts with it (a string prompt: [system, user])."""
    rows = _load(path, split, flag, split_flag, subset)
    if rows and prompt_column not in rows[0]:
        raise ValueError(f"--prompt-column: {path!r} has no column {prompt_column!r} (its columns: "
                         f"{', '.join(rows[0])})")
    out = []
    for n, row in enumerate(rows):
        prompt = row.pop(prompt_column)
        if not (isinstance(prompt, str) or _is_conversation(prompt)):
            raise ValueError(f"{flag}: {path!r} row {n}: expected a prompt that is a string or a conversation "
                             f"[{{\"role\": str, \"content\": str}}, ...], got {str(prompt)[:80]!r}")
        if system_prompt is not None:
            turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if turns[0]["role"] != "system":
                prompt = [{"role": "system", "content": system_prompt}] + turns
        out.append({"prompt": prompt, **row})
    return out


def load(source) -> Tuple[List[dict], List[dict], str]:
    """(train examples, held-out examples, a line that says where the held-out ones come from); `source`: a
    config_parts.Data (or what has its fields)."""
    train = examples(source.dataset, source.dataset_split, source.prompt_column, "--dataset", "--dataset-split",
                     source.dataset_config, source.system_prompt)
    if source.eval_size == 0:
        if not train:
            raise ValueError(f"--dataset: no prompts in {source.dataset!r}")
        random.Random(source.seed + 12345).shuffle(train)
        return train, [], "no evaluation (--eval-size 0)"
    if source.eval_dataset or source.eval_split:
        where, split = source.eval_dataset or source.dataset, source.eval_split or "train"
        flag = "--eval-dataset" if source.eval_dataset else "--dataset"
        subset = source.dataset_config if where == source.dataset else None  # TRL's is of its one dataset
        held_out = examples(where, split, source.prompt_column, flag, "--eval-split", subset,
                            source.system_prompt)[:source.eval_size]
        if not train or not held_out:
            raise ValueError(f"{'--dataset' if not train else flag}: no prompts in {where!r}")
        return train, held_out, f"{len(held_out)} held-out prompts from {where} ({split})"
    if len(train) < 2:
        raise ValueError(f"--dataset: {source.dataset!r} needs at least 2 prompts (some are held out), has {len(train)}")
    random.Random(source.seed + 12345).shuffle(train)
    if not source.eval_holdout:  # a TRL recipe without evaluation: every prompt trains, a few are also evaluated
        evaluated = train[:source.eval_size]
        return train, evaluated, (f"{len(evaluated)} of the {len(train)} training prompts of {source.dataset} evaluated "
                                  f"(not held out: the recipe asks for no evaluation)")
    k = min(source.eval_size, len(train) // 2)
    return train[k:], train[:k], (f"{k} of the {len(train)} prompts of {source.dataset} held out for evaluation "
                                  f"(--eval-size; --eval-dataset for a separate set)")
