"""The run folder as a Hugging Face model: `save_pretrained` files beside the resumable checkpoint.

`AutoModelForCausalLM.from_pretrained(run_folder)` then loads the policy as it was at the last
checkpoint, and `AutoTokenizer.from_pretrained(run_folder)` its tokenizer (the demo's character
tokenizer as a `PreTrainedTokenizerFast`).
A LoRA run saves its adapter (loaded through peft on top of `--model`), or with `--merge-lora`
the merged weights; the demo's in-memory model has no base on disk, so its LoRA run is merged.
"""
from __future__ import annotations

import copy
import os
import shutil

from transformers.utils import logging as hf_logging

from . import run_folder

TMP = run_folder.EXPORT_TMP


def save_pretrained(policy, tok, out_dir: str, *, merge_lora: bool) -> None:
    """Write `policy` and `tok`'s Hugging Face tokenizer into `out_dir` as `save_pretrained` does."""
    model = policy
    if hasattr(policy, "merge_and_unload") and (merge_lora or not policy.peft_config["default"].base_model_name_or_path):
        model = copy.deepcopy(policy).merge_and_unload()  # training goes on with the adapters
    with run_folder.writing(out_dir):  # a full disk or a read-only folder: one line naming --out
        tmp = os.path.join(out_dir, TMP)
        run_folder.record(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tok.hf().save_pretrained(tmp)
        for name in os.listdir(tmp):
            run_folder.record(os.path.join(out_dir, name))
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
