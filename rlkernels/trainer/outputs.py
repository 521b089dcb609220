"""What the person running the trainer sees and keeps: JSONL metrics, a PNG plot, a summary table."""
from __future__ import annotations

import io
import json
import math
import os
import warnings
from typing import List, Optional

from tqdm.auto import tqdm

from .._pyplot import pyplot
from . import run_folder, trackers

PLOTTED = (("reward_mean", "reward"), ("kl", "KL to reference"), ("entropy", "entropy"),
           ("clip_frac", "clip fraction"))


def read_metrics(path: str) -> List[dict]:
    """The rows of a metrics file. A torn last line (a write cut short by a kill) is dropped with a
    warning naming the file; an unparsable line before it is an error."""
    if not os.path.exists(path):
        return []
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a file (a metrics file of this trainer is)")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows = []
    for n, line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n != lines[-1][0]:
                raise ValueError(f"{path} line {n} is not valid JSON ({e})") from None
            warnings.warn(f"{path}: dropping its unparsable last line {n} (a write cut short): {line[:60]!r}",
                          stacklevel=2)
    return rows


def truncate_metrics(src: str, dst: str, last_step: int) -> List[dict]:
    """Write to `dst` the rows of `src` up to `last_step` (a resumed run rewrites what came after its
    checkpoint) and return them; `src` stays whole if the write fails."""
    try:
        rows = [r for r in read_metrics(src) if r["step"] <= last_step]
    except ValueError as e:
        raise ValueError(f"--resume: {e}") from None
    except (KeyError, TypeError):
        raise ValueError(f"--resume: {src} holds rows without a step number") from None
    try:  # whole or not at all: `src` (often `dst` itself) stays whole if the write fails
        run_folder.write_atomically(dst, lambda f: f.write("".join(dumps(r) + "\n" for r in rows).encode()))
    except ValueError as e:
        raise ValueError(f"{e}; {src} is as it was") from None
    return rows


def finite(obj):
    """`obj` with NaN and ±inf floats as None: JSON has no such numbers (Python would write bare NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    """Strict JSON of `obj`, non-finite floats as null."""
    return json.dumps(finite(obj), allow_nan=False, **kw)


def plot(rows: List[dict], title: str, reward: str, eval_before: Optional[float]) -> Optional[bytes]:
    """Reward (`reward` names it), KL, entropy and clip fraction against step, the held-out reward from its
    step-0 evaluation (`eval_before`, before RL) on, as a PNG; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, PLOTTED):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label="train (sampled)" if key == "reward_mean" else key)
        if key == "reward_mean":
            ev = [(0, eval_before)] * (eval_before is not None) + [
                (r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
            if ev:
                ax.plot(*zip(*ev), "o-", label="held-out (greedy)")
            ax.legend()
            label = f"reward: {reward}"
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    return png.getvalue()


def summary_table(summary: dict) -> str:
    keys = ("algo", "device", "dtype", "steps", "eval_reward_before", "eval_reward_after", "final_reward_mean",
            "final_kl", "final_entropy", "skipped_steps", "wall_time_s")
    width = max(len(k) for k in keys)
    lines = ["-" * (width + 16)]
    for k in keys:
        v = summary.get(k)
        lines.append(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    lines.append("-" * (width + 16))
    return "\n".join(lines)


class RunLog:
    """What a run writes as it trains, on rank 0: metrics.jsonl and completions.jsonl (a resumed run keeps their
    rows up to its checkpoint, read from `resumed_from`, its old folder; a new one starts with the completions of
    the evaluation before RL, `samples`, as step 0), the --report-to trackers, the progress bar, and at the end
    summary.json and the plot."""

    def __init__(self, logs, master: bool, settings: dict, start: int, resumed_from: Optional[str], samples: list):
        self.logs, self.master = logs, master
        self.metrics_path = os.path.join(logs.out, "metrics.jsonl")
        self.completions_path = os.path.join(logs.out, "completions.jsonl")
        self.history = []  # the rows up to the checkpoint of a resumed run
        if master:
            if resumed_from is not None:
                self.history = truncate_metrics(os.path.join(resumed_from, "metrics.jsonl"), self.metrics_path, start)
                truncate_metrics(os.path.join(resumed_from, "completions.jsonl"), self.completions_path, start)
            else:
                run_folder.write_file(self.metrics_path, "", "w")
                run_folder.write_file(self.completions_path, "", "w")
        self.tracking = trackers.Trackers(logs.report_to if master else [], logs.out, settings, start + 1)
        self.bar = tqdm(range(start, logs.steps), initial=start, total=logs.steps,
                        disable=not (logs.progress and master), dynamic_ncols=True, desc=logs.algo)
        self._append(start, None, samples)

    def say(self, text: str) -> None:
        """A line above the progress bar (rank 0's)."""
        if self.master:
            self.bar.write(text)

    def write_step(self, row: dict, samples: list, stopping: bool) -> None:
        """The step's row (every --logging-steps, at evals, at the end and at a stop), its completions, the bar."""
        step, logs = row["step"], self.logs
        logged = step % logs.logging_steps == 0 or "eval_reward" in row or step == logs.steps or stopping
        self._append(step, row if logged else None, samples)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl'] or 0:.4f}",
                             ent=f"{row['entropy'] or 0:.3f}",
                             **({"eval": f"{row['eval_reward']:.3f}"} if "eval_reward" in row else {}))

    def _append(self, step: int, row: Optional[dict], samples: list) -> None:
        """A metrics row (None: not this step) and sample completions, as lines of their JSONL files and to the
        trackers (rank 0)."""
        if not self.master:
            return
        completions = [{"step": step, **s} for s in samples]
        files = ((self.metrics_path, [row] if row is not None else []), (self.completions_path, completions))
        texts = [(path, "".join(dumps(r) + "\n" for r in rows)) for path, rows in files if rows]
        for path, text in texts:  # every line formed before either file grows: a bad value appends to neither
            run_folder.write_file(path, text, "a")
        if row is not None:
            self.tracking.metrics(row)
        if completions:
            self.tracking.completions(step, completions)

    def close(self) -> None:
        self.bar.close()
        self.tracking.close()

    def write_summary(self, summary: dict, reward_label: str) -> bool:
        """summary.json and the plot of metrics.jsonl (rank 0); whether there is a plot (matplotlib installed)."""
        out, text = self.logs.out, dumps(summary, indent=2)
        png = plot(read_metrics(self.metrics_path), f"rlkernels.train --algo {self.logs.algo}", reward_label,
                   summary["eval_reward_before"])
        run_folder.write_file(os.path.join(out, "summary.json"), text, "w")
        if png is not None:
            run_folder.write_file(os.path.join(out, "metrics.png"), png, "wb")
        return png is not None
