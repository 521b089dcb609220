"""The trainer's flat config: one dataclass, overridden by a JSON file and by `--key value` flags.

Precedence: defaults < `--config FILE.json` < flags. On `--resume DIR` the checkpoint's config
replaces the defaults (flags still win, e.g. `--steps` to train further).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import typing
from typing import List, Optional

from ..losses.presets import NAMES as ALGOS
from . import device

REWARD_KINDS = "exact | regex:PATTERN | module:function"
FLOAT32_MAX = 3.4028234663852886e38  # the policy's logits, log-probs and rewards are float32
MAX_DIGITS = 3  # the demo task lists all 10^(2·digits) operand pairs: 4 digits would take tens of GB


@dataclasses.dataclass
class Config:
    # run
    out: str = ""                  # output folder; "" = runs/<timestamp>
    seed: int = 0
    threads: int = 0               # torch threads; 0 = 1 for the demo model, else min(cpu count, 4) / ranks
    resume: str = ""               # a run folder (or checkpoint file) to continue exactly
    progress: bool = True          # tqdm bar
    device: str = "auto"           # auto (cuda if available, else cpu) | cpu | cuda | cuda:N; under torchrun
                                   # cuda is cuda:LOCAL_RANK. A resumed run takes this from its own flags
    dtype: str = "auto"            # forward passes under autocast: auto (bfloat16 on a GPU that has it,
                                   # else float32) | float32 | bfloat16; weights stay float32
    # model; "" = the built-in tiny Llama with a character tokenizer (offline demo)
    model: str = ""
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    lora_rank: int = 0             # > 0: train LoRA adapters through peft
    lora_alpha: float = 16.0
    lora_target: str = "all-linear"  # LoRA modules: all-linear (every linear layer but the head) or name,name,...
    merge_lora: bool = False       # save the merged weights, not the adapter (the demo model is always merged)
    gradient_checkpointing: bool = False  # recompute each layer's activations in the backward (HF's, non-reentrant):
                                          # less memory for longer sequences, about one more forward of time
    # task; prompts "" = synthetic addition "a+b=" with `digits`-digit operands
    prompts: str = ""              # JSONL of {"prompt": str or [{"role", "content"}, ...], "answer": ...}
    # rewards: exact | regex:PATTERN | module:function ((prompt, completion, answer) -> float, or TRL's
    # (prompts, completions, **columns) -> list[float]; None = not applicable to that completion); several
    # as --reward A B or --reward A --reward B; none given = exact (none at all with --reward-model)
    reward: List[str] = dataclasses.field(default_factory=list)
    reward_model: str = ""         # a local sequence-classification model (one label) scoring prompt + completion
    # one weight per reward, the --reward functions then --reward-model; [] = all 1.0. A completion's reward
    # is Σ weight·reward over those that did not return None
    reward_weights: List[float] = dataclasses.field(default_factory=list)
    digits: int = 2
    eval_size: int = 256           # held-out prompts, greedy exact-match
    # supervised warm-up (demo task only): leaves room for RL to improve
    warmup_steps: int = 250
    warmup_batch: int = 64
    warmup_lr: float = 1e-3
    # RL
    algo: str = "grpo"             # a preset of rlkernels.presets (ppo, grpo, gspo, ...)
    steps: int = 150
    prompts_per_step: int = 32
    num_generations: int = 8       # completions per prompt (the GRPO group)
    max_new_tokens: int = 4
    temperature: float = 0.7       # < 1: samples nearer the greedy policy that eval measures
    lr: float = 1e-4
    lr_warmup_steps: int = 5       # RL learning rate ramps linearly from lr/N to lr over the first N steps
    epochs: int = 1                # μ: optimisation passes over each rollout batch
    minibatches: int = 2           # optimizer steps per epoch (split by prompt groups)
    max_grad_norm: float = 1.0
    kl_coef: Optional[float] = None       # None = the preset's (grpo 0.04 k3 in the loss; ppo 0.05 k1 in the reward)
    kl_target: Optional[float] = None     # PPO: adaptive β towards this KL; None = fixed β
    clip_low: Optional[float] = None      # None = the preset's
    clip_high: Optional[float] = None
    entropy_coef: float = 0.0
    loss_path: str = "linear"      # linear (from hidden states, no logits) | fused (fused_policy_loss) | split
    # PPO critic
    critic: str = "shared"         # shared (value head on the actor trunk) | separate (own trunk)
    vf_coef: float = 0.5
    vf_clip: Optional[float] = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    # options
    pods_keep: int = 0             # > 0: PODS, keep m of the num_generations rollouts per prompt
    dynamic_sampling: bool = False # DAPO: drop groups whose rewards are all equal, sample more to refill
    max_gen_batches: int = 4       # dynamic sampling: rollout batches per step at most (then train on what is kept)
    overlong_buffer: int = 0       # > 0: DAPO overlong penalty over the last `buffer` tokens
    tree: bool = False             # Tree-GRPO: branch continuations from sampled prefixes
    tree_roots: int = 2            # trees per prompt (num_generations = roots × branches)
    # logging / checkpoints
    eval_every: int = 20
    ckpt_every: int = 50

    def __post_init__(self):
        # a field of several values also takes one (Config(reward="exact"), and checkpoints from before the
        # list fields), and a list (from JSON)
        for name in MULTI:
            v = getattr(self, name)
            setattr(self, name, list(v) if isinstance(v, (list, tuple)) else [v])


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
MULTI = tuple(n for n, t in typing.get_type_hints(Config).items() if typing.get_origin(t) is list)  # several values
CHOICES = {"algo": ALGOS, "critic": ("shared", "separate"), "loss_path": ("linear", "fused", "split")}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(name: str):
    """(the type of a value, whether it may be None): for a field of several values, that of each."""
    hint = typing.get_type_hints(Config)[name]
    if name in MULTI:
        return typing.get_args(hint)[0], False
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return (args[0] if args else hint), hint != (args[0] if args else hint)


def convert(name: str, value, source: str = "flag"):
    """`value` (a string from the command line, or a JSON value) as the field's type; for a field of
    several values, a list of them (or one)."""
    if name in MULTI:
        values = value if isinstance(value, (list, tuple)) else [value]
        return [_convert_one(name, v, source) for v in values]
    return _convert_one(name, value, source)


def _convert_one(name: str, value, source: str):
    where = _flag(name) if source == "flag" else f"{source}: key {name!r}"
    typ, optional = _base_type(name)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        what = {"int": "an int", "float": "a number", "bool": "a bool (true/false)", "str": "a string"}[typ.__name__]
        raise ValueError(f"{where}: expected {what}{' or none' if optional else ''}, got {value!r}") from None


def _unknown(name: str, where: str) -> ValueError:
    close = difflib.get_close_matches(name, list(FIELDS), n=1)
    hint = f"; did you mean {_flag(close[0]) if where == 'flag' else repr(close[0])}?" if close else ""
    what = f"unknown flag {_flag(name)}" if where == "flag" else f"{where}: unknown key {name!r}"
    return ValueError(what + hint)


def parse_flags(argv: List[str]) -> dict:
    """`--key value` / `--key=value` / bare `--flag` (bools) → {field: value}; `--config` kept as is. A field of
    several values takes every value up to the next flag, and adds those of a repeated flag."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"unexpected argument {arg!r}: flags look like --key value")
        key, eq, value = arg[2:].partition("=")
        name = key.replace("-", "_")
        if name != "config" and name not in FIELDS:
            raise _unknown(name, "flag")
        if name in MULTI:
            values = [value] if eq else _values(argv, i + 1)
            if not values:
                raise ValueError(f"{_flag(name)}: expected one or more values")
            out[name] = out.get(name, []) + convert(name, values)
            i += 1 + (0 if eq else len(values))
            continue
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if name != "config" and _base_type(name)[0] is bool and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None:
                raise ValueError(f"{_flag(name)}: expected a value")
            else:
                value, i = nxt, i + 1
        out[name] = value if name == "config" else convert(name, value)
        i += 1
    return out


def _values(argv: List[str], start: int) -> List[str]:
    """The arguments from `start` up to the next flag."""
    end = start
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return argv[start:end]


def load_json(path: str) -> dict:
    """A JSON object of config keys, converted and checked."""
    if not os.path.isfile(path):
        raise ValueError(f"--config: no such file {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"--config: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a JSON object of config keys")
    out = {}
    for name, value in data.items():
        if name not in FIELDS:
            raise _unknown(name, f"--config {path}")
        out[name] = convert(name, value, f"--config {path}")
    return out


def from_args(argv: List[str]) -> tuple:
    """(Config, the names set explicitly) from command-line arguments."""
    flags = parse_flags(argv)
    values = load_json(flags.pop("config")) if "config" in flags else {}
    values.update(flags)
    cfg = Config(**values)
    validate(cfg)
    return cfg, set(values)


def validate(cfg: Config) -> None:
    """Raise a ValueError naming the flag of the first bad value."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{_flag(name)}: expected one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    device.check(cfg.device, cfg.dtype)
    for name in FIELDS:  # nan and inf pass comparisons like `> 0` (or fail them unclearly) and break training later
        values = getattr(cfg, name) if name in MULTI else (getattr(cfg, name),)
        for v in values:
            if _base_type(name)[0] is float and v is not None and not math.isfinite(v):
                raise ValueError(f"{_flag(name)}: expected a finite number, got {v}")
    positive = ("n_layer", "n_embd", "n_head", "digits", "eval_size", "steps", "prompts_per_step",
                "num_generations", "max_new_tokens", "epochs", "minibatches", "warmup_batch",
                "eval_every", "ckpt_every", "tree_roots", "max_gen_batches")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{_flag(name)}: expected an int >= 1, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "lr_warmup_steps", "lora_rank", "pods_keep", "overlong_buffer", "threads"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{_flag(name)}: expected an int >= 0, got {getattr(cfg, name)}")
    if not 0 <= cfg.seed < 2**32:  # torch.manual_seed takes 64 bits, and the trainer derives seed·1000 + rank
        raise ValueError(f"--seed: expected an int from 0 to 2**32 - 1, got {cfg.seed}")
    if not cfg.prompts and cfg.digits > MAX_DIGITS:
        raise ValueError(f"--digits: expected at most {MAX_DIGITS} (the demo task lists all 10^(2·digits) "
                         f"operand pairs in memory, and a tiny model learns no more), got {cfg.digits}")
    for name in ("temperature", "lr", "warmup_lr", "max_grad_norm", "lora_alpha"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{_flag(name)}: expected a number > 0, got {getattr(cfg, name)}")
    if 1 / cfg.temperature > FLOAT32_MAX:  # the ops scale float32 logits by 1/τ
        raise ValueError(f"--temperature: expected a number >= {1 / FLOAT32_MAX:.3g} (1/τ must fit float32), "
                         f"got {cfg.temperature}")
    for name in ("kl_coef", "kl_target", "vf_clip", "clip_low", "clip_high"):
        v = getattr(cfg, name)
        if v is not None and not v >= 0:
            raise ValueError(f"{_flag(name)}: expected a number >= 0 or none, got {v}")
    if not 0 <= cfg.gamma <= 1 or not 0 <= cfg.lam <= 1:
        raise ValueError(f"--gamma/--lam: expected values in [0, 1], got {cfg.gamma}, {cfg.lam}")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"--n-embd: must be a multiple of --n-head ({cfg.n_head}), got {cfg.n_embd}")
    if cfg.minibatches > cfg.prompts_per_step:
        raise ValueError(f"--minibatches: at most --prompts-per-step ({cfg.prompts_per_step}) "
                         f"(mini-batches hold whole prompt groups), got {cfg.minibatches}")
    if cfg.pods_keep and not 2 <= cfg.pods_keep < cfg.num_generations:
        raise ValueError(f"--pods-keep: expected 2 <= m < --num-generations ({cfg.num_generations}), got {cfg.pods_keep}")
    if cfg.tree:
        if cfg.algo == "ppo":
            raise ValueError("--tree: Tree-GRPO advantages are for the GRPO family, not --algo ppo")
        if cfg.num_generations % cfg.tree_roots or cfg.num_generations // cfg.tree_roots < 2:
            raise ValueError(f"--tree-roots: --num-generations ({cfg.num_generations}) must be a multiple "
                             f"of --tree-roots with at least 2 branches per tree, got {cfg.tree_roots}")
        if cfg.max_new_tokens < 2:
            raise ValueError("--max-new-tokens: --tree needs at least 2 (a prefix and a continuation)")
    if cfg.overlong_buffer and cfg.overlong_buffer >= cfg.max_new_tokens:
        raise ValueError(f"--overlong-buffer: expected < --max-new-tokens ({cfg.max_new_tokens}), got {cfg.overlong_buffer}")
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-rank: needs the optional package peft (pip install peft)")
    for spec in cfg.reward:
        if spec != "exact" and spec.split(":", 1)[0] not in ("regex", "module"):
            raise ValueError(f"--reward: expected {REWARD_KINDS}, got {spec!r}")
    if cfg.reward_model and not os.path.isdir(cfg.reward_model):
        raise ValueError(f"--reward-model: expected a local Hugging Face checkpoint folder, got {cfg.reward_model!r}")
    if cfg.prompts and not os.path.isfile(cfg.prompts):
        raise ValueError(f"--prompts: no such file {cfg.prompts!r}")
    if cfg.model and not os.path.isdir(cfg.model):
        raise ValueError(f"--model: expected a local Hugging Face checkpoint folder, got {cfg.model!r}")
    if cfg.resume and not (os.path.isdir(cfg.resume) or os.path.isfile(cfg.resume)):
        raise ValueError(f"--resume: no such run folder or checkpoint {cfg.resume!r}")


def describe(cfg: Config) -> str:
    """The config as printed at start: one `key = value` per line."""
    return "\n".join(f"  {k:<18} = {v!r}" for k, v in dataclasses.asdict(cfg).items())
