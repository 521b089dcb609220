"""`--report-to`: the run's metrics and sample completions also in TensorBoard or Weights & Biases (as TRL's
and transformers' `report_to`), beside `metrics.jsonl` and `completions.jsonl`, which are always written.

* tensorboard: `torch.utils.tensorboard.SummaryWriter` on the run folder (`tensorboard --logdir runs`); every
  number of a metrics row as a scalar at its step, each eval's completions as a text table. A resumed run
  drops what the old event files hold from its first step on (`purge_step`), as metrics.jsonl does.
* wandb: `wandb.init` with the run folder as its directory, offline unless WANDB_MODE says otherwise (nothing
  needs the network; `wandb sync` uploads later), the metrics at their step and the completions as a Table.
  A resumed run is a new W&B run, named after the run folder like the first.
Each needs the optional package of its name: asking for one that is not installed is an error naming the
flag (`run_config.validate`, before any model loads).
"""
from __future__ import annotations

import math
import os

from . import run_folder

COLUMNS = ("step", "prompt", "completion", "answer", "reward")  # a completions row


def _scalars(row: dict) -> dict:
    """The finite numbers of a metrics row, but its step."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class TensorBoard:
    def __init__(self, out_dir: str, settings: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        before = set(os.listdir(out_dir))
        self.writer = SummaryWriter(out_dir, purge_step=first_step)
        for name in set(os.listdir(out_dir)) - before:  # its event file, named by host and time
            run_folder.record(os.path.join(out_dir, name))

    def metrics(self, row: dict) -> None:
        for k, v in _scalars(row).items():
            self.writer.add_scalar(k, v, row["step"])
        self.writer.flush()  # a live `tensorboard` sees each step

    def completions(self, step: int, rows: list) -> None:
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731 (one markdown table cell)
        lines = ["| " + " | ".join(COLUMNS[1:]) + " |", "|---" * (len(COLUMNS) - 1) + "|"]
        lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS[1:]) + " |" for r in rows]
        self.writer.add_text("completions", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out_dir: str, settings: dict, first_step: int):
        import wandb

        self.wandb = wandb
        run_folder.record(os.path.join(out_dir, "wandb"))
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlkernels"),
                              name=os.path.basename(os.path.abspath(out_dir)), dir=out_dir,
                              config=settings, mode=os.environ.get("WANDB_MODE", "offline"))

    def metrics(self, row: dict) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def completions(self, step: int, rows: list) -> None:
        table = self.wandb.Table(columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in rows])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The backends of `--report-to` (none: an empty list), each told every metrics row and completions table.
    A backend that cannot write into the run folder is an error naming --out (run_folder.writing)."""

    def __init__(self, names, out_dir: str, settings: dict, first_step: int):
        self.out_dir = out_dir
        with run_folder.writing(out_dir):
            self.backends = [BACKENDS[n](out_dir, settings, first_step) for n in names if n != "none"]

    def metrics(self, row: dict) -> None:
        with run_folder.writing(self.out_dir):
            for b in self.backends:
                b.metrics(row)

    def completions(self, step: int, rows: list) -> None:
        with run_folder.writing(self.out_dir):
            for b in self.backends:
                b.completions(step, rows)

    def close(self) -> None:
        with run_folder.writing(self.out_dir):
            for b in self.backends:
                b.close()


BACKENDS = {"tensorboard": TensorBoard, "wandb": WandB}  # --report-to's values (and "none"); each the package it needs
