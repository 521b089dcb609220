"""The README a newcomer reads (issue 25): Install first, no package index it is not on, three quick starts in its
first ~40 lines, each run as written. The Python ones run in a process of their own (readme_worker.py), whose
offline Hugging Face cache holds a tiny model under the name they load; TRL's own GRPO script runs there too,
through `rlkernels trl grpo`. The trainer's runs through the console script, with flags that shorten it."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from doc_blocks import ROOT, block

QUICK_STARTS = ("quickstart-train", "quickstart-trl", "quickstart-transformers")


def test_readme_opens_with_install_and_the_quick_starts():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert [h for h in lines if h.startswith("## ")][:2] == ["## Install", "## Quick start"]
    starts = {name: lines.index(f"<!-- example: {name} -->") + 1 for name in QUICK_STARTS}
    assert max(starts.values()) <= 42, starts
    assert len(lines) <= 150


def test_no_package_index_claims():
    """rlkernels is installed from a clone: no `pip install rlkernels` or `'rlkernels[extra]'`, in any doc."""
    for doc in ["README.md", *(f"docs/{name}" for name in os.listdir(ROOT / "docs"))]:
        text = (ROOT / doc).read_text()
        assert not re.search(r"pip install[^\n`&;|]*(?<![\w/.-])rlkernels\b|rlkernels\[", text), doc


def _stand_in(cache, repo: str) -> str:
    """A tiny Qwen2 and a byte-level BPE tokenizer (no merges: a token per byte) as the Hugging Face cache holds
    `repo`, offline; the snapshot folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save_pretrained(snapshot)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 bos_token_id=None)).save_pretrained(snapshot)
    return str(snapshot)


def _offline_env(tmp_path):
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
reward_funcs: [quick_rewards.shorter]
max_steps: 2
per_device_train_batch_size: 4
num_generations: 4
max_completion_length: 8
learning_rate: 1.0e-5
bf16: false
report_to: none
save_strategy: "no"
logging_steps: 1
"""


@pytest.fixture(scope="module")
def quick_starts(tmp_path_factory):
    """The worker's results: the README's TRL and transformers quick starts, then TRL's GRPO script."""
    pytest.importorskip("trl")
    tmp = tmp_path_factory.mktemp("quickstart")
    names = set(re.findall(r'"(\w[\w.-]*/[\w.-]+)"', block("quickstart-trl") + block("quickstart-transformers")))
    model = [_stand_in(tmp / "hf" / "hub", name) for name in sorted(names)][0]
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(3)
                                                      for b in range(4)))
    (tmp / "quick_rewards.py").write_text("def shorter(completions, **kwargs):\n"
                                          "    return [-len(c) / 10 for c in completions]\n")
    recipe = tmp / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=model, data=tmp / "data", out=tmp / "trl-out"))
    worker = os.path.join(os.path.dirname(__file__), "readme_worker.py")
    proc = subprocess.run([sys.executable, worker, str(recipe), str(tmp / "result.json")], cwd=tmp,
                          env=_offline_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp / "result.json").read_text())


def test_trl_quick_start_trains_trl_grpotrainer_with_the_fused_loss(quick_starts):
    trl = quick_starts["trl"]
    assert trl["fused_calls"] >= 4 and trl["classes"] == ["trl.trainer.grpo_trainer.GRPOTrainer"]


def test_trl_cli_script_uses_the_fused_loss(quick_starts):
    assert quick_starts["trl_cli"]["fused_calls"] >= 2  # TRL's scripts/grpo.py, its GRPOTrainer patched by apply()


def test_transformers_quick_start_equals_the_plain_loss(quick_starts):
    got = quick_starts["transformers"]
    assert got["grad_max"] > 1e-6 and got["grad_diff"] <= 1e-5 * max(1.0, got["grad_max"])


def test_trainer_quick_start_through_the_console_script(tmp_path):
    """`rlkernels train` as the README writes it, shortened: a run folder that loads with the Auto classes, a log
    that says the process layout in a few lines."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    command = block("quickstart-train").split()
    assert command[0] == "rlkernels" and shutil.which("rlkernels"), "the console script is not installed"
    out = tmp_path / "run"
    short = ["--steps", "2", "--warmup-steps", "10", "--eval-size", "32", "--prompts-per-step", "8", "--eval-every", "2",
             "--progress", "false", "--out", str(out)]
    proc = subprocess.run([shutil.which("rlkernels"), *command[1:], *short], env=_offline_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout.splitlines()
    assert "one process on cpu" in proc.stdout and len(log) <= 20, log
    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out)("12+34=")["input_ids"][1:] == [4, 5, 13, 6, 7, 14]
    assert (out / "metrics.png").exists()
