"""One TRL GRPO recipe run by `trl grpo --config` and by `rlkernels train --config`, interleaved, on this machine
(issue 40 item 9): wall time, time per step and peak memory of each process.

    python -m benchmarks.trl_recipe_race [--vocab 32768] [--hidden 256] [--layers 4] [--rounds 3] [--steps 6]
                                         [--completion-length 24] [--threads 2] [--out DIR]

Both read the same recipe file (TRL's keys only) over the same offline small Qwen2 built from a config (`--hidden`,
`--layers`, a byte-level tokenizer, the embedding and head of `--vocab` rows) and the same prompts and reward;
`--completion-length` is the recipe's max_completion_length (the tokens per step that the loss head sees). Runs
alternate (trl, ours, trl, ours, ...) so that a change in the machine's load falls on both. Per process: the wall time from start to
exit (imports and model loading included), the mean of each tool's own step times after the first step (TRL's
`step_time` metric; ours, `time_s` of metrics.jsonl), and the peak resident memory (`wait4`'s ru_maxrss). The
table goes to stdout, one row per run as it ends, then the medians; --out keeps the runs' folders.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
reward_funcs: [race_rewards.shorter]
max_steps: {steps}
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: {completion_length}
learning_rate: 1.0e-5
bf16: false
use_cpu: true
report_to: none
save_strategy: "no"
logging_steps: 1
seed: 0
"""
REWARD = "def shorter(completions, **kwargs):\n    return [-len(c) / 50 for c in completions]\n"


def build_inputs(root: str, vocab: int, hidden: int, layers: int, completion_length: int) -> dict:
    """The model folder, the prompts and the reward module (offline, from configs)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    model = os.path.join(root, "model")
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save_pretrained(model)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=max(vocab, len(tok)), hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=max(256, completion_length + 64),
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 bos_token_id=None)).save_pretrained(model)
    data = os.path.join(root, "prompts")  # a folder of data files: what both read as dataset_name
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": f"{a} plus {b} is"}) + "\n" for a in range(8) for b in range(8))
    with open(os.path.join(root, "race_rewards.py"), "w") as f:
        f.write(REWARD)
    return {"model": model, "data": data}


def run_one(tool: str, root: str, inputs: dict, steps: int, n: int, threads: int, completion_length: int) -> dict:
    """One process of `tool` (trl | rlkernels) on the recipe; its times and peak memory."""
    out = os.path.join(root, f"{tool}-{n}")
    recipe = os.path.join(root, f"{tool}-{n}.yaml")
    with open(recipe, "w") as f:
        f.write(RECIPE.format(out=out, steps=steps, completion_length=completion_length, **inputs))
    bindir = os.path.dirname(sys.executable)
    argv = ([os.path.join(bindir, "trl"), "grpo", "--config", recipe] if tool == "trl" else
            [os.path.join(bindir, "rlkernels"), "train", "--config", recipe, "--progress", "false"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])), "TOKENIZERS_PARALLELISM": "false",
           "ACCELERATE_USE_CPU": "true"}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(argv)} failed (status {status}):\n{log[-4000:]}")
    return {"tool": tool, "wall_s": wall, "step_s": _step_times(tool, out, log), "peak_mb": usage.ru_maxrss / 1024}


def _step_times(tool: str, out: str, log: str) -> float:
    """The mean of the tool's own step times, the first step (warm-up of caches and allocator) left out."""
    if tool == "trl":
        times = [float(t) for t in re.findall(r"'step_time': '?([0-9.eE+-]+)", log)]
    else:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            times = [json.loads(line)["time_s"] for line in f]
    times = times[1:] or times
    return statistics.mean(times) if times else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--completion-length", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="", help="keep the runs here (default: a temporary folder, removed)")
    args = parser.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="trl-race-")
    os.makedirs(root, exist_ok=True)
    inputs = build_inputs(root, args.vocab, args.hidden, args.layers, args.completion_length)
    print(f"V = {args.vocab}, H = {args.hidden}, {args.layers} layers, completions of {args.completion_length} tokens, "
          f"{args.steps} steps, {args.threads} threads; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'run':<14}{'wall s':>9}{'s/step':>9}{'peak MB':>10}", flush=True)
    rows = []
    for n in range(args.rounds):
        for tool in ("trl", "rlkernels"):
            row = run_one(tool, root, inputs, args.steps, n, args.threads, args.completion_length)
            rows.append(row)
            print(f"{tool + ' #' + str(n):<14}{row['wall_s']:>9.1f}{row['step_s']:>9.2f}{row['peak_mb']:>10.0f}",
                  flush=True)
    med = {t: {k: statistics.median(r[k] for r in rows if r["tool"] == t) for k in ("wall_s", "step_s", "peak_mb")}
           for t in ("trl", "rlkernels")}
    trl, ours = med["trl"], med["rlkernels"]
    print(f"medians: trl grpo {trl['wall_s']:.1f} s ({trl['step_s']:.2f} s/step, {trl['peak_mb']:.0f} MB); "
          f"rlkernels train {ours['wall_s']:.1f} s ({ours['step_s']:.2f} s/step, {ours['peak_mb']:.0f} MB): "
          f"{trl['wall_s'] / ours['wall_s']:.2f}x faster in wall time, {trl['step_s'] / ours['step_s']:.2f}x per step, "
          f"{ours['peak_mb'] / trl['peak_mb']:.2f}x the memory")
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
