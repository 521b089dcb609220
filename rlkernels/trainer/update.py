"""The update: one optimizer step on a mini-batch (all ranks together), through the update's forward as one module
(DDP or FSDP under torchrun); the loss config of --algo and the learning-rate schedule.

Gradients are SUMMED over ranks, not averaged: the loss is already divided by the global token / row count
(`num_items` / `num_seqs`)."""
from __future__ import annotations

import math

import torch
from torch import nn

import rlkernels

from . import model, timing
from .distributed import all_sum


class UpdateForward(nn.Module):
    """The update's forward pass as one module: the policy loss through `loss_head`, and the critic's values.

    DistributedDataParallel reduces the gradients of the parameters its module's forward uses, and
    the loss head reads the trunk and the lm_head weight directly, not through the model's forward:
    so all of it runs inside this forward (under FSDP, the root's forward, which gathers that weight).
    Returns (loss, metrics, values or None)."""

    def __init__(self, policy, critic, loss_cfg, head_args, path):
        super().__init__()
        self.policy, self.critic = policy, critic
        self.loss_cfg, self.head_args, self.path = loss_cfg, head_args, path
        self.timer = timing.LossHeadTimer()

    def forward(self, mbatch, P, num_items, num_seqs):
        hid = model.hidden_states(model.parts(self.policy)[0], mbatch["seq"], mbatch["attn"])[:, P - 1:-1]
        out = self.timer.loss_head(lambda x: model.loss_head(self.policy, x, mbatch, self.loss_cfg,
                                                             num_items=num_items, num_seqs=num_seqs,
                                                             head_args=self.head_args, path=self.path), hid)
        values = self.critic(hid, mbatch["seq"], mbatch["attn"], P) if self.critic is not None else None
        return out.loss, out.metrics, values


def minibatch_update(engine, optimizer, params, mbatch, P, opt, place, *, num_items, num_seqs):
    """One optimizer step on a mini-batch (all ranks together), `opt` a config_parts.Optimization (or what has its
    fields); (this rank's metrics, skipped).
    A non-finite loss or gradient on any rank never reaches the weights: the step is skipped."""
    timer = getattr(engine, "module", engine).timer  # under DDP, the UpdateForward it wraps
    timer.begin_step(place.device)
    with place.autocast():
        loss, metrics, pred = engine(mbatch, P, num_items, num_seqs)
    m = {k: float(v) for k, v in metrics.items()}
    if pred is not None:
        vout = rlkernels.value_loss(pred, mbatch["values"], mbatch["returns"], mbatch["mask"],
                                    clip=opt.vf_clip, num_items=num_items)
        loss = loss + opt.vf_coef * vout.loss
        m["value_loss"] = float(vout.loss.detach())
        m["vf_clip_frac"] = float(vout.metrics["vf_clip_frac"])
    m["loss"] = float(loss.detach())
    bad = all_sum(0.0 if math.isfinite(m["loss"]) else 1.0) > 0
    optimizer.zero_grad(set_to_none=True)
    if not bad:
        loss.backward()  # under DDP: summed over ranks by the time it returns
        grad_norm = torch.nn.utils.clip_grad_norm_(params, opt.max_grad_norm)
        bad = all_sum(0.0 if torch.isfinite(grad_norm) else 1.0) > 0
        m["grad_norm"] = float(grad_norm)
    if bad:
        optimizer.zero_grad(set_to_none=True)
        return m, True
    optimizer.step()
    m.update(timer.end_step())
    return m, False



# metrics that are this rank's share of a global sum (Σ_rank / N_global): summed over ranks, not averaged
SUMMED_METRICS = ("loss", "value_loss")

def lr_factor(opt, step: int) -> float:
    """The learning rate of RL step `step` (from 1) as a fraction of --lr: a linear ramp over --lr-warmup-steps,
    then --lr-scheduler-type: constant, or a linear or cosine decay towards 0 after the last step (as transformers'
    schedules, whose step s counts from 0)."""
    if step < opt.lr_warmup_steps:
        return step / opt.lr_warmup_steps
    if opt.lr_scheduler_type == "constant":
        return 1.0
    progress = max(0, step - 1 - opt.lr_warmup_steps) / max(1, opt.steps - opt.lr_warmup_steps)
    return 1.0 - progress if opt.lr_scheduler_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_steps(run, batch: dict, step: int) -> dict:
    """The step's update (loop.py's step 4), `run` a state.Run: μ = --epochs passes over --minibatches mini-batches
    of whole prompt groups, one optimizer step each;
    {"collected": each step's metrics, "skipped", "updates", "groups": over all ranks}. The learning rate ramps
    up linearly over the first --lr-warmup-steps steps: a fresh AdamW state after the supervised warm-up
    otherwise takes too large first steps."""
    opt, group_ids = run.optim, batch["group_ids"]
    for g in run.optimizer.param_groups:
        g["lr"] = opt.lr * lr_factor(opt, step)
    run.policy.train()
    trained = {k: batch[k] for k in ("seq", "attn", "targets", "mask", "old_logp", "ref_logp", "group_ids",
                                     "rewards", "advantages", "values", "returns")}
    groups = sorted(set(group_ids.tolist()))
    out = dict(collected=[], skipped=0, updates=0, groups=int(all_sum(len(groups))))
    for epoch in range(opt.epochs):
        order = groups[:]
        run.rng.shuffle(order)
        per = max(1, math.ceil(len(order) / opt.minibatches)) if order else 1
        for mb in range(opt.minibatches):
            gsel = torch.tensor(order[mb * per:(mb + 1) * per], dtype=group_ids.dtype, device=group_ids.device)
            rows = torch.isin(group_ids, gsel).nonzero().squeeze(-1)
            mbatch = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in trained.items()}
            # global normalisers: the loss is Σ_local / N_global, so summed gradients are exact
            num_items = all_sum(mbatch["mask"].sum())
            num_seqs = all_sum((mbatch["mask"].sum(-1) > 0).sum())
            if num_items == 0:
                continue
            m, bad = minibatch_update(run.engine, run.optimizer, run.params, mbatch, batch["P"], opt, run.place,
                                      num_items=num_items, num_seqs=num_seqs)
            if bad:
                out["skipped"] += 1
                run.outputs.say(f"step {step}: non-finite loss/gradient ({m['loss']}); update skipped")
                continue
            out["updates"] += 1
            out["collected"].append(m)
    return out
