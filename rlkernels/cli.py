"""The `rlkernels` console script (also `python -m rlkernels`).

    rlkernels train [FLAGS]        RL fine-tuning with the fused loss (no flags: the offline demo; --help)
    rlkernels demo [FLAGS]         the offline demo: a tiny model learns 2-digit addition, warm-up then GRPO
    rlkernels bench [FLAGS]        the GRPO loss head against a plain log_softmax: time, memory, a PNG
    rlkernels trl grpo [ARGS]      TRL's own GRPO script (trl grpo ...) with rlkernels' log-probs and loss;
                                   `accelerate launch -m rlkernels trl grpo ...` for several processes
"""
from __future__ import annotations

import os
import sys

# Nothing here imports torch until a command runs: `--help` and flag errors answer in a fraction of a second.
DEMO_DOC = """`rlkernels demo [FLAGS]`: the offline demo, `rlkernels train` without --model: a tiny Llama learns
2-digit addition (a supervised warm-up, then GRPO raises held-out greedy accuracy), on a CPU in a minute or two.
It takes the flags of `rlkernels train` below but --model (train yours with `rlkernels train --model DIR`).
"""
TRL_DOC = """`rlkernels trl grpo [ARGS]`: TRL's own GRPO script (what `trl grpo ARGS` runs) with rlkernels' log-probs
and loss (rlkernels.integrations.trl.apply()); ARGS are TRL's, `--config recipe.yaml` included
(`rlkernels trl grpo --help` lists them). It runs in this process with OMP_NUM_THREADS threads, 1 unless set, as
`trl grpo`'s `accelerate launch` gives one process (accelerate's config file is not read). Several processes:
`accelerate launch -m rlkernels trl grpo ARGS`. One argument is rlkernels': `--plugin FILE.py|module` (repeatable)
imports your code first, so that a preset it registers is `--loss_type rlkernels_<preset>`.
"""


def _help_asked(argv) -> bool:
    return "-h" in argv or "--help" in argv


def _train(argv):
    from .train import main
    return main(argv)


def _demo(argv):
    from .train import main

    if _help_asked(argv):
        return main(argv, prog="rlkernels demo", doc=DEMO_DOC)
    if any(a.split("=")[0] in ("--model", "--model_name_or_path", "--model-name-or-path") for a in argv):
        print("rlkernels demo: error: the demo builds its own tiny model; train yours with rlkernels train --model DIR",
              file=sys.stderr)
        return 2
    return main(argv)


def _bench(argv):
    from .demo import main
    return main(argv)


def _trl(argv):
    """TRL's script `trl/scripts/<name>.py` in this process, after `integrations.trl.apply()`: what `trl <name>`
    runs in the processes `accelerate launch` starts, there without rlkernels."""
    if argv[:1] in (["-h"], ["--help"]):
        print(TRL_DOC)
        return 0
    if argv[:1] != ["grpo"]:
        print("rlkernels trl: error: expected `rlkernels trl grpo [ARGS]` (TRL's GRPO script; its ARGS, "
              "--config recipe.yaml included)", file=sys.stderr)
        return 2
    # `trl grpo` runs its script under `accelerate launch`, which gives each process OMP_NUM_THREADS threads, 1 unless
    # set (its config file, if any, is not read here); the same here, before torch is imported
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # called from Python with torch loaded: the variable comes too late for OpenMP
        sys.modules["torch"].set_num_threads(int(threads))
    plugins, args = _plugins_apart(argv[1:])
    if plugins is None:
        print("rlkernels trl: error: --plugin: expected a Python file or a module after it", file=sys.stderr)
        return 2
    from .trainer.plugins import load

    try:  # before TRL parses --loss_type, and before apply() resolves it
        load(plugins)
    except ValueError as e:
        print(f"rlkernels trl: error: {e}", file=sys.stderr)
        return 2
    from .integrations.trl import apply
    from trl.scripts import grpo

    apply()
    parser = grpo.make_parser(prog="rlkernels trl grpo")
    grpo.main(*parser.parse_args_and_config(args, fail_with_unknown_args=False))
    return 0


def _plugins_apart(args):
    """(the values of every `--plugin X` / `--plugin=X`, the other arguments); (None, args) for a --plugin without a
    value. TRL's parser refuses an argument it does not know."""
    plugins, rest, i = [], [], 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        i += 1
        if name != "--plugin":
            rest.append(args[i - 1])
            continue
        if not eq:
            value = args[i] if i < len(args) and not args[i].startswith("-") else ""
            i += 1
        if not value:
            return None, args
        plugins.append(value)
    return plugins, rest


COMMANDS = {"train": _train, "demo": _demo, "bench": _bench, "trl": _trl}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"rlkernels: error: unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except BrokenPipeError:  # `rlkernels train --help | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's advice: no error at exit either
        return 1


if __name__ == "__main__":
    sys.exit(main())
