"""What the person running the trainer sees and keeps: JSONL metrics, a PNG plot, a summary table."""
from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from typing import List, Optional

from .._pyplot import pyplot
from . import run_folder

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
    # into a new file, then renamed over dst (often src itself): a write cut short (a full disk) loses no row
    tmp = dst + ".tmp"
    try:
        run_folder.record(tmp)
        run_folder.record(dst)
        with open(tmp, "w") as f:
            f.write("".join(dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ValueError(f"--out: cannot write {dst} ({e.strerror or e}); {src} is as it was") from None
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


def plot(rows: List[dict], path: str, title: str, reward: str, eval_before: Optional[float]) -> bool:
    """Reward (`reward` names it), KL, entropy and clip fraction against step, the held-out reward from its
    step-0 evaluation (`eval_before`, before RL) on; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
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
    run_folder.record(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


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
