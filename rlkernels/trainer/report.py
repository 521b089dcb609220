"""What the person running the trainer sees and keeps: JSONL metrics, a PNG plot, a summary table."""
from __future__ import annotations

import json
import os
from typing import List

PLOTTED = (("reward_mean", "reward (train) / accuracy (eval)"), ("kl", "KL to reference"),
           ("entropy", "entropy"), ("clip_frac", "clip fraction"))


def read_metrics(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> None:
    """Keep the lines of steps <= last_step (a resumed run rewrites what came after its checkpoint)."""
    rows = [r for r in read_metrics(path) if r["step"] <= last_step]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def plot(rows: List[dict], path: str, title: str) -> bool:
    """Reward, KL, entropy and clip fraction against step; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, PLOTTED):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=key)
        if key == "reward_mean":
            ev = [(r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
            if ev:
                ax.plot(*zip(*ev), "o-", label="eval_reward (greedy)")
            ax.legend()
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def summary_table(summary: dict) -> str:
    keys = ("algo", "steps", "eval_reward_before", "eval_reward_after", "final_reward_mean", "final_kl",
            "final_entropy", "skipped_steps", "wall_time_s")
    width = max(len(k) for k in keys)
    lines = ["-" * (width + 16)]
    for k in keys:
        v = summary.get(k)
        lines.append(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    lines.append("-" * (width + 16))
    return "\n".join(lines)
