"""`train(config)`: rollout → reward → advantages → update, one loop read top to bottom.

Every RL step:
  1. rollout    sample `num_generations` completions per prompt with HF `generate` at `temperature`
  2. score      one no-grad forward of the policy (and of the reference / critic) over the sampled
                rows: the behaviour log-probs ℓ_old under the same temperature
  3. reward     a rule-based verifier per completion (exact match, regex, or a Python function)
  4. advantages group-normalised (GRPO family), Tree-GRPO, or GAE on a critic (PPO)
  5. update     μ = `epochs` passes over `minibatches` mini-batches of whole prompt groups, the
                loss through `loss_head` (the fused rlkernels ops), one optimizer step each
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import rlkernels
from rlkernels import advantages as adv_lib
from rlkernels import presets, sampling

from . import report, task
from .config import Config, describe, validate

CHECKPOINT = "checkpoint.pt"


# ----------------------------------------------------------------------------------------------
# The loss head: the ONE place the policy loss is called. Switching to the hidden-state path is
# the commented line below (it takes `hidden` and the lm_head weight instead of the logits).

def loss_head(model, hidden, batch, loss_cfg, *, num_items, num_seqs, temperature, path="fused"):
    """Policy loss of `loss_cfg` on the completion positions `hidden (b, T, H)`; a LossOutput."""
    head = _parts(model)[1]
    kw = dict(old_logp=batch["old_logp"], ref_logp=batch["ref_logp"], group_ids=batch["group_ids"],
              rewards=batch["rewards"], num_items=num_items, num_seqs=num_seqs)
    if path == "linear":  # from the hidden states: the (b, T, V) logits never exist (DESIGN.md §2)
        return rlkernels.fused_linear_policy_loss(hidden, head.weight, batch["targets"], batch["advantages"],
                                                  batch["mask"], loss_cfg, bias=head.bias, temperature=temperature,
                                                  **kw)
    logits = head(hidden).float()
    if path == "split":
        logp, entropy = rlkernels.token_logprobs(logits, batch["targets"], temperature=temperature, return_entropy=True)
        return rlkernels.policy_loss(logp, batch["advantages"], batch["mask"], loss_cfg, entropy=entropy, **kw)
    return rlkernels.fused_policy_loss(logits, batch["targets"], batch["advantages"], batch["mask"], loss_cfg,
                                       temperature=temperature, **kw)


# ----------------------------------------------------------------------------------------------
# Model plumbing

def _parts(model):
    """(trunk, lm_head) of a HF causal LM, seen through a peft wrapper (adapters stay active)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def hidden_states(trunk, seq, attn):
    """Last hidden states (B, S, H); positions count only attended tokens (as `generate` does)."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return trunk(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state


class Critic(nn.Module):
    """PPO value model: a zero-initialised linear head on the actor's trunk (`shared`, a "hydra"
    head, gradients of the value loss reach the trunk) or on its own copy of it (`separate`)."""

    def __init__(self, trunk: nn.Module, hidden_size: int, separate: bool):
        super().__init__()
        self.trunk = copy.deepcopy(trunk) if separate else None
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, actor_hidden, seq, attn, P):
        h = actor_hidden if self.trunk is None else hidden_states(self.trunk, seq, attn)[:, P - 1:-1]
        return self.head(h).squeeze(-1).float()


@torch.no_grad()
def token_logp(model, seq, attn, P, temperature):
    """log π(y_t | y_<t) / τ-softmax of the completion tokens seq[:, P:], and the hidden states."""
    trunk, head = _parts(model)
    h = hidden_states(trunk, seq, attn)[:, P - 1:-1]
    return rlkernels.token_logprobs(head(h).float(), seq[:, P:], temperature=temperature), h


# ----------------------------------------------------------------------------------------------
# Rollout and evaluation

@torch.no_grad()
def generate(model, tok, ids, attn, cfg, *, greedy=False, max_new_tokens=None):
    """(sequences (B, P + max_new_tokens), attention over them): prompts then completions,
    padded after eos. Pure temperature sampling: no top-k / top-p, so the recorded ℓ_old
    (a forward pass at the same temperature) is the sampling distribution."""
    n = max_new_tokens or cfg.max_new_tokens
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=0,
                         pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, **kw)
    if out.shape[1] < ids.shape[1] + n:  # every row stopped early
        out = torch.cat([out, out.new_full((out.shape[0], ids.shape[1] + n - out.shape[1]), tok.pad_id)], 1)
    full_attn = torch.cat([attn, torch.ones_like(out[:, ids.shape[1]:])], 1)
    return out, full_attn


@torch.no_grad()
def evaluate(model, tok, examples, reward_fn, cfg, batch=256):
    """Mean reward of greedy completions over held-out examples (accuracy for `exact`)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        ids, attn = task.left_pad([tok.encode(p) for p, _ in chunk], tok.pad_id)
        seq, _ = generate(model, tok, ids, attn, cfg, greedy=True)
        for (p, a), row in zip(chunk, seq[:, ids.shape[1]:]):
            total += float(reward_fn(p, tok.decode(row), a))
    model.train(was_training)
    return total / max(len(examples), 1)


def rollout(model, tok, prompts, cfg, rng):
    """Sample completions: `num_generations` per prompt (rows grouped by prompt), or Tree-GRPO
    trees: `tree_roots` sampled roots per prompt, each cut at a random depth and branched into
    `num_generations / tree_roots` continuations that share that prefix.
    Returns (seq, attn, P, tree_ids or None)."""
    ids, attn = task.left_pad([tok.encode(p) for p, _ in prompts], tok.pad_id)
    P, G = ids.shape[1], cfg.num_generations
    if not cfg.tree:
        seq, full_attn = generate(model, tok, ids.repeat_interleave(G, 0), attn.repeat_interleave(G, 0), cfg)
        return seq, full_attn, P, None
    R, K = cfg.tree_roots, G // cfg.tree_roots
    roots, root_attn = generate(model, tok, ids.repeat_interleave(R, 0), attn.repeat_interleave(R, 0), cfg)
    roots, root_attn = roots.view(len(prompts), R, -1), root_attn.view(len(prompts), R, -1)
    seqs, attns = [], []
    for r in range(R):  # one cut depth per root index keeps every branch input the same length
        cut = rng.randint(1, cfg.max_new_tokens - 1)
        pre, pre_attn = roots[:, r, :P + cut].repeat_interleave(K, 0), root_attn[:, r, :P + cut].repeat_interleave(K, 0)
        s, a = generate(model, tok, pre, pre_attn, cfg, max_new_tokens=cfg.max_new_tokens - cut)
        seqs.append(s.view(len(prompts), K, -1))
        attns.append(a.view(len(prompts), K, -1))
    seq = torch.cat(seqs, 1).flatten(0, 1)  # (prompts × R × K, P + T): grouped by prompt, then tree
    full_attn = torch.cat(attns, 1).flatten(0, 1)
    tree_ids = torch.arange(R).repeat_interleave(K).repeat(len(prompts))
    return seq, full_attn, P, tree_ids


# ----------------------------------------------------------------------------------------------
# Distributed helpers (torchrun; gloo on CPU). Gradients are SUMMED over ranks, not averaged:
# the loss is already divided by the global token / row count (`num_items` / `num_seqs`).

def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_sum(x: float) -> float:
    if dist_info()[1] == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def sync_grads(params) -> None:
    if dist_info()[1] == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


# ----------------------------------------------------------------------------------------------
# Checkpoints: model(s), optimizer, RNG states, step; the config rides along

def save_checkpoint(path, state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(resume: str) -> dict:
    path = os.path.join(resume, CHECKPOINT) if os.path.isdir(resume) else resume
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no {CHECKPOINT} in {resume!r}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file: say which flag pointed at it
        raise ValueError(f"--resume: cannot read checkpoint {path!r} ({type(e).__name__}: {e})") from None


def merge_resume(cfg: Config, saved: dict, explicit: Optional[set] = None) -> Config:
    """The checkpoint's config, with the fields set explicitly (by default: those that differ
    from the defaults) taken from `cfg`. `resume` and `out` always come from `cfg`."""
    default = Config()
    if explicit is None:
        explicit = {f for f in saved if getattr(cfg, f, None) != getattr(default, f, None)}
    merged = {**saved, **{f: getattr(cfg, f) for f in explicit if f in saved}}
    merged["resume"] = cfg.resume
    merged["out"] = cfg.out or (cfg.resume if os.path.isdir(cfg.resume) else os.path.dirname(cfg.resume))
    out = Config(**{k: v for k, v in merged.items() if k in Config.__dataclass_fields__})
    validate(out)
    return out


# ----------------------------------------------------------------------------------------------

def loss_config(cfg: Config, group_size: int):
    """The preset of `--algo` with the trainer's overrides. PPO's KL goes into the reward (§5), so
    its loss config carries none; the GRPO family's KL is in the loss (k3 unless the preset says)."""
    base = presets.get(cfg.algo)
    over = {"entropy_coef": cfg.entropy_coef}
    if cfg.clip_low is not None:
        over["clip_low"] = cfg.clip_low
    if cfg.clip_high is not None:
        over["clip_high"] = cfg.clip_high
    if cfg.algo != "ppo" and cfg.kl_coef is not None:
        over["kl_coef"] = cfg.kl_coef
        if cfg.kl_coef > 0 and base.kl_estimator is None:
            over["kl_estimator"] = "k3"
    if base.ratio in ("group_expectation", "snis"):
        over["group_size"] = group_size
    return base.replace(**over)


def train(config: Config, reward_fn=None, explicit: Optional[set] = None) -> dict:
    """Run (or `--resume`) an RL fine-tuning job; returns the summary dict (also in summary.json).

    `reward_fn(prompt, completion, answer) -> float` replaces `--reward` when given."""
    t_start = time.time()
    validate(config)
    saved = load_checkpoint(config.resume) if config.resume else None
    cfg = merge_resume(config, saved["config"], explicit) if saved else config
    rank, world = dist_info()
    master = rank == 0
    # The demo model is so small that one thread per process is fastest (more threads spin on
    # tiny matmuls, badly so on a shared machine); real models get up to 4 per process.
    torch.set_num_threads(cfg.threads or (1 if not cfg.model else max(1, min(4, os.cpu_count() or 1) // world)))
    out_dir = cfg.out or time.strftime("runs/%Y%m%d-%H%M%S")
    cfg = dataclasses.replace(cfg, out=out_dir)
    log = print if master else (lambda *a, **k: None)
    if master:
        os.makedirs(out_dir, exist_ok=True)
    log(f"rlkernels.train: {'resuming ' + cfg.resume if saved else 'config'}\n{describe(cfg)}")

    # ---- seeds: model init and data order are identical on every rank; sampling differs per rank
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)  # prompt order, mini-batch order, tree cut depths

    # ---- task, tokenizer, policy
    reward_fn = reward_fn or task.make_reward(cfg.reward)
    if cfg.model:
        policy, tok = task.load_model(cfg.model)
        train_set, eval_set = task.jsonl_task(cfg.prompts, cfg.eval_size, cfg.seed) if cfg.prompts else (None, None)
        if train_set is None:
            raise ValueError("--prompts: required with --model (a JSONL of prompts and answers)")
    else:
        tok = task.CharTokenizer()
        if cfg.prompts:
            train_set, eval_set = task.jsonl_task(cfg.prompts, cfg.eval_size, cfg.seed)
        else:
            train_set, eval_set = task.addition_task(cfg.digits, cfg.eval_size, cfg.seed)
        for p, _ in train_set[:1] + eval_set[:1]:
            tok.encode(p)  # a clear error for characters outside the demo vocabulary
        prompt_len = max(len(tok.encode(p)) for p, _ in train_set + eval_set)
        policy = task.tiny_model(cfg, tok, prompt_len)
    policy.generation_config.top_k = None  # pure temperature sampling (see `generate`)
    n_params = sum(p.numel() for p in policy.parameters())
    log(f"policy: {type(policy).__name__}, {n_params / 1e6:.2f}M parameters; "
        f"{len(train_set)} train / {len(eval_set)} held-out prompts; world size {world}")

    # ---- supervised warm-up (demo model only; a resumed run loads the weights instead)
    eval_before = saved["eval_reward_before"] if saved else None
    if not saved and not cfg.model and cfg.warmup_steps:
        policy.train()
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.warmup_lr, weight_decay=0.0, betas=(0.9, 0.98))
        for it in range(cfg.warmup_steps):
            ids, attn, labels = task.supervised_batch(tok, rng.sample(train_set, cfg.warmup_batch))
            loss = policy(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        log(f"warm-up: {cfg.warmup_steps} supervised steps, final loss {loss.item():.3f}")

    # ---- reference model: the policy as RL starts, frozen. Needed for any KL term.
    algo_ppo = cfg.algo == "ppo"
    G = cfg.num_generations
    loss_cfg = loss_config(cfg, cfg.pods_keep or G)
    beta = (0.05 if cfg.kl_coef is None else cfg.kl_coef) if algo_ppo else loss_cfg.kl_coef  # PPO: β in the reward
    ref = None
    if beta > 0:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        if saved and saved.get("ref") is not None:
            ref.load_state_dict(saved["ref"])
    if cfg.lora_rank:
        policy = task.add_lora(policy, cfg.lora_rank, cfg.lora_alpha)
    trunk, _ = _parts(policy)
    critic = Critic(trunk, policy.config.hidden_size, cfg.critic == "separate") if algo_ppo else None
    params = [p for p in policy.parameters() if p.requires_grad]
    if critic is not None:
        params += [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))

    start = 0
    if saved:
        policy.load_state_dict(saved["model"])
        if critic is not None:
            critic.load_state_dict(saved["critic"])
        optimizer.load_state_dict(saved["optimizer"])
        start, beta = saved["step"], saved["kl_coef"]
        rng.setstate(saved["rng"]["python"])
        random.setstate(saved["rng"]["python_global"])
        torch.set_rng_state(saved["rng"]["torch"][rank])
        log(f"resumed at step {start} from {cfg.resume}")
    else:
        torch.manual_seed(cfg.seed * 1000 + rank + 1)  # per-rank sampling streams
    if eval_before is None:
        eval_before = evaluate(policy, tok, eval_set, reward_fn, cfg)
    log(f"held-out greedy reward before RL: {eval_before:.3f}  (algo {cfg.algo}, loss {loss_cfg})")

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if master:
        report.truncate_metrics(metrics_path, start) if saved else open(metrics_path, "w").close()

    def checkpoint(step):
        rngs = [torch.get_rng_state()]
        if world > 1:
            rngs = [None] * world
            dist.all_gather_object(rngs, torch.get_rng_state())
        if master:
            save_checkpoint(os.path.join(out_dir, CHECKPOINT), {
                "config": dataclasses.asdict(cfg), "step": step, "kl_coef": beta,
                "model": policy.state_dict(), "critic": critic.state_dict() if critic is not None else None,
                "ref": ref.state_dict() if ref is not None and not cfg.model else None,
                "optimizer": optimizer.state_dict(), "eval_reward_before": eval_before,
                "rng": {"torch": rngs, "python": rng.getstate(), "python_global": random.getstate()},
            })

    # Ctrl-C: finish the current step, checkpoint, stop. A second Ctrl-C interrupts at once.
    stop = {"now": False}

    def on_sigint(signum, frame):
        if stop["now"]:
            raise KeyboardInterrupt
        stop["now"] = True
        log("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)")

    try:
        old_handler = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread
        old_handler = None

    from tqdm.auto import tqdm
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (cfg.progress and master),
               dynamic_ncols=True, desc=cfg.algo)
    skipped_total, last = 0, {}
    policy.train()
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.time()
            # ==== 1. rollout: this rank's share of the step's prompts ========================
            chosen = rng.sample(train_set, cfg.prompts_per_step * world)
            prompts = chosen[rank * cfg.prompts_per_step:(rank + 1) * cfg.prompts_per_step]
            policy.eval()
            seq, attn, P, tree_ids = rollout(policy, tok, prompts, cfg, rng)
            targets = seq[:, P:]
            mask = task.first_eos_mask(targets, tok.eos_id)
            group_ids = torch.arange(len(prompts)).repeat_interleave(G) + rank * cfg.prompts_per_step

            # ==== 2. reward: a verifier per completion (+ DAPO's overlong penalty) ============
            answers = [a for _, a in prompts for _ in range(G)]
            texts = [tok.decode(row) for row in targets]
            rewards = torch.tensor([float(reward_fn(prompts[i // G][0], texts[i], answers[i]))
                                    for i in range(len(texts))], dtype=torch.float32)
            score = rewards.clone()  # the verifier's reward, reported as reward_mean
            lengths = mask.sum(-1)
            if cfg.overlong_buffer:
                rewards = rewards + sampling.overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)

            # ==== PODS / dynamic sampling: choose the rows the update trains on ================
            keep = torch.arange(len(rewards))
            if cfg.pods_keep:  # the m rollouts per prompt with the largest reward variance
                keep = sampling.pods_select(rewards, cfg.pods_keep, group_ids)
            if cfg.dynamic_sampling:  # a group whose rewards are all equal has zero advantage
                keep = keep[sampling.filter_uniform_groups(rewards[keep], group_ids[keep])]
            seq, attn, targets, mask, rewards, group_ids, lengths = (
                x[keep] for x in (seq, attn, targets, mask, rewards, group_ids, lengths))
            tree_ids = tree_ids[keep] if tree_ids is not None else None

            # ==== 3. behaviour log-probs ℓ_old: a forward pass at the sampling temperature ====
            # (not generate's scores: the same forward as the update, so the first ratio is 1 up
            # to rounding; test_trainer checks it equals generate's own τ-softmax of the logits.)
            old_logp, h = token_logp(policy, seq, attn, P, cfg.temperature)
            ref_logp = token_logp(ref, seq, attn, P, cfg.temperature)[0] if ref is not None else None

            # ==== 4. advantages ===============================================================
            if algo_ppo:
                # PPO: per-token reward = −β·k1(π_old ‖ π_ref) at every token, + R at the last
                # token; GAE(γ, λ) on the critic's values; returns are the value targets.
                with torch.no_grad():
                    values = critic(h, seq, attn, P)
                kl_tok = (old_logp - ref_logp) if ref is not None else torch.zeros_like(old_logp)
                tok_reward = -beta * kl_tok * mask
                last_tok = (lengths - 1).clamp(min=0)
                tok_reward[torch.arange(len(rewards)), last_tok] += rewards * (lengths > 0)
                advantages, returns = adv_lib.gae(tok_reward, values, mask, cfg.gamma, cfg.lam)
            elif cfg.tree:
                # Tree-GRPO: the prompt-level plus the tree-level normalised reward
                advantages = adv_lib.tree_grpo(rewards, group_ids, tree_ids)
            elif loss_cfg.ratio == "snis":
                advantages = None  # SNIS takes the rewards and builds its own baseline
            else:
                # GRPO family: each reward against its prompt group (Dr. GRPO: not scaled)
                scale = None if cfg.algo == "dr_grpo" else "group"
                advantages = adv_lib.group_normalized(rewards, group_ids, scale=scale) if len(rewards) else rewards
            batch = dict(seq=seq, attn=attn, targets=targets, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                         group_ids=group_ids, rewards=rewards, advantages=advantages,
                         values=values if algo_ppo else None, returns=returns if algo_ppo else None)

            # ==== 5. update: μ epochs over mini-batches of whole prompt groups ================
            # (the learning rate ramps up linearly over the first `lr_warmup_steps` steps: a fresh
            # AdamW state after the supervised warm-up otherwise takes too large first steps)
            for g in optimizer.param_groups:
                g["lr"] = cfg.lr * min(1.0, step / cfg.lr_warmup_steps) if cfg.lr_warmup_steps else cfg.lr
            policy.train()
            groups = sorted(set(group_ids.tolist()))
            n_groups_global = int(all_sum(len(groups)))
            collected, skipped, n_updates = [], 0, 0
            for epoch in range(cfg.epochs):
                order = groups[:]
                rng.shuffle(order)
                per = max(1, math.ceil(len(order) / cfg.minibatches)) if order else 1
                for mb in range(cfg.minibatches):
                    gsel = torch.tensor(order[mb * per:(mb + 1) * per], dtype=group_ids.dtype)
                    rows = torch.isin(group_ids, gsel).nonzero().squeeze(-1)
                    mbatch = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
                    # global normalisers: the loss is Σ_local / N_global, so summed gradients are exact
                    num_items = all_sum(mbatch["mask"].sum())
                    num_seqs = all_sum((mbatch["mask"].sum(-1) > 0).sum())
                    if num_items == 0:
                        continue
                    trunk, _ = _parts(policy)
                    hid = hidden_states(trunk, mbatch["seq"], mbatch["attn"])[:, P - 1:-1]
                    out = loss_head(policy, hid, mbatch, loss_cfg, num_items=num_items, num_seqs=num_seqs,
                                    temperature=cfg.temperature, path=cfg.loss_path)
                    loss, m = out.loss, {k: float(v) for k, v in out.metrics.items()}
                    if critic is not None:
                        vout = rlkernels.value_loss(critic(hid, mbatch["seq"], mbatch["attn"], P), mbatch["values"],
                                                    mbatch["returns"], mbatch["mask"], clip=cfg.vf_clip,
                                                    num_items=num_items)
                        loss = loss + cfg.vf_coef * vout.loss
                        m["value_loss"] = float(vout.loss.detach())
                        m["vf_clip_frac"] = float(vout.metrics["vf_clip_frac"])
                    m["loss"] = float(loss.detach())
                    # a non-finite loss or gradient never reaches the weights: skip this update
                    bad = all_sum(0.0 if math.isfinite(m["loss"]) else 1.0) > 0
                    optimizer.zero_grad(set_to_none=True)
                    if not bad:
                        loss.backward()
                        sync_grads(params)
                        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                        bad = all_sum(0.0 if torch.isfinite(grad_norm) else 1.0) > 0
                        m["grad_norm"] = float(grad_norm)
                    if bad:
                        optimizer.zero_grad(set_to_none=True)
                        skipped += 1
                        bar.write(f"step {step}: non-finite loss/gradient ({m['loss']}); update skipped")
                        continue
                    optimizer.step()
                    n_updates += 1
                    collected.append(m)

            # PPO's adaptive β (Ziegler et al. 2019): move the observed KL towards the target
            kl_obs = all_sum(((old_logp - ref_logp) * mask).sum()) / max(all_sum(mask.sum()), 1) if ref is not None else 0.0
            if algo_ppo and cfg.kl_target is not None and ref is not None:
                err = max(-0.2, min(0.2, kl_obs / cfg.kl_target - 1))
                beta *= 1 + err * len(rewards) * world / 10000

            # ==== metrics =====================================================================
            skipped_total += skipped
            n_rows = all_sum(len(score))
            row = {"step": step, "reward_mean": all_sum(score.sum()) / max(n_rows, 1),
                   "reward_std": float(score.std()) if len(score) > 1 else 0.0,
                   "response_len": all_sum(lengths.float().sum()) / max(all_sum(len(lengths)), 1),
                   "rows_trained": int(all_sum(len(rewards))), "groups": n_groups_global,
                   "updates": n_updates, "skipped": skipped, "kl_coef": beta, "rollout_kl": kl_obs}
            keys = sorted({k for m in collected for k in m})
            for k in keys:
                row[k] = all_sum(sum(m[k] for m in collected if k in m) / len(collected)) / world
            for k in ("loss", "kl", "entropy", "clip_frac"):
                row.setdefault(k, None)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                row["eval_reward"] = evaluate(policy, tok, eval_set, reward_fn, cfg)
            row["time_s"] = round(time.time() - t0, 4)  # wall-clock fields differ between identical runs
            row["tokens_per_s"] = round(all_sum(lengths.sum()) / row["time_s"], 1)
            last = row
            if master:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl'] or 0:.4f}",
                            ent=f"{row['entropy'] or 0:.3f}",
                            **({"eval": f"{row['eval_reward']:.3f}"} if "eval_reward" in row else {}))
            if step % cfg.ckpt_every == 0 or step == cfg.steps or stop["now"]:
                checkpoint(step)
            if stop["now"]:
                log(f"stopped at step {step}; continue with: python -m rlkernels.train --resume {out_dir}")
                break
    finally:
        bar.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)

    # ---- summary: eval after RL, table, plot, files
    done = last.get("step", start)
    eval_after = last.get("eval_reward") if last.get("eval_reward") is not None else evaluate(policy, tok, eval_set, reward_fn, cfg)
    summary = {"algo": cfg.algo, "steps": done, "eval_reward_before": eval_before, "eval_reward_after": eval_after,
               "final_reward_mean": last.get("reward_mean"), "final_kl": last.get("kl"),
               "final_entropy": last.get("entropy"), "skipped_steps": skipped_total,
               "wall_time_s": round(time.time() - t_start, 1), "out": out_dir, "config": dataclasses.asdict(cfg)}
    if master:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plotted = report.plot(report.read_metrics(metrics_path), os.path.join(out_dir, "metrics.png"),
                              f"rlkernels.train --algo {cfg.algo}")
        log(report.summary_table(summary))
        log(f"files in {out_dir}/: metrics.jsonl, summary.json, {CHECKPOINT}"
            + (", metrics.png" if plotted else " (no plot: matplotlib is not installed)"))
    return summary
