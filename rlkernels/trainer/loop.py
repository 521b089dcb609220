"""`train(config)`: set-up, then rollout → reward → advantages → update, one loop read top to bottom.

Every RL step (the functions below and three of other files, in the order train() calls them):
  1. collect         sample `num_generations` completions per prompt with HF `generate` at `temperature`, and
                     score them: Σ weight·reward over the reward functions and a reward model (rewards.py)
  2. behaviour_logp  one no-grad forward of the policy (and of the reference, and PPO's critic) over the
                     sampled rows: the behaviour log-probs ℓ_old under the same temperature (none when the
                     update is on-policy: one optimizer step, no reference, no critic)
  3. advantages      estimators.advantages: the table's estimator of --adv-estimator (verl's names), or
                     --algo's: group-normalised (GRPO family), GDPO, Tree-GRPO, or GAE on the critic's values
  4. update          update.optimizer_steps: μ = `epochs` passes over `minibatches` mini-batches of whole
                     prompt groups, the loss through `loss_head` (model.py: the fused rlkernels ops), one
                     optimizer step each
  5. step_sums, metrics_row, evaluate_policy, save: the step's sums over the ranks (three all-reduces), its
                     metrics row, evals, logs (`run.outputs`, outputs.RunLog) and checkpoints
The run's state is one `Run` (state.py).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from rlkernels import presets

from . import checkpoint, estimators, generation, outputs, sharding, startup, stop as stop_lib
from .generation import sample_groups
from .run_config import Config, run_dir, validate
from .distributed import all_sum, all_sums, dist_info, nan_mean_stds
from .model import token_logp
from .run_folder import CHECKPOINT
from .state import Run, quiet
from .update import SUMMED_METRICS, optimizer_steps


def _loss_text(algo: str, loss_cfg) -> str:
    """The loss as the preset call that makes it: `presets.grpo(kl_coef=0.0)`."""
    preset = presets.fields(algo)
    changed = [f"{f.name}={getattr(loss_cfg, f.name)!r}" for f in dataclasses.fields(loss_cfg)
               if getattr(loss_cfg, f.name) != preset.get(f.name, f.default)]
    return f"presets.{algo}({', '.join(changed)})"


def train(config: Config, reward_fn=None, explicit: Optional[set] = None) -> dict:
    """Run (or `--resume`) an RL fine-tuning job; returns the summary dict (also in summary.json).

    `reward_fn` replaces `--reward` when given: a function `(prompt, completion, answer) -> float`, or TRL's
    `(prompts, completions, **columns) -> list[float]`, or a list of them (weighted by `reward_weights`;
    `--reward-model` is added after them).

    Ctrl-C and SIGTERM, at any point, stop the run at the next checkpoint that resumes it exactly (stop.py)."""
    validate(config)
    return train_validated(config, reward_fn, explicit)


def train_validated(config: Config, reward_fn=None, explicit: Optional[set] = None) -> dict:
    """`train` of a config that has passed `validate`, as `from_args` returns it: `rlkernels train` checks its
    flags there, once, before it starts the process group."""
    with stop_lib.StopRequest(print if dist_info()[0] == 0 else quiet) as stop:
        run, reward_fns = startup.configure(config, explicit, reward_fn, stop)
        try:  # the set-up (startup.py): the task, the policy, the warm-up, the update, a resumed run's state
            startup.load_task(run, reward_fns)
            startup.load_policy(run)
            if startup.warms_up(run):
                startup.warm_up(run)
            startup.build_update(run)
            checkpoint.restore(run)
            return _train(run, stop)
        finally:
            if run.folder is not None:
                run.folder.release()  # unlocks --out; removes it if this run made it and wrote nothing


def _train(run: Run, stop) -> dict:
    """The run after its set-up: the evaluation before RL, the logs, RL, the summary."""
    samples = []  # a resumed run's are in its completions.jsonl
    if run.eval_before is None and run.eval_set:
        run.eval_before, samples, metrics = evaluate_policy(run, run.start)
        if metrics:  # not into step 1's row: that row is of the rollouts
            run.log("log_metric during the evaluation before RL: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    before = (f"held-out greedy reward ({run.reward_fn.label}) before RL: {run.eval_before:.3f}" if run.eval_set else
              "no evaluation (--eval-size 0)")
    run.log(f"{before}; loss {_loss_text(run.logs.algo, run.loss_cfg)}")
    run.outputs = outputs.RunLog(run.logs, run.master, dataclasses.asdict(run.cfg), run.start,
                                 run_dir(run.cfg.resume) if run.saved else None, samples)
    history = run.outputs.history  # a resumed run's summary counts the steps before its checkpoint too
    run.skipped_total, run.last = sum(r.get("skipped", 0) for r in history), (history[-1] if history else {})
    logs = run.logs
    run.policy.train()
    stop.until = "this step"
    stopping = all_sum(float(stop.requested)) > 0  # a signal before RL: a checkpoint where RL starts
    try:
        if stopping:
            checkpoint.save(run, run.start)
            run.log(f"stopped before step {run.start + 1}; continue with: {resume_command(run)}")
        for step in range(run.start + 1, logs.steps + 1):
            if stopping:
                break
            t0 = time.time()
            rollout_batch = collect(run, step)
            t_rollout = time.time()
            batch = behaviour_logp(run, rollout_batch)
            t_logp = time.time()
            # the estimator's (estimators.py): GAE on the critic's values (PPO), or one of the rewards alone
            batch["advantages"], batch["returns"] = estimators.advantages(run.adv, batch, run.reward_fn.weights,
                                                                          batch["values"], run.beta)
            updates = optimizer_steps(run, batch, step)
            sums = step_sums(run, rollout_batch, batch, updates)
            kl_obs = adapt_kl(run, sums)
            row = metrics_row(run, step, rollout_batch, updates, sums, kl_obs)
            samples = []
            if run.eval_set and (step % logs.eval_every == 0 or step == logs.steps):
                row["eval_reward"], samples, metrics = evaluate_policy(run, step)
                row.update({f"eval/{k}": v for k, v in metrics.items()})  # the evaluation's own log_metric calls
            # where the step's time goes: rollouts (generate and rewards), ℓ_old and the reference's forward
            row["time/rollout_s"], row["time/logp_s"] = round(t_rollout - t0, 4), round(t_logp - t_rollout, 4)
            row["time_s"] = round(time.time() - t0, 4)  # wall-clock fields differ between identical runs
            row["tokens_per_s"] = round(sums["tokens"] / row["time_s"], 1)
            run.last = row
            stopping = all_sum(float(stop.requested)) > 0  # a signal that reached only some ranks stops them all
            run.outputs.write_step(row, samples, stopping)
            if step % logs.ckpt_every == 0 or step == logs.steps or stopping:
                checkpoint.save(run, step)
            if stopping:
                run.log(f"stopped at step {step}; continue with: {resume_command(run)}")
                break
    finally:
        run.outputs.close()
    run.stopped = stopping
    return summarize(run)


def resume_command(run: Run) -> str:
    """The command that continues the run from its checkpoint."""
    return f"rlkernels train --resume {run.out_dir}"


# ----------------------------------------------------------------------------------------------
# One RL step: collect (rollout, reward), behaviour log-probs, advantages, update, metrics

def collect(run: Run, step: int) -> dict:
    """This rank's share of the step's prompts, rolled out and scored (`sample_groups`), with the rows it trains
    on (`train_rows`). Dynamic sampling (DAPO) drops the groups whose rewards are all equal, then samples more
    prompts while some rank has fewer than prompts_per_step groups, up to max_gen_batches rollouts; the
    decision is global, so the ranks stay in step."""
    part, rank, world = run.sampling, run.rank, run.world
    run.policy.eval()
    parts = []
    while True:
        chosen = run.rng.sample(run.train_set, part.prompts_per_step * world)
        prompts = chosen[rank * part.prompts_per_step:(rank + 1) * part.prompts_per_step]
        first_group = (len(parts) * world + rank) * part.prompts_per_step
        run.reward_context.state.global_step = step - 1  # as TRL's: the optimizer steps taken so far
        parts.append(sharding.gathered(run.engine, sample_groups, run.policy, run.tok, prompts, run.sampling, run.rng,
                                       run.reward_fn, first_group, run.place, run.reward_context))
        if not part.dynamic_sampling or len(parts) == part.max_gen_batches:
            break
        n_kept = len(set(torch.cat([p["group_ids"] for p in parts]).tolist()))
        if all_sum(float(n_kept < part.prompts_per_step)) == 0:
            break
    b = concat_rows(parts, run.tok.pad_id)
    train_rows = torch.arange(len(b["rewards"]), device=b["rewards"].device)
    if part.dynamic_sampling:  # the first prompts_per_step groups kept; none when a rank has none
        first_groups = b["group_ids"].unique()[:part.prompts_per_step]
        train_rows = train_rows[torch.isin(b["group_ids"], first_groups)]
        if all_sum(float(len(train_rows) == 0)) > 0:
            train_rows = train_rows[:0]
            run.outputs.say(f"step {step}: no group with unequal rewards{' on some rank' if world > 1 else ''} "
                            f"in {len(parts)} rollout batches (--dynamic-sampling); update skipped")
    return dict(b, train_rows=train_rows, gen_batches=len(parts))


def concat_rows(parts, pad_id):
    """One batch of `sample_groups` results; prompts left-padded to the longest, so that every
    completion starts at column P."""
    if len(parts) == 1:
        return parts[0]
    P = max(p["P"] for p in parts)

    def pad(x, width, value):
        return torch.cat([x.new_full((x.shape[0], width), value), x], 1)

    out = {k: torch.cat([p[k] for p in parts]) if parts[0][k] is not None else None
           for k in parts[0] if k not in ("P", "seq", "attn")}
    out["seq"] = torch.cat([pad(p["seq"], P - p["P"], pad_id) for p in parts])
    out["attn"] = torch.cat([pad(p["attn"], P - p["P"], 0) for p in parts])
    return dict(out, P=P)


def behaviour_logp(run: Run, b: dict) -> dict:
    """The training rows with ℓ_old, the policy's log-probs at the sampling temperature (a forward pass, not
    generate's scores: the same forward as the update, so the first ratio is 1 up to rounding; test_trainer
    checks it equals generate's own τ-softmax of the logits; None when the update is on-policy), the reference's,
    and the policy's hidden states."""
    rows = b["train_rows"]
    batch = {k: b[k][rows] for k in ("seq", "attn", "targets", "mask", "rewards", "group_ids", "lengths", "parts")}
    for k in ("tree_ids", "baselines"):
        batch[k] = b[k][rows] if b[k] is not None else None
    P, seq, attn = b["P"], batch["seq"], batch["attn"]
    opt = run.optim
    # one optimizer step on all the rows, and nothing else reading ℓ_old (no reference, no critic): ℓ_old is the
    # update's own log-probs, detached (the loss's old_logp=None, as TRL does), and the policy's forward here is skipped
    on_policy = opt.epochs == 1 and opt.minibatches == 1 and run.ref is None and run.critic is None
    with run.place.autocast():
        batch["old_logp"], batch["hidden"] = (None, None) if on_policy else sharding.gathered(
            run.engine, token_logp, run.policy, seq, attn, P, run.head_args)
        batch["ref_logp"] = (sharding.gathered(run.ref, token_logp, run.ref, seq, attn, P, run.head_args)[0]
                             if run.ref is not None else None)
        with torch.no_grad():  # PPO's critic, on the policy's hidden states: the values that GAE takes
            batch["values"] = (sharding.gathered(run.engine, run.critic, batch["hidden"], seq, attn, P)
                               if run.critic is not None else None)
    return dict(batch, P=P)


def step_sums(run: Run, b: dict, batch: dict, updates: dict) -> dict:
    """What the step's metrics and the adaptive β sum over all ranks, in one all-reduce: the rollout's rewards,
    lengths and rows, the trained rows, the KL(π_old ‖ π_ref) of the rollout, and each update metric's mean over
    this rank's optimizer steps; then each reward function's mean and std over all ranks (two more)."""
    score, lengths, collected = b["score"], b["all_lengths"], updates["collected"]
    local = {"rows": len(score), "score": score.sum(), "tokens": lengths.sum(), "completions": len(lengths),
             "rows_trained": len(batch["rewards"])}
    if run.ref is not None:
        mask = batch["mask"]
        local.update(kl=((batch["old_logp"] - batch["ref_logp"]) * mask).sum(), kl_tokens=mask.sum())
    for k in sorted({k for m in collected for k in m}):
        local[f"update/{k}"] = sum(m[k] for m in collected if k in m) / len(collected)
    sums = all_sums(local)
    # over the rows each function scored (TRL's nanmean, nanstd)
    parts = {name: b["reward_parts"][:, j] for j, name in enumerate(run.reward_fn.names)}
    for name, (mean, std) in nan_mean_stds(parts).items():
        sums[f"rewards/{name}/mean"], sums[f"rewards/{name}/std"] = mean, std
    return sums


def adapt_kl(run: Run, sums: dict) -> float:
    """The rollout's KL(π_old ‖ π_ref) per token over all ranks; with --kl-target, PPO's adaptive β (Ziegler et
    al. 2019) moves it towards the target."""
    if run.ref is None:
        return 0.0
    kl_obs = sums["kl"] / max(sums["kl_tokens"], 1)
    if run.optim.kl_target is not None:
        err = max(-0.2, min(0.2, kl_obs / run.optim.kl_target - 1))
        run.beta *= 1 + err * sums["rows_trained"] / 10000
    return kl_obs


def metrics_row(run: Run, step: int, b: dict, updates: dict, sums: dict, kl_obs: float) -> dict:
    """The step's metrics row, over all ranks (the eval and wall-clock fields are added by train())."""
    score = b["score"]
    run.skipped_total += updates["skipped"]
    row = {"step": step, "reward_mean": sums["score"] / max(sums["rows"], 1),
           "reward_std": float(score.std()) if len(score) > 1 else 0.0,
           "response_len": sums["tokens"] / max(sums["completions"], 1),
           "rows_trained": int(sums["rows_trained"]), "groups": updates["groups"],
           "updates": updates["updates"], "skipped": updates["skipped"], "kl_coef": run.beta, "rollout_kl": kl_obs}
    if run.sampling.dynamic_sampling:
        row["gen_batches"] = b["gen_batches"]
    for name, value in run.reward_context.log.take_metrics().items():  # log_metric: this rank's mean
        row[name if name not in row else f"reward_fn/{name}"] = value
    for key, total in sums.items():
        if key.startswith("rewards/"):
            row[key] = total
        elif key.startswith("update/"):
            k = key.removeprefix("update/")
            row[k] = total / (1 if k in SUMMED_METRICS else run.world)
    for k in ("loss", "kl", "entropy", "clip_frac"):
        row.setdefault(k, None)
    if "time/update_s" in row:  # the ratio of the means over optimizer steps (and ranks)
        row["time/loss_head_share"] = row["time/loss_head_s"] / row["time/update_s"]
    return row


# ----------------------------------------------------------------------------------------------
# Evaluation, logging, checkpoints, the summary

def evaluate_policy(run: Run, step: int) -> tuple:
    """`evaluate` of the policy on the held-out set (under FSDP, as a forward of the root) after `step` steps:
    (reward, sample completions, the means of what the rewards sent through log_metric meanwhile)."""
    run.reward_context.state.global_step = step
    reward, samples = sharding.gathered(run.engine, generation.evaluate, run.policy, run.tok, run.eval_set,
                                        run.reward_fn, run.sampling, run.place, context=run.reward_context)
    return reward, samples, run.reward_context.log.take_metrics()


def summarize(run: Run) -> dict:
    """The summary after RL (an eval unless the last step made one): summary.json, the table, the plot."""
    logs, last = run.logs, run.last
    eval_after = (last.get("eval_reward") if last.get("eval_reward") is not None or not run.eval_set else
                  evaluate_policy(run, last.get("step", run.start))[0])
    summary = {"algo": logs.algo, "steps": last.get("step", run.start), "eval_reward_before": run.eval_before,
               "eval_reward_after": eval_after, "final_reward_mean": last.get("reward_mean"),
               "final_kl": last.get("kl"), "final_entropy": last.get("entropy"), "skipped_steps": run.skipped_total,
               "wall_time_s": round(time.time() - run.t_start, 1), **run.place.describe(), "out": logs.out,
               "stopped_by": run.stop.signal if run.stopped else None,
               "config": dataclasses.asdict(run.cfg)}
    if run.master:
        plotted = run.outputs.write_summary(summary, run.reward_fn.label)
        if run.folder is not None:
            run.folder.settle()  # a run of no checkpoints (--save-strategy no) replaces the old one here
        run.log(outputs.summary_table(summary))
        run.log(f"files in {logs.out}/: metrics.jsonl, completions.jsonl, summary.json, {CHECKPOINT}, the model and "
                f"its tokenizer (from_pretrained)" + "".join(f", {name} logs" for name in logs.report_to
                                                             if name != "none")
                + (", metrics.png" if plotted else " (no plot: matplotlib is not installed)"))
    return summary
