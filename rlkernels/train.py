"""`rlkernels train [--key value ...]` (or `python -m rlkernels.train`): RL fine-tuning with the rlkernels loss head.

With no arguments: the offline demo (a tiny Llama learns 2-digit addition: a supervised warm-up, then GRPO
raises held-out greedy accuracy). On your model: `--model DIR --dataset FILE_OR_FOLDER --reward ...`.
Every field of `rlkernels.trainer.Config` is a flag, and so are TRL's GRPOConfig names (`--learning_rate`,
`--beta`, `--loss_type`, ...); `--config FILE.json|FILE.yaml` takes the same keys, a TRL recipe included (flags
override it); `--resume DIR` continues a run. Under `torchrun --nproc-per-node N` it runs data parallel (DDP), or
sharded with `--fsdp` (FSDP2). Ctrl-C or SIGTERM stops at the next checkpoint and exits 130 or 143.
docs/trainer.md has the details.
"""
from __future__ import annotations

import os
import sys


def main(argv=None, prog: str = "rlkernels train", doc: str = __doc__) -> int:
    from .trainer import run_config as C  # neither torch nor transformers: --help and flag errors answer at once

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # anywhere on the command line, before any other check
        print(doc)
        print(C.help_text(prog))
        return 0
    notes = []
    try:
        cfg, explicit = C.from_args(argv, notes)
    except ValueError as e:
        print(f"rlkernels.train: error: {e}", file=sys.stderr)
        return 2
    for line in notes:  # TRL's settings with no effect here, and where a TRL recipe trains otherwise
        print(f"rlkernels.train: {line}")
    import torch.distributed as dist

    from .trainer import device, stop
    from .trainer.loop import train_validated  # from_args has validated cfg

    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(device.backend(device.process_device(cfg.device, world)))
        summary = train_validated(cfg, explicit=explicit if cfg.resume else None)
    except ValueError as e:
        print(f"rlkernels.train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM (the first one stops at the next checkpoint)
        print(f"rlkernels.train: interrupted; {cfg.out or 'the run folder'} keeps its last checkpoint, if any",
              file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary.get("stopped_by"):  # saved at a checkpoint: not a finished run, for a scheduler
        print(f"rlkernels.train: stopped by {summary['stopped_by']}; continue with: rlkernels train --resume "
              f"{summary['out']}", file=sys.stderr)
        return stop.exit_code(summary["stopped_by"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
