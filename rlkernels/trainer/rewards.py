"""Rewards as TRL users write them: several reward functions, each with a weight, and a reward model.

A completion's reward is Σ_i w_i · r_i over the functions that scored it: a function may return None
for a completion it does not apply to (TRL's convention), and that term is left out of the sum (TRL's
nansum). A completion that no function scored is an error here, where TRL drops it from its group's
baseline and gives it a zero advantage: this trainer's rewards also feed PPO's GAE, SNIS's baseline,
PODS and dynamic sampling, none of which has a notion of a row without a reward (docs/design.md §10).

Order: the `--reward` functions (or `train(reward_fn=...)`) in the order given, then `--reward-model`;
`--reward-weights` lists one weight per entry in that order.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import inspect
import math
import numbers
import os
import re
import reprlib
from typing import Callable, List, Optional

import torch

from .._groups import group_gather, group_index, group_sum
from . import plugins, trl_names
from .settings import FLOAT32_MAX, REWARD_FORMS

DEFAULT_REWARD = "exact"  # when neither --reward nor --reward-model is given
GDPO_EPS = 1e-4  # TRL's ε in (r − μ)/(σ + ε), at both steps of normalize_then_sum


# the keyword arguments TRL gives every reward function besides the dataset's columns (trl 1.16, GRPOTrainer)
TRL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclasses.dataclass
class TrainerState:
    """What a reward function sees of the run as TRL's `trainer_state` (transformers' TrainerState fields of the
    same names): the step being rolled out (0 before RL) and the last one."""
    global_step: int = 0
    max_steps: int = 0


class RewardLog:
    """What reward functions send through TRL's `log_metric(name, value)` and `log_extra(column, values)`: the
    metrics are averaged into the step's metrics row (TRL: over each logging step), the extra columns join the
    evaluation's completions in completions.jsonl (TRL: its completions table)."""

    def __init__(self):
        self.metrics, self.extra = collections.defaultdict(list), collections.defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def take_metrics(self) -> dict:
        out = {name: math.fsum(v) / len(v) for name, v in self.metrics.items() if v}
        self.metrics.clear()
        return out

    def take_extra(self) -> dict:
        out = dict(self.extra)
        self.extra.clear()
        return out


class RewardContext:
    """TRL's arguments to reward functions beyond the dataset's columns, for one run."""

    def __init__(self, max_steps: int):
        self.state, self.log = TrainerState(0, max_steps), RewardLog()

    def kwargs(self, completion_ids) -> dict:
        return {"completion_ids": completion_ids, "trainer_state": self.state, "log_extra": self.log.log_extra,
                "log_metric": self.log.log_metric}


def _parameters(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: per sample
        return {}


def check_signature(fn, what: str, columns, flag: str = "--reward") -> None:
    """Refuse, before any model loads, a reward function that cannot be called as it will be: TRL's form (a
    `completions` parameter) with a required parameter that is neither a column of the dataset nor one TRL
    passes, or a column that TRL's own arguments would shadow; the per-sample form without room for
    (prompt, completion, answer)."""
    params = _parameters(fn)
    if not params:
        return
    if "completions" in params:
        clash = sorted(set(columns) & set(TRL_ARGS))
        if clash:
            raise ValueError(f"--dataset: column {clash[0]!r} has the name of an argument TRL passes to reward "
                             f"functions ({', '.join(TRL_ARGS)}); rename the column for {flag} {what}")
        for p in params.values():
            required = p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            if required and p.name not in TRL_ARGS and p.name not in columns:
                raise ValueError(f"{flag} {what}: parameter {p.name!r} is neither a column of the dataset "
                                 f"({', '.join(columns) or 'none'}) nor an argument TRL passes ({', '.join(TRL_ARGS)})")
        return
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_more = any(p.kind == p.VAR_POSITIONAL for p in params.values())
    required = [p for p in params.values() if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if (len(positional) < 3 and not takes_more) or len(required) > 3 or any(p.kind == p.KEYWORD_ONLY for p in required):
        raise ValueError(f"{flag} {what}: expected (prompt, completion, answer) -> float, or TRL's (prompts, "
                         f"completions, **columns) -> list[float]; its parameters are ({', '.join(params)})")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rlkernels/


def _user_frames(e: BaseException) -> str:
    """Where the reward raised, as Python prints it, the frames of rlkernels and of asyncio left out: the user's
    file and line (issue 40 item 7: the one-line error did not say where)."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(_PACKAGE)
              and os.sep + "asyncio" + os.sep not in f.filename]
    return "\n" + "".join(traceback.format_list(frames)).rstrip() if frames else ""


def _awaited(value):
    """An async reward function's result (TRL awaits them too)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def checked_reward(reward_fn, name: str, flag: str = "--reward"):
    """`rewards(examples, completions) -> list of floats or None` from `reward_fn`, given the examples (dicts of
    a dataset's columns, data.py) and their completions: per sample, `reward_fn(prompt, completion, answer) ->
    float` (answer None where the dataset has none), or TRL's `reward_fn(prompts, completions, **columns) ->
    list[float]`, any function with a `completions` parameter (one call per batch; every column but the prompt
    as a keyword argument of per-completion lists; a conversation's completions as [{"role": "assistant",
    "content": text}], as TRL gives them). None is "not applicable". An error names `flag`, `name` and the
    prompt when it raises or returns anything but None or a finite number within float32 (a NaN reward would
    silently train nothing). TRL's form also gets `completion_ids`, `trainer_state`, `log_extra` and `log_metric`
    (`context`), all of them if it takes **kwargs, else those it names; an async function is awaited."""
    params = _parameters(reward_fn)
    trl_style = "completions" in params
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())

    def value(r, prompt):
        if r is None:
            return None
        try:
            v = float(r) if isinstance(r, numbers.Real) else None  # numbers.Real: no list, tensor
        except OverflowError:  # an int beyond float64
            v = None
        if v is None or not abs(v) <= FLOAT32_MAX:
            raise ValueError(f"{flag}: {name} returned {reprlib.repr(r)} on prompt {prompt!r}; expected a "
                             f"finite number within float32 range (or None: not applicable)")
        return v

    def call(prompt, *args, **kwargs):
        try:
            return _awaited(reward_fn(*args, **kwargs))
        except Exception as e:
            raise ValueError(f"{flag}: {name} raised {type(e).__name__} ({e}) on prompt {prompt!r}"
                             f"{_user_frames(e)}") from None

    def rewards(examples, completions, context=None):
        prompts = [ex["prompt"] for ex in examples]
        if not trl_style:
            return [value(call(p, p, c, ex.get("answer")), p) for p, c, ex in zip(prompts, completions, examples)]
        completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                       for p, c in zip(prompts, completions)]
        kwargs = {k: [ex.get(k) for ex in examples] for k in examples[0] if k != "prompt"}
        kwargs.update(context or {})
        if not takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        out = call(prompts[0], prompts=prompts, completions=completions, **kwargs)
        if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
            raise ValueError(f"{flag}: {name} returned {reprlib.repr(out)} for {len(prompts)} completions; "
                             f"expected a list of {len(prompts)} numbers (TRL's signature)")
        return [value(r, p) for r, p in zip(out, prompts)]

    return rewards


class RewardModel:
    """`--reward-model PATH`: a local sequence-classification model (one label) scoring prompt + completion.

    A plain prompt is scored as the text `prompt + completion`; a conversation as the reward tokenizer's
    chat template over its messages and an assistant message holding the completion (as TRL scores
    them). Rows are right-padded and scored in batches, without gradients, on the trainer's device and
    under its autocast; the reward is logits[:, 0]."""

    batch = 64

    def __init__(self, path: str, place):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model, loaded = AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, dtype=torch.float32, output_loading_info=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"--reward-model: cannot load {path!r} as a Hugging Face sequence classifier "
                             f"with one label ({e})") from None
        # transformers initialises at random what the checkpoint lacks: a causal LM's folder has no score head
        missing = sorted(loaded["missing_keys"])
        if missing:
            raise ValueError(f"--reward-model: expected a trained sequence classifier, and {path!r} lacks "
                             f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (transformers would "
                             f"initialise them at random; a causal LM's folder has no score head)")
        if self.model.config.num_labels != 1:
            raise ValueError(f"--reward-model: expected a sequence classifier with one label (its logit is the "
                             f"reward), and {path!r} has {self.model.config.num_labels}")
        if self.tok.pad_token_id is None:  # padding is needed to batch; the model reads the last non-pad token
            self.tok.pad_token = self.tok.eos_token
        if self.tok.pad_token_id is None:
            raise ValueError(f"--reward-model: the tokenizer in {path!r} has neither a pad nor an eos token")
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.model.to(place.device).eval().requires_grad_(False)
        self.place = place

    def texts(self, prompts, completions) -> List[str]:
        """What the model reads for each row."""
        if not isinstance(prompts[0], list):
            return [p + c for p, c in zip(prompts, completions)]
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("--reward-model: conversational prompts need a reward tokenizer with a chat template, "
                             "and this one has none")
        return [self.tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts, completions, **columns) -> List[float]:  # TRL's signature; the columns unused
        texts = self.texts(prompts, completions)
        scores = []
        for i in range(0, len(texts), self.batch):
            enc = self.tok(texts[i:i + self.batch], return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False).to(self.place.device)
            with self.place.autocast():
                scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores


def _name(fn) -> str:
    """A callable's name as TRL logs it: a partial's function, else `__name__`, else its class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _spec_name(spec: str, fn) -> str:
    return spec if spec == "exact" else "regex" if spec.startswith("regex:") else _name(fn)


def _unique(names: List[str]) -> List[str]:
    """Metric names: a repeated name gets _2, _3, ... so that no two functions share a metric."""
    out = []
    for n in names:
        k, new = 1, n
        while new in out:
            k += 1
            new = f"{n}_{k}"
        out.append(new)
    return out


class Rewards:
    """The reward of a run: callable as `rewards(examples, completions) -> list[float]` (the weighted sums, the
    examples as data.py makes them); `score` also returns each function's values, None where it did not apply."""

    def __init__(self, fns, names: List[str], labels: List[str], weights: List[float]):
        self.fns, self.names, self.labels, self.weights = fns, _unique(names), labels, weights

    @property
    def label(self) -> str:
        """What the reward is, for logs and plots: `exact`, or `0.5·exact + 1·rm`."""
        if all(w == 1.0 for w in self.weights):
            return " + ".join(self.names)
        return " + ".join(f"{w:g}·{n}" for w, n in zip(self.weights, self.names))

    def score(self, examples, completions, context=None):
        """(weighted sums, one list of values or None per function); `context`: the rest of TRL's arguments
        (completion_ids, trainer_state, log_extra, log_metric)."""
        parts = [fn(examples, completions, context) for fn in self.fns]
        totals = [self._total(row, ex["prompt"], c) for row, ex, c in zip(zip(*parts), examples, completions)]
        return totals, parts

    def __call__(self, examples, completions, context=None) -> List[float]:
        return self.score(examples, completions, context)[0]

    def _total(self, row, prompt, completion) -> float:
        terms = [w * r for w, r in zip(self.weights, row) if r is not None]
        if not terms:
            raise ValueError(f"{' and '.join(self.labels)} returned None on prompt {prompt!r} (completion "
                             f"{completion!r}); some reward must score every completion")
        total = math.fsum(terms)
        if not abs(total) <= FLOAT32_MAX:
            raise ValueError(f"--reward-weights: the weighted reward {total} on prompt {prompt!r} is beyond float32 "
                             f"range (rewards {list(row)}, weights {self.weights})")
        return total


def reward_functions(specs, reward_model: str, weights, reward_fn=None) -> tuple:
    """([(callable, metric name, flag, what errors call it)], weights) for the run, without loading the reward model
    (the caller adds it): `specs`, `reward_model`, `weights` are --reward's, --reward-model's, --reward-weights'. Checks
    the number of weights now, before any work."""
    if reward_fn is not None:
        given = reward_fn if isinstance(reward_fn, (list, tuple)) else [reward_fn]
        if not given or not all(callable(f) for f in given):
            raise ValueError(f"reward_fn: expected a callable or a list of callables, got {reprlib.repr(reward_fn)}")
        fns = [(f, _name(f), "--reward", getattr(f, "__qualname__", repr(f))) for f in given]
    else:
        specs = specs or (() if reward_model else (DEFAULT_REWARD,))
        fns = []
        for spec in specs:
            f = make_reward(spec)
            fns.append((f, _spec_name(spec, f), "--reward", spec))
    n = len(fns) + bool(reward_model)
    weights = list(weights) or [1.0] * n
    if len(weights) != n:
        what = f"{len(fns)} reward function{'s' if len(fns) != 1 else ''}"
        what += (" and --reward-model" if reward_model else "") + (", in that order" if n > 1 else "")
        raise ValueError(f"--reward-weights: expected {n} weight{'s' if n != 1 else ''} (one per reward: {what}), "
                         f"got {len(weights)}")
    return fns, weights


def build(fns, weights: List[float], reward_model: Optional[str], place) -> Rewards:
    """The run's Rewards: the functions of `reward_functions`, then the reward model loaded on `place`."""
    fns = list(fns)
    if reward_model:
        name = os.path.basename(os.path.normpath(reward_model))
        fns.append((RewardModel(reward_model, place), name, "--reward-model", reward_model))
    checked = [checked_reward(f, what, flag) for f, _, flag, what in fns]
    return Rewards(checked, [n for _, n, _, _ in fns], [f"{flag}: {what}" for _, _, flag, what in fns], weights)


def normalize_then_sum(parts: torch.Tensor, weights: List[float], group_ids: torch.Tensor, batch_mean_std,
                       eps: float = GDPO_EPS) -> torch.Tensor:
    """GDPO's advantages (rows,), float64, as TRL's `multi_objective_aggregation="normalize_then_sum"`.

    `parts` (rows, functions) holds each function's rewards, NaN where it returned None. Each function's
    rewards are normalised within their prompt group, (r − μ_g)/(σ_g + ε), with μ_g and σ_g (Bessel) over
    the rows it scored: σ_g is NaN with fewer than two of them (the function then adds nothing to those
    rows) and 0 in a group of one row. The weighted sum over the finite terms (TRL's nansum) is normalised
    over the batch, (s − mean)/(std + ε), with `batch_mean_std(s) -> (mean, std)` (every rank's rows, as
    TRL's over every process; (None, None) for no rows, std 0 for one)."""
    x = parts.to(torch.float64)
    inverse, n_groups = group_index(len(group_ids), group_ids, ref_name="the rows", exact_count=False)

    def per_group(v):  # the sum over each row's group, for every row
        return group_gather(group_sum(v, inverse, n_groups), inverse)

    scored = ~x.isnan()
    n = per_group(scored.to(x.dtype))
    mean = per_group(x.nan_to_num()) / n  # NaN where the group has no score (0/0)
    var = per_group(torch.where(scored, x - mean, 0.0).square()) / (n - 1)
    std = torch.where(n > 1, var.sqrt(), math.nan)
    std = torch.where(per_group(torch.ones_like(x)) == 1, 0.0, std)
    summed = ((x - mean) / (std + eps) * x.new_tensor(weights)).nansum(-1)
    mean_s, std_s = batch_mean_std(summed)
    return summed if mean_s is None else (summed - mean_s) / (std_s + eps)


def make_reward(spec: str) -> Callable:
    """The reward function of one `--reward` (REWARD_FORMS): exact match and regex take
    (prompt, completion, answer) -> float; a function from a module or a file is taken as it is."""
    if spec == "exact":
        return lambda prompt, completion, answer: float(completion.strip() == str(answer).strip())
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec[len("regex:"):])
        except re.error as e:
            raise ValueError(f"--reward: bad regex {spec[len('regex:'):]!r} ({e})") from None

        def regex_reward(prompt, completion, answer):
            m = pattern.search(completion)
            got = (m.group(1) if m.groups() else m.group(0)) if m else None
            return float(got is not None and got.strip() == str(answer).strip())

        return regex_reward
    if spec in trl_names.TRL_REWARD_FUNCS:  # `trl grpo`'s registry
        from trl import rewards

        f = getattr(rewards, spec)
        return f(**trl_names.TRL_SOFT_OVERLONG) if spec == "get_soft_overlong_punishment" else f
    return _load_function(spec.removeprefix("module:"))  # module:... was this flag's form before


def _load_function(spec: str) -> Callable:
    """`path/to/file.py:function`, `package.module:function`, or TRL's dotted `package.module.function`."""
    where, sep, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    try:
        f = getattr(plugins.import_source(where), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--reward: cannot load {spec!r} ({type(e).__name__}: {e}); expected {REWARD_FORMS}") from None
    except SyntaxError as e:
        raise ValueError(f"--reward {spec}: {e.filename}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the module raised while it was imported
        raise ValueError(f"--reward {spec}: importing {where} raised {type(e).__name__} ({e})") from None
    if not callable(f):
        raise ValueError(f"--reward: {spec!r} is not callable")
    return f
