"""The trainer's flat config (settings.py declares each setting), overridden by a JSON or YAML file and by
`--key value` flags (parsed by argparse built from the settings: see `build_parser`), and checked (`validate`).
TRL's names are accepted too (trl_names.py).

Precedence: defaults < `--config FILE.json|FILE.yaml` < flags. On `--resume DIR` the checkpoint's config
replaces the defaults (flags still win, e.g. `--steps` to train further). Fields whose default is None take
the demo's value or, with `--model`, one that fits a real model (MODE_DEFAULTS).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
import typing
from typing import List, Optional

from . import nesting, trackers, trl_names
from .config_parts import loss_config
from .settings import (ADV_ESTIMATORS, BOUNDS, CHOICES, DEMO_ONLY, FIELDS, MAX_DIGITS, MULTI,
                       RESUME_FIXED, RESUME_FRESH, REWARD_FORMS, Config, FLOAT32_MAX, expected,
                       help_line)
from .settings import MODE_DEFAULTS  # noqa: F401  (read here by the docstring's readers and the tests)

# `--help` and every error of the flags themselves answer without importing torch or transformers (seconds on a
# busy machine): the presets and the device checks are imported by `validate`, after the checks that need neither.

# the verl estimators the trainer cannot form, with why
ADV_REFUSED = {name: "needs Σ_v π_v² of each sampled token under the behaviour policy, which the trainer's fused "
                     "loss head never forms (it does not materialise the distribution)"
               for name in ("optimal_token_baseline", "tir_optimal_token_baseline")}
# a statistic over the whole batch (whitening, GPG's α): under torchrun each rank holds only its own rows
ADV_BATCH_WIDE = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "gdpo")
# the estimators --scale-rewards applies to (verl's norm_adv_by_std_in_grpo: group or none; grpo also batch)
ADV_SCALED = (None, "grpo", "grpo_vectorized", "grpo_passk", "gdpo")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(name: str):
    """(the type of a value, whether it may be None) of a field or a TRL setting (trl_names): for one of several
    values, that of each."""
    if name not in FIELDS:
        typ, optional = trl_names.kind(name)
        return (typing.get_args(typ)[0], False) if _several(name) else (typ, optional)
    hint = typing.get_type_hints(Config)[name]
    if name in MULTI:
        return typing.get_args(hint)[0], False
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return (args[0] if args else hint), hint != (args[0] if args else hint)


def _several(name: str) -> bool:
    """Whether `name` (a field or a TRL setting) takes a list of values."""
    return name in MULTI or (name not in FIELDS and typing.get_origin(trl_names.kind(name)[0]) is list)


def convert(name: str, value, source: str = "flag", key: Optional[str] = None):
    """`value` (a string from the command line, or a JSON value) as the field's type; for a field of
    several values, a list of them (or one). `key`: the name the file used (TRL's, say), for messages."""
    if _several(name):
        values = value if isinstance(value, (list, tuple)) else [value]
        return [_convert_one(name, v, source, key) for v in values]
    return _convert_one(name, value, source, key)


def _convert_one(name: str, value, source: str, key: Optional[str] = None):
    where = _flag(name) if source == "flag" else f"{source}: key {key or name!r}"
    typ, optional = _base_type(name)
    if isinstance(value, (list, tuple, dict, set)):  # never str() it: YAML aliases can make it exponentially large
        item = " (each item)" if _several(name) else ""
        raise ValueError(f"{where}: expected {_WHAT[typ.__name__]}{item}, got a {type(value).__name__}")
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
        raise ValueError(f"{where}: expected {_WHAT[typ.__name__]}{' or none' if optional else ''}, "
                         f"got {value!r}") from None


_WHAT = {"int": "an int", "float": "a number", "bool": "a bool (true/false)", "str": "a string"}  # for messages


KNOWN = [*FIELDS, *trl_names.RENAMED, *trl_names.OPTIONS, *trl_names.SAME_AS_HERE, *trl_names.IGNORED_WHY]  # every name a flag or key may have


def _unknown(names: List[str], where: str) -> ValueError:
    """One error naming every unknown flag or --config key (`where`: "flag" or the file), with a guess for one."""
    close = difflib.get_close_matches(names[0], KNOWN, n=1) if len(names) == 1 else []
    hint = f"; did you mean {_flag(close[0]) if where == 'flag' else repr(close[0])}?" if close else ""
    shown = ", ".join(_flag(n) if where == "flag" else repr(n) for n in names)
    what = (f"unknown flag{'s' * (len(names) > 1)} {shown}" if where == "flag" else
            f"{where}: unknown key{'s' * (len(names) > 1)} {shown}")
    return ValueError(what + hint + (" (not a setting of this trainer, nor a TRL setting it follows: "
                                     "docs/trainer.md#trls-names)" if not close else ""))


# ---- the command line: argparse on Config's fields ----------------------------------------------------------
# Every field is a flag, `--reward-model` (also `--reward_model`; `--help` shows the hyphenated spelling), with
# its help line from the field's metadata; a bool that defaults to true also has `--no-FLAG`. On top of argparse:
#   * values are converted by `convert` (the same code as for --config files): `none` for Optional fields,
#     bools as true/false/yes/no/on/off/1/0, a bare bool flag is true, and the messages name the flag;
#   * a list field takes every value up to the next flag, and a repeated flag adds to it (action="extend");
#   * any other setting given twice, under one spelling or two (`--lr` and `--learning_rate`), is an error, as
#     the same key twice in a --config file is;
#   * a value that starts with one dash is a value (`--kl-coef -1e-3`, `--warmup-lr -inf`), never an option;
#   * defaults are suppressed while parsing, so what was set explicitly is known (a resumed run keeps the
#     rest from its checkpoint), and a --config file's values fill in under the flags;
#   * parse errors are ValueErrors naming the flag (`main` prints them as one line and exits 2).
USAGE = "rlkernels train [--config FILE.json|FILE.yaml] [--FLAG VALUE ...]  (every Config field; --help)"


class _FlagError(Exception):
    """A value a flag cannot take; not a ValueError, so that argparse lets it through with its own message."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Lists each flag by its hyphenated spelling only (`--reward-model`, not also `--reward_model`)."""

    def _format_action_invocation(self, action):
        shown = [s for s in action.option_strings if "_" not in s] or action.option_strings
        if not action.option_strings or action.nargs == 0:
            return ", ".join(shown)
        return ", ".join(f"{s} {self._format_args(action, action.metavar or action.dest.upper())}" for s in shown)

    def _get_help_string(self, action):
        if action.default == "" and isinstance(action.default, str):
            return (action.help or "") + ' (default: "")'
        return super()._get_help_string(action)


def _converter(name: str):
    def conv(value):
        try:
            return _convert_one(name, value, "flag")
        except ValueError as e:
            raise _FlagError(str(e)) from None
    conv.__name__ = name
    return conv


def build_parser(suppress_defaults: bool = False, prog: str = "rlkernels train"):
    """The argparse parser of Config's fields, with `--config` and TRL's names."""
    parser = argparse.ArgumentParser(prog=prog, usage=USAGE.replace("rlkernels train", prog), allow_abbrev=False,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="a JSON or YAML (.yaml/.yml) file of config keys; flags override its values")
    parser._negative_number_matcher = re.compile(r"^-(?!-)")  # `-x` is a value (see above); argparse's own attribute
    for name, field in FIELDS.items():
        spellings = [_flag(name)] + (["--" + name] if "_" in name else [])
        default = (argparse.SUPPRESS if suppress_defaults else
                   field.default_factory() if field.default is dataclasses.MISSING else field.default)
        kwargs = dict(dest=name, type=_converter(name), default=default, help=help_line(name))
        if name in MULTI:
            metavar = name.upper()[:-1] if name.endswith("s") else name.upper()
            parser.add_argument(*spellings, nargs="+", action="extend", metavar=metavar, **kwargs)
        elif _base_type(name)[0] is bool:
            parser.add_argument(*spellings, nargs="?", const=True, metavar="true|false", **kwargs)
            if field.default is True:
                parser.add_argument("--no-" + name.replace("_", "-"), *(["--no_" + name] if "_" in name else []),
                                    dest=name, action="store_false", default=argparse.SUPPRESS,
                                    help=f"the same as {_flag(name)} false")
        else:
            parser.add_argument(*spellings, **kwargs)
    _add_trl_names(parser)
    return parser


def _add_trl_names(parser) -> None:
    """TRL's names (trl_names.py): a renamed setting is another spelling of our flag; the others are flags of
    their own, translated by `trl_names.resolve`."""
    by_dest = {a.dest: a for a in parser._actions}
    for alias, name in trl_names.RENAMED.items():
        for spelling in (_flag(alias), "--" + alias):
            if spelling not in parser._option_string_actions:
                by_dest[name].option_strings.append(spelling)
                parser._option_string_actions[spelling] = by_dest[name]
    group = parser.add_argument_group("TRL's names", "GRPOConfig settings that set the flags above (also as "
                                      "--config keys; docs/trainer.md#trls-names)")
    accepted = {name: (typ, "accepted as " + " or ".join(map(str, values)) + f": {why}")
                for name, (typ, values, why) in trl_names.SAME_AS_HERE.items()}
    for name, (typ, help) in {**trl_names.OPTIONS, **accepted}.items():
        spellings = [_flag(name)] + (["--" + name] if "_" in name else [])
        if _several(name):
            group.add_argument(*spellings, dest=name, type=_converter(name), nargs="+", action="extend",
                               default=argparse.SUPPRESS, metavar="NAME", help=help)
        elif typ is bool:
            group.add_argument(*spellings, dest=name, type=_converter(name), nargs="?", const=True,
                               default=argparse.SUPPRESS, metavar="true|false", help=help)
        else:
            group.add_argument(*spellings, dest=name, type=_converter(name), default=argparse.SUPPRESS,
                               metavar=name.upper(), help=help)
    ignored = parser.add_argument_group("TRL's settings with no effect here", "accepted with any value and named "
                                        "once in the log: " + "; ".join(f"{', '.join(names)} ({why})"
                                                                        for why, names in trl_names.IGNORED.items()))
    for name in trl_names.IGNORED_WHY:
        ignored.add_argument(_flag(name), "--" + name, dest=name, nargs="*", default=argparse.SUPPRESS,
                             help=argparse.SUPPRESS)


def _parse_error(message: str) -> ValueError:
    m = re.match(r"argument (--[\w-]+)(?:/\S+)?: expected (one argument|at least one argument)", message)
    if m:
        flag = _flag(m.group(1)[2:].replace("-", "_"))
        return ValueError(f"{flag}: expected {'a value' if m.group(2) == 'one argument' else 'one or more values'}")
    m = re.match(r"argument (--[\w-]+)(?:/\S+)?: (.*)", message)
    if m:
        return ValueError(f"{_flag(m.group(1)[2:].replace('-', '_'))}: {m.group(2)}")
    return ValueError(message)


def parse_flags(argv: List[str]) -> dict:
    """The flags given on the command line → {field: value} (converted); `--config` kept as is."""
    parser = build_parser(suppress_defaults=True)

    def error(message):
        raise _parse_error(message)
    parser.error = error
    try:
        namespace, extra = parser.parse_known_args(list(argv))
    except _FlagError as e:
        raise ValueError(str(e)) from None
    if extra:
        unknown = [a[2:].partition("=")[0].replace("-", "_") for a in extra if a.startswith("--") and a != "--"]
        if not unknown:
            raise ValueError(f"unexpected argument {extra[0]!r}: flags look like --key value")
        raise _unknown(unknown, "flag")
    _check_given_once(parser, argv)
    return vars(namespace)


def _check_given_once(parser, argv: List[str]) -> None:
    """A setting given twice on the command line is an error, as in a --config file; list settings add up."""
    seen = {}
    for arg in argv:
        spelling = arg.partition("=")[0]
        action = parser._option_string_actions.get(spelling) if arg.startswith("--") else None
        if action is None or (action.dest != "config" and _several(action.dest)):
            continue
        if action.dest in seen:
            first = seen[action.dest]
            twice = f"{spelling} is given twice" if first == spelling else f"{first} and {spelling} set the same option"
            raise ValueError(f"{twice}; give it once")
        seen[action.dest] = spelling


def help_text(prog: str = "rlkernels train") -> str:
    """`--help`: every flag, hyphenated, with its help line and default."""
    return build_parser(prog=prog).format_help()


def load_config_file(path: str) -> dict:
    """A JSON or YAML (.yaml/.yml) object of config keys, converted and checked."""
    yaml_file = path.lower().endswith((".yaml", ".yml"))
    kind = "YAML" if yaml_file else "JSON"
    if not os.path.isfile(path):
        raise ValueError(f"--config: no such file {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--config: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if yaml_file:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--config: reading {path} (YAML) needs the package pyyaml (pip install pyyaml); "
                             f"or write the config as JSON") from None
        nesting.check(text, yaml_file, path)
        try:
            data = yaml.load(text, Loader=_unique_keys_loader(yaml))
        except yaml.YAMLError as e:
            raise ValueError(f"--config: {path} is not valid YAML ({' '.join(str(e).split())})") from None
        except _DuplicateKey as e:
            raise ValueError(f"--config {path}: key {e.args[0]!r} is given twice; give it once") from None
    else:
        nesting.check(text, yaml_file, path)
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys_object)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config: {path} is not valid JSON ({e})") from None
        except _DuplicateKey as e:
            raise ValueError(f"--config {path}: key {e.args[0]!r} is given twice; give it once") from None
        except ValueError as e:  # e.g. an integer of more digits than int() converts
            raise ValueError(f"--config: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a {kind} object of config keys")
    out, keys, unknown = {}, {}, []
    for key, value in data.items():
        name = trl_names.RENAMED.get(str(key), str(key))
        if name not in FIELDS and trl_names.kind(name) is None:
            unknown.append(str(key))
            continue
        if value is None and (trl_names.is_trl_name(str(key)) or key in trl_names.SAME_NAME):  # TRL's default
            continue
        if name in out:
            raise ValueError(f"--config {path}: keys {keys[name]!r} and {key!r} set the same option")
        keys[name] = key
        out[name] = value if name in trl_names.IGNORED_WHY else convert(name, value, f"--config {path}", str(key))
    if unknown:  # with the TRL settings this trainer cannot follow: all that a recipe asks in vain, in one error
        message = str(_unknown(unknown, f"--config {path}"))
        raise ValueError("; ".join([message, *trl_names.refused(out)]))
    return (out, any(trl_names.is_trl_name(str(k)) for k in data),
            {n: f"{k} in --config {path}, flag {_flag(n)}" for n, k in keys.items()})


class _DuplicateKey(Exception):
    """A key given twice in one object of a config file (JSON and YAML would keep the last, silently)."""


def _unique_keys_object(pairs) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _unique_keys_loader(yaml):
    """yaml's SafeLoader, refusing a key given twice in a mapping."""
    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            for i, key in enumerate(keys):
                if key in keys[:i]:
                    raise _DuplicateKey(key)
            return super().construct_mapping(node, deep)
    return Loader


def from_args(argv: List[str], notes: Optional[list] = None) -> tuple:
    """(Config, the names set explicitly) from command-line arguments: defaults < `--config FILE` < flags (a TRL
    recipe: TRL's defaults < the file < flags). `notes`, if given, gets the lines the log should show: the TRL
    settings given that have no effect here, and where a TRL recipe still trains otherwise than `trl grpo`."""
    flags = parse_flags(argv)
    values, trl_recipe, written = load_config_file(flags.pop("config")) if "config" in flags else ({}, False, {})
    written.update(_flags_as_written(argv))
    values.update(flags)
    ignored = [k for k in values if k in trl_names.IGNORED_WHY]
    for k in ignored:
        values.pop(k)
    if notes is not None and ignored:
        notes.append(trl_names.ignored_line(ignored))
    trl_recipe = trl_recipe and bool(values.get("model"))  # TRL's defaults are for a model, not the built-in demo
    if values.get("model") and "warmup_steps" in values:  # TRL's warmup_steps: the learning-rate warm-up
        if "lr_warmup_steps" in values:
            raise ValueError("--warmup-steps: with --model it is TRL's learning-rate warm-up, --lr-warmup-steps, "
                             "which is given too; give one of them")
        values["lr_warmup_steps"] = values.pop("warmup_steps")
    base = Config(model=values.get("model", ""))
    defaults = ((lambda name: trl_names.TRL_DEFAULTS.get(name, getattr(base, name))) if trl_recipe else
                (lambda name: getattr(base, name)))
    values = trl_names.resolve(values, defaults, set(flags), int(os.environ.get("WORLD_SIZE", 1)), trl_recipe, notes)
    if values.get("model"):
        for name in DEMO_ONLY:
            if name in values:
                raise ValueError(f"{_flag(name)}: applies only to the built-in demo model and task, not to "
                                 f"--model {values['model']}")
    cfg = Config(**values)
    try:
        validate(cfg)
    except ValueError as e:
        raise _as_written(e, written) from None
    return cfg, set(values)


def _flags_as_written(argv: List[str]) -> dict:
    """{field: the flag as the command line spelled it}, e.g. max_new_tokens: --max-completion-length. Our own
    old names (--prompts) are left out: their errors name the flag that replaced them."""
    out = {}
    for arg in argv:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            key = flag[2:].replace("-", "_")
            if key.startswith("no_") and key not in FIELDS:
                key = key[3:]
            if key in FIELDS or (key in trl_names.RENAMED and trl_names.is_trl_name(key)):
                out[trl_names.RENAMED.get(key, key)] = flag
    return out


def _as_written(error: ValueError, written: dict) -> ValueError:
    """`error`, whose message starts with the flag of the bad value, naming that value as the user gave it: the
    recipe key and file (then its flag, to override it) for a --config file's value, the flag as typed for the
    command line's (issue 37 item 11: a recipe's max_completion_length was reported as --max-new-tokens only)."""
    message = str(error)
    for name, where in written.items():
        flag = _flag(name)
        if message.startswith(flag) and message[len(flag):len(flag) + 1] in (":", " ", "/") and where != flag:
            return ValueError(where + message[len(flag):])
    return error


def _validate_model_options(cfg: Config) -> None:
    """ModelConfig's and open-r1's options of a TRL recipe (issue 40)."""
    for name in ("attn_implementation", "chat_template"):
        if getattr(cfg, name) is not None and not cfg.model:
            raise ValueError(f"{_flag(name)}: applies to a --model; the demo's tiny Llama and character tokenizer "
                             f"have their own")
    if any(s in trl_names.TRL_REWARD_FUNCS for s in cfg.reward) and importlib.util.find_spec("trl") is None:
        raise ValueError("--reward: trl grpo's reward functions by name need trl (pip install trl)")
    if cfg.system_prompt is not None and not cfg.dataset:
        raise ValueError("--system-prompt: applies to the prompts of a --dataset, not to the demo's sums")


def _validate_each(cfg: Config) -> None:
    """Each setting on its own: a finite number (nan and inf pass comparisons like `> 0`, or fail them unclearly,
    and break training later), within the bounds settings.py gives it."""
    for name in FIELDS:
        values = getattr(cfg, name) if name in MULTI else (getattr(cfg, name),)
        for v in values:
            if _base_type(name)[0] is float and v is not None and not math.isfinite(v):
                raise ValueError(f"{_flag(name)}: expected a finite number, got {v}")
    for name, bounds in BOUNDS.items():
        v = getattr(cfg, name)
        if v is not None and not bounds.holds(v):
            raise ValueError(f"{_flag(name)}: expected {expected(name)}, got {v}")


def validate(cfg: Config) -> None:
    """Raise a ValueError naming the flag of the first bad value."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            shown = ", ".join(a for a in allowed if a is not None)
            raise ValueError(f"{_flag(name)}: expected one of {shown}, got {getattr(cfg, name)!r}")
    _validate_adv_estimator(cfg)
    _validate_each(cfg)
    cpus = os.cpu_count() or 1
    if cfg.threads > 4 * cpus:  # torch.set_num_threads(100000) crashes the process (SIGSEGV) on OpenMP builds
        raise ValueError(f"--threads: expected at most 4 × the {cpus} CPUs of this machine ({4 * cpus}), "
                         f"got {cfg.threads}")
    if not cfg.dataset and cfg.digits > MAX_DIGITS:
        raise ValueError(f"--digits: expected at most {MAX_DIGITS} (the demo task lists all 10^(2·digits) "
                         f"operand pairs in memory, and a tiny model learns no more), got {cfg.digits}")
    if not 1 / FLOAT32_MAX <= cfg.temperature <= FLOAT32_MAX:  # the ops scale float32 logits by 1/τ
        raise ValueError(f"--temperature: expected a number >= {1 / FLOAT32_MAX:.3g} (1/τ must fit float32) and "
                         f"<= {FLOAT32_MAX:.3g} (τ must fit float32), got {cfg.temperature}")
    if cfg.lr * cfg.weight_decay > 1:  # AdamW scales each weight by 1 − lr·weight_decay a step
        raise ValueError(f"--weight-decay: expected a number in [0, 1 / --lr] ({1 / cfg.lr:.3g}), "
                         f"got {cfg.weight_decay}")
    if cfg.num_generations < 2 and cfg.algo != "ppo":
        raise ValueError(f"--num-generations: expected an int >= 2 for --algo {cfg.algo}, whose advantages compare "
                         f"each completion with its prompt's group (a group of one has advantage 0); --algo ppo "
                         f"takes 1, got {cfg.num_generations}")
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
    for name in cfg.report_to:
        if name not in ("none", *trackers.BACKENDS):
            raise ValueError(f"--report-to: expected none, {', '.join(trackers.BACKENDS)}, got {name!r}")
        if name == "none" and len(cfg.report_to) > 1:
            raise ValueError(f"--report-to: none with others ({' '.join(cfg.report_to)})")
        if name != "none" and importlib.util.find_spec(name) is None:
            raise ValueError(f"--report-to {name}: needs the optional package {name} (pip install {name}), "
                             f"which is not installed")
    _validate_model_options(cfg)
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-rank: needs the optional package peft (pip install peft)")
    for spec in cfg.reward:
        if (spec != "exact" and not spec.startswith("regex:") and ":" not in spec and "." not in spec
                and spec not in trl_names.TRL_REWARD_FUNCS):
            raise ValueError(f"--reward: expected {REWARD_FORMS}, got {spec!r}")
    if cfg.scale_rewards is not None and cfg.algo == "ppo":
        raise ValueError("--scale-rewards: the GRPO family's option; --algo ppo's advantages come from GAE")
    for name in ("model", "reward_model"):
        path = getattr(cfg, name)
        if path and not os.path.isfile(os.path.join(path, "config.json")) and not _in_hub_cache(path):
            what = "no such folder" if not os.path.isdir(path) else "a folder without config.json"
            hub = (f"; as a Hugging Face Hub name it is not in the local cache either: fetch it first (`hf download "
                   f"{path}`), then run again (offline)" if _HUB_NAME.match(path) and not os.path.isdir(path) else "")
            raise ValueError(f"{_flag(name)}: expected a local Hugging Face model folder (save_pretrained's, with "
                             f"config.json) or a Hub name in the local cache, got {path!r}: {what}{hub}")
    for name in ("dataset", "eval_dataset"):
        path = getattr(cfg, name)
        if path and not os.path.exists(path) and not _HUB_NAME.fullmatch(path):  # a Hub id: datasets loads it
            raise ValueError(f"{_flag(name)}: no such file or folder {path!r}")
    if cfg.model and not cfg.dataset:
        raise ValueError("--dataset: required with --model (a file or folder of prompts)")
    if cfg.resume and not (os.path.isdir(cfg.resume) or os.path.isfile(cfg.resume)):
        raise ValueError(f"--resume: no such run folder or checkpoint {cfg.resume!r}")
    _validate_preset_and_device(cfg)


def _unknown_estimator(name: str) -> ValueError:
    return ValueError(f"--adv-estimator: expected one of {', '.join(ADV_ESTIMATORS)}, one that a --plugin registers "
                      f"(rlkernels.trainer.estimators.register) or none, got {name!r}")


def _validate_adv_estimator(cfg: Config) -> None:
    """--adv-estimator against the other settings that form advantages (the preset's ratio is checked later)."""
    name = cfg.adv_estimator
    if name is None:
        return
    if name in ADV_REFUSED:
        raise ValueError(f"--adv-estimator {name}: {ADV_REFUSED[name]}; choose one of {', '.join(ADV_ESTIMATORS)}")
    if name not in ADV_ESTIMATORS and not cfg.plugin:  # a --plugin's is checked once it is loaded
        raise _unknown_estimator(name)
    if name == "gae" and cfg.algo != "ppo":
        raise ValueError(f"--adv-estimator gae: GAE needs a critic's values, and only --algo ppo trains a critic; "
                         f"got --algo {cfg.algo}")
    if cfg.algo == "ppo" and name != "gae":
        raise ValueError(f"--adv-estimator {name}: --algo ppo trains a critic for GAE, its only estimator (the "
                         f"others are for the GRPO family's presets)")
    if cfg.tree:
        raise ValueError(f"--adv-estimator {name}: --tree forms Tree-GRPO's advantages; give one of them")
    if cfg.multi_objective_aggregation == "normalize_then_sum" and name not in ("grpo", "grpo_vectorized"):
        raise ValueError(f"--adv-estimator {name}: --multi-objective-aggregation normalize_then_sum forms GDPO's "
                         f"advantages (TRL's); verl's GDPO is --adv-estimator gdpo alone")
    if cfg.scale_rewards is not None and (name not in ADV_SCALED or (cfg.scale_rewards == "batch" and
                                                                     name not in ("grpo", "grpo_vectorized"))):
        raise ValueError(f"--scale-rewards {cfg.scale_rewards}: not an option of --adv-estimator {name} (group "
                         f"or none for grpo_passk and gdpo, any for grpo)")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if name in ADV_BATCH_WIDE and world > 1:
        raise ValueError(f"--adv-estimator {name}: normalises over the whole batch, and under torchrun each of the "
                         f"{world} processes holds a part of it; run it in one process")


_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")  # org/name


def _in_hub_cache(name: str) -> bool:
    """Whether `name` is a Hub model whose config.json the local Hugging Face cache holds (from_pretrained with
    local_files_only loads it from there, offline)."""
    if not _HUB_NAME.match(name) or os.path.isdir(name):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(name, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    return isinstance(found, str)


def _validate_preset_and_device(cfg: Config) -> None:
    """The checks that import torch: the preset (presets.register adds names at run time) and the device."""
    from ..losses import presets
    from ..losses.config import SEQUENCE_RATIOS
    from . import device, estimators, plugins

    plugins.load(cfg.plugin)  # what they register is a valid --algo or --adv-estimator
    if cfg.adv_estimator is not None and cfg.adv_estimator not in estimators.ESTIMATORS:
        raise _unknown_estimator(cfg.adv_estimator)
    if cfg.algo not in presets.NAMES:
        raise ValueError(f"--algo: expected one of {', '.join(presets.NAMES)}, got {cfg.algo!r} (a preset of your own: "
                         f"presets.register it in a --plugin file)")
    device.check(cfg.device, cfg.dtype)
    try:  # the loss settings as PolicyLossConfig checks them (delta > 0, ...)
        loss_config(cfg, cfg.num_generations)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the loss of --algo {cfg.algo}: {e}") from None
    ratio = presets.fields(cfg.algo).get("ratio")
    if cfg.adv_estimator == "reinforce_plus_plus" and cfg.gamma < 1 and ratio in SEQUENCE_RATIOS:
        raise ValueError(f"--adv-estimator reinforce_plus_plus: with --gamma {cfg.gamma} each token gets its own "
                         f"advantage, and the sequence ratio of --algo {cfg.algo} needs one per completion; give "
                         f"--gamma 1")
    if cfg.adv_estimator is not None and ratio == "snis":
        raise ValueError(f"--adv-estimator {cfg.adv_estimator}: --algo {cfg.algo} (SNIS) takes the rewards and forms "
                         f"its own baseline, not advantages")
    if cfg.multi_objective_aggregation == "normalize_then_sum":  # GDPO forms GRPO-style advantages from rewards
        own = ("--algo ppo (GAE on a critic)" if cfg.algo == "ppo" else "--tree (Tree-GRPO)" if cfg.tree else
               f"--algo {cfg.algo} (a baseline of its own)" if presets.fields(cfg.algo).get("ratio") == "snis" else None)
        if own:
            raise ValueError(f"--multi-objective-aggregation normalize_then_sum: GDPO's advantages replace the group "
                             f"normalisation of the GRPO family; {own} forms its advantages otherwise")


def describe(cfg: Config) -> str:
    """The settings that differ from their defaults, as flags on one line (summary.json holds them all)."""
    default = Config(model=cfg.model)
    shown = [f"{_flag(f)} {' '.join(map(str, v)) if isinstance(v, list) else v}"
             for f, v in dataclasses.asdict(cfg).items() if v != getattr(default, f) and f not in ("out", "resume")]
    return " ".join(shown) or "the defaults"


# ----------------------------------------------------------------------------------------------
# --resume: the checkpoint's config under this run's flags

# settings.py marks each setting a resumed run keeps (RESUME_FIXED: the shapes of the saved weights and optimizer
# state, or the objective) and those it takes from its own flags (RESUME_FRESH: the machine's, so that a run saved
# on a GPU resumes on a CPU machine)


def run_dir(resume: str) -> str:
    """The folder of the run that `--resume` (a run folder or its checkpoint file) points at."""
    return resume if os.path.isdir(resume) else os.path.dirname(resume) or "."


def _is_code(spec: str) -> bool:
    return spec != "exact" and not spec.startswith("regex:") and spec not in trl_names.TRL_REWARD_FUNCS


def _refuse_checkpoint_code(cfg: Config, merged: Config) -> None:
    """A checkpoint (perhaps from elsewhere) names reward files and plug-ins; a resumed run imports only those the
    command line names too, unless --trust-checkpoint-code. `merged` is a Config, so an old checkpoint's single
    reward string is already a list."""
    code = [f"--plugin {p}" for p in merged.plugin if p not in cfg.plugin]
    code += [f"--reward {r}" for r in merged.reward if _is_code(r) and r not in cfg.reward]
    if code and not cfg.trust_checkpoint_code:
        raise ValueError(f"--resume: the checkpoint of {cfg.resume!r} runs code this command does not name: "
                         f"{', '.join(code)}; name it again ({' '.join(code)}) to run it, or pass "
                         f"--trust-checkpoint-code")


def merge_resume(cfg: Config, saved: dict, explicit: Optional[set] = None) -> Config:
    """The checkpoint's config, with the fields set explicitly (by default: those that differ
    from the defaults) taken from `cfg`. `resume` always comes from `cfg`, and `out` unless
    given is the run's own folder."""
    default = Config()
    # checkpoints from before --dtype ran in float32; older names (--prompts) are today's
    saved = {"dtype": "float32", **{trl_names.RENAMED.get(k, k): v for k, v in saved.items()}}
    if explicit is None:
        explicit = {f for f in saved if getattr(cfg, f, None) != getattr(default, f, None)}
    for f in RESUME_FIXED:
        if f in explicit and f in saved and getattr(cfg, f) != saved[f]:
            raise ValueError(f"{_flag(f)}: the run in {cfg.resume!r} has {saved[f]!r} and a resumed run keeps it "
                             f"(start a new run to change it), got {getattr(cfg, f)!r}")
    merged = {**saved, **{f: getattr(cfg, f) for f in explicit if f in saved}}
    merged.update({f: getattr(cfg, f) for f in RESUME_FRESH})
    merged["out"] = cfg.out or run_dir(cfg.resume)
    out = Config(**{k: v for k, v in merged.items() if k in FIELDS})
    _refuse_checkpoint_code(cfg, out)
    validate(out)
    return out
