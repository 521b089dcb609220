"""`python -m rlkernels.train [--key value ...]`: RL fine-tuning with the rlkernels loss head.

With no arguments: the offline CPU demo (a tiny Llama learns 2-digit addition: a supervised
warm-up, then GRPO raises held-out greedy accuracy). `--algo ppo|grpo|gspo|...`, `--config
FILE.json`, `--resume DIR`; every field of `rlkernels.trainer.Config` is a flag (`--help`).
Under `torchrun --nproc-per-node N -m rlkernels.train` it runs data parallel (gloo on CPU).
"""
from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    from .trainer import config as C

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("flags (default):")
        print(C.describe(C.Config()).replace("  ", "  --", 1).replace("\n  ", "\n  --"))
        return 0
    try:
        cfg, explicit = C.from_args(argv)
    except ValueError as e:
        print(f"rlkernels.train: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from .trainer import train

    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        train(cfg, explicit=explicit if cfg.resume else None)
    except ValueError as e:
        print(f"rlkernels.train: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
