"""`train(config)`: rollout → reward → advantages → update, one loop read top to bottom.

Every RL step:
  1. rollout    sample `num_generations` completions per prompt with HF `generate` at `temperature`
  2. score      one no-grad forward of the policy (and of the reference / critic) over the sampled
                rows: the behaviour log-probs ℓ_old under the same temperature
  3. reward     Σ weight·reward over the reward functions (exact match, regex, Python functions) and a
                reward model, per completion (rewards.py)
  4. advantages group-normalised (GRPO family), Tree-GRPO, or GAE on a critic (PPO)
  5. update     μ = `epochs` passes over `minibatches` mini-batches of whole prompt groups, the
                loss through `loss_head` (the fused rlkernels ops), one optimizer step each
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import pickle
import random
import re
import shutil
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

import rlkernels
from rlkernels import advantages as adv_lib
from rlkernels import presets, sampling

from ..integrations.transformers import check_head, output_head
from . import data, device, export, report, rewards as rewards_lib, sharding, stop as stop_lib, task, timing
from . import run_folder, trackers, trl_names
from .config import Config, _flag, describe, validate

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_KEYS = ("config", "step", "kl_coef", "model", "critic", "ref", "optimizer", "eval_reward_before", "rng")
# what fixes the shapes of the saved weights and optimizer state, or the objective: a resumed run keeps it
RESUME_FIXED = ("model", "n_layer", "n_embd", "n_head", "lora_rank", "lora_target", "algo", "critic")
# what belongs to the machine, not the run: a resumed run takes it from its own flags (a run saved on
# a GPU resumes on a CPU machine)
RESUME_FRESH = ("resume", "device")

# ----------------------------------------------------------------------------------------------
# The loss head: the ONE place the policy loss is called. Switching to the hidden-state path is
# the commented line below (it takes `hidden` and the lm_head weight instead of the logits).

def loss_head(model, hidden, batch, loss_cfg, *, num_items, num_seqs, head_args, path="fused"):
    """Policy loss of `loss_cfg` on the completion positions `hidden (b, T, H)`; a LossOutput.

    Under autocast the head runs at the autocast dtype (bfloat16 hidden states and weight, or
    logits, go into the ops), and the ops themselves run outside it: they accumulate in float32.
    `head_args`: the temperature and soft cap that make `lm_head(hidden)` the model's logits (`output_head_of`)."""
    head = _parts(model)[1]
    kw = dict(old_logp=batch["old_logp"], ref_logp=batch["ref_logp"], group_ids=batch["group_ids"],
              rewards=batch["rewards"], num_items=num_items, num_seqs=num_seqs)
    if path == "linear":  # from the hidden states: the (b, T, V) logits never exist (docs/design.md §4)
        dtype = _compute_dtype(hidden)  # the op takes hidden and weight in one dtype
        bias = head.bias.to(dtype) if head.bias is not None else None
        with _no_autocast(hidden):
            return rlkernels.fused_linear_policy_loss(hidden.to(dtype), head.weight.to(dtype), batch["targets"],
                                                      batch["advantages"], batch["mask"], loss_cfg, bias=bias,
                                                      **head_args, **kw)
    logits = head(hidden)
    with _no_autocast(hidden):
        if path == "split":
            logp, entropy = rlkernels.token_logprobs(logits, batch["targets"], **head_args, return_entropy=True)
            return rlkernels.policy_loss(logp, batch["advantages"], batch["mask"], loss_cfg, entropy=entropy, **kw)
        return rlkernels.fused_policy_loss(logits, batch["targets"], batch["advantages"], batch["mask"], loss_cfg,
                                           **head_args, **kw)


def _compute_dtype(x):
    """The dtype a matmul on `x` runs at here: autocast's when it is on, else x's own."""
    on = torch.is_autocast_enabled(x.device.type)
    return torch.get_autocast_dtype(x.device.type) if on else x.dtype


def _no_autocast(x):
    """The rlkernels ops pick their own precision: autocast must not recast the matmuls inside them."""
    return torch.autocast(x.device.type, enabled=False)


# ----------------------------------------------------------------------------------------------
# Model plumbing

def _parts(model):
    """(trunk, lm_head) of a HF causal LM, seen through a peft wrapper (adapters stay active)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def hidden_states(trunk, seq, attn):
    """Last hidden states (B, S, H); positions count only attended tokens (as `generate` does)."""
    if not len(seq):  # no rows (dynamic sampling kept no group): HF attention cannot reshape an empty batch, so
        # one padding row runs and is dropped; every layer still runs, as FSDP's per-layer collectives need on every rank
        return hidden_states(trunk, seq.new_zeros(1, seq.shape[1]), attn.new_ones(1, attn.shape[1]))[:0]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return trunk(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state


def enable_checkpointing(model) -> None:
    """`--gradient-checkpointing`: Hugging Face's, non-reentrant (torch's recommended form; the reentrant
    one needs inputs that require grad, which frozen embeddings under LoRA are not)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


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


def output_head_of(model, temperature: float, place) -> dict:
    """`{"temperature", "softcap"}` with which the ops make `lm_head(trunk(...))` the log-probs `generate` samples
    from at `temperature`.

    The trainer reads the trunk and the head directly while `generate` samples through the model's forward:
    a scale the config announces (Cohere's `logit_scale`, Granite's `logits_scaling`) is folded into the
    temperature, an announced final-logit cap (Gemma 2/3) is the ops' `softcap`, and anything else the forward
    does to its logits is caught by the integration's head check (a few tokens both ways) before any training.
    Draws no random numbers."""
    head_args = output_head(model.config, temperature)
    ids = (torch.arange(16, device=place.device) % model.config.vocab_size)[None]
    with place.autocast():
        check_head(model, ids, torch.ones_like(ids), lambda i, m: token_logp(model, i, m, 1, head_args)[0],
                   temperature)
    return head_args


@torch.no_grad()
def token_logp(model, seq, attn, P, head_args):
    """log π(y_t | y_<t) / τ-softmax of the completion tokens seq[:, P:], and the hidden states (`head_args`:
    `output_head_of`'s)."""
    trunk, head = _parts(model)
    h = hidden_states(trunk, seq, attn)[:, P - 1:-1]
    logits = head(h)  # as loss_head computes them, at the autocast dtype if any
    with _no_autocast(h):
        return rlkernels.token_logprobs(logits, seq[:, P:], **head_args), h


# ----------------------------------------------------------------------------------------------
# Rollout and evaluation

@torch.no_grad()
def generate(model, tok, ids, attn, cfg, *, greedy=False, max_new_tokens=None):
    """(sequences (B, P + max_new_tokens), attention over them): prompts then completions,
    padded after eos. Pure temperature sampling: no top-k / top-p, so the recorded ℓ_old
    (a forward pass at the same temperature) is the sampling distribution."""
    n = max_new_tokens or cfg.max_new_tokens
    ids, attn = ids.to(model.device), attn.to(model.device)
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=0,
                         pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, **kw)
    if out.shape[1] < ids.shape[1] + n:  # every row stopped early
        out = torch.cat([out, out.new_full((out.shape[0], ids.shape[1] + n - out.shape[1]), tok.pad_id)], 1)
    full_attn = torch.cat([attn, torch.ones_like(out[:, ids.shape[1]:])], 1)
    return out, full_attn


@torch.no_grad()
def evaluate(model, tok, examples, reward_fn, cfg, place, batch=256):
    """(mean reward of greedy completions over held-out examples (accuracy for `exact`), the first
    `eval_completions` of them as {prompt, completion, answer, reward})."""
    was_training = model.training
    model.eval()
    total, samples = 0.0, []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        ids, attn = task.left_pad([tok.encode(ex["prompt"]) for ex in chunk], tok.pad_id)
        with place.autocast():
            seq, _ = generate(model, tok, ids, attn, cfg, greedy=True)
        completions = [tok.decode(row) for row in seq[:, ids.shape[1]:].tolist()]  # one copy off the GPU
        scores = reward_fn(chunk, completions)
        total += sum(scores)
        samples += [dict(prompt=ex["prompt"], completion=c, answer=ex.get("answer"), reward=r)
                    for ex, c, r in zip(chunk, completions, scores)][:cfg.eval_completions - len(samples)]
    model.train(was_training)
    return total / max(len(examples), 1), samples


def rollout(model, tok, prompts, cfg, rng):
    """Sample completions: `num_generations` per prompt (rows grouped by prompt), or Tree-GRPO
    trees: `tree_roots` sampled roots per prompt, each cut at a random depth and branched into
    `num_generations / tree_roots` continuations that share that prefix.
    Returns (seq, attn, P, tree_ids or None)."""
    ids, attn = task.left_pad([tok.encode(ex["prompt"]) for ex in prompts], tok.pad_id)
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
    tree_ids = torch.arange(R, device=seq.device).repeat_interleave(K).repeat(len(prompts))
    return seq, full_attn, P, tree_ids


def sample_groups(policy, tok, prompts, cfg, rng, reward_fn, first_group, place):
    """Roll out `prompts` (groups numbered from `first_group`), score every completion (+ DAPO's
    overlong penalty), and choose the rows the update trains on: PODS, and dynamic sampling's
    drop of the groups whose rewards are all equal (their advantages are zero).
    Returns the chosen rows (a dict of tensors; `parts`: each reward function's rewards), with P, the rewards of all
    rows (`score`) and each reward function's (`reward_parts`, (rows, functions), NaN where a function
    returned None)."""
    G = cfg.num_generations
    with place.autocast():
        seq, attn, P, tree_ids = rollout(policy, tok, prompts, cfg, rng)
    targets = seq[:, P:]
    mask = task.first_eos_mask(targets, tok.eos_id)
    group_ids = torch.arange(len(prompts), device=seq.device).repeat_interleave(G) + first_group
    texts = [tok.decode(row) for row in targets.tolist()]
    totals, parts = reward_fn.score([ex for ex in prompts for _ in range(G)], texts)
    rewards = torch.tensor(totals, dtype=torch.float32, device=seq.device)
    reward_parts = torch.tensor([[math.nan if r is None else r for r in fn_rewards] for fn_rewards in parts],
                                dtype=torch.float64).T
    score = rewards.clone()  # the weighted reward before the overlong penalty, reported as reward_mean
    lengths = mask.sum(-1)
    if cfg.overlong_buffer:
        rewards = rewards + sampling.overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    keep = torch.arange(len(rewards), device=seq.device)
    if cfg.pods_keep:  # the m rollouts per prompt with the largest reward variance
        keep = sampling.pods_select(rewards, cfg.pods_keep, group_ids)
    if cfg.dynamic_sampling:
        keep = keep[sampling.filter_uniform_groups(rewards[keep], group_ids[keep])]
    rows = dict(seq=seq, attn=attn, targets=targets, mask=mask, rewards=rewards, group_ids=group_ids,
                lengths=lengths, tree_ids=tree_ids, parts=reward_parts.to(seq.device))
    rows = {k: v[keep] if v is not None else None for k, v in rows.items()}
    return dict(rows, P=P, score=score, all_lengths=lengths, reward_parts=reward_parts)


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


# ----------------------------------------------------------------------------------------------
# Distributed helpers (torchrun; gloo on CPU, nccl on CUDA). Gradients are SUMMED over ranks, not averaged:
# the loss is already divided by the global token / row count (`num_items` / `num_seqs`).

def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_sum(x: float) -> float:
    if dist_info()[1] == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return float(t)


def _comm_device():
    """Where collective buffers live: NCCL reduces only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


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
        hid = hidden_states(_parts(self.policy)[0], mbatch["seq"], mbatch["attn"])[:, P - 1:-1]
        out = self.timer.loss_head(lambda x: loss_head(self.policy, x, mbatch, self.loss_cfg, num_items=num_items,
                                                       num_seqs=num_seqs, head_args=self.head_args, path=self.path),
                                   hid)
        values = self.critic(hid, mbatch["seq"], mbatch["attn"], P) if self.critic is not None else None
        return out.loss, out.metrics, values


def _summed(group, bucket):
    """DDP communication hook: gradients summed over ranks (DDP's own hook averages them, which would
    shrink every update by the world size, as the loss is already Σ_rank / N_global)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def update_engine(forward: UpdateForward, place, find_unused: bool, fsdp: bool = False):
    """`forward` as it runs the update: itself in one process, wrapped in DistributedDataParallel under
    torchrun, or with `fsdp` sharded by FSDP2 (in place; sharding.py). `find_unused`: some rank may train
    on an empty mini-batch (dynamic sampling keeps unequal numbers of groups per rank)."""
    if dist_info()[1] == 1:
        return forward
    if fsdp:
        return sharding.shard(forward, place.device)
    ids = [place.device.index] if place.device.type == "cuda" else None
    # no buffer broadcast per forward: the models' buffers (rotary tables) are constants
    ddp = nn.parallel.DistributedDataParallel(forward, device_ids=ids, forward_sync_buffers=False,
                                              find_unused_parameters=find_unused)
    ddp.register_comm_hook(None, _summed)
    return ddp


def minibatch_update(engine, optimizer, params, mbatch, P, cfg, place, *, num_items, num_seqs):
    """One optimizer step on a mini-batch (all ranks together); (this rank's metrics, skipped).
    A non-finite loss or gradient on any rank never reaches the weights: the step is skipped."""
    timer = getattr(engine, "module", engine).timer  # under DDP, the UpdateForward it wraps
    timer.begin_step(place.device)
    with place.autocast():
        loss, metrics, pred = engine(mbatch, P, num_items, num_seqs)
    m = {k: float(v) for k, v in metrics.items()}
    if pred is not None:
        vout = rlkernels.value_loss(pred, mbatch["values"], mbatch["returns"], mbatch["mask"],
                                    clip=cfg.vf_clip, num_items=num_items)
        loss = loss + cfg.vf_coef * vout.loss
        m["value_loss"] = float(vout.loss.detach())
        m["vf_clip_frac"] = float(vout.metrics["vf_clip_frac"])
    m["loss"] = float(loss.detach())
    bad = all_sum(0.0 if math.isfinite(m["loss"]) else 1.0) > 0
    optimizer.zero_grad(set_to_none=True)
    if not bad:
        loss.backward()  # under DDP: summed over ranks by the time it returns
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        bad = all_sum(0.0 if torch.isfinite(grad_norm) else 1.0) > 0
        m["grad_norm"] = float(grad_norm)
    if bad:
        optimizer.zero_grad(set_to_none=True)
        return m, True
    optimizer.step()
    m.update(timer.end_step())
    return m, False


def nan_mean_std(x: torch.Tensor) -> tuple:
    """(mean, unbiased std) over all ranks of the non-NaN entries of `x`; (None, None) when there are none,
    std 0 when there is one."""
    seen = x[~x.isnan()]
    n = all_sum(len(seen))
    if n == 0:
        return None, None
    mean = all_sum(seen.sum()) / n
    sq = all_sum(((seen - mean) ** 2).sum())  # two passes: no cancellation of Σx² − n·mean²
    return mean, math.sqrt(sq / (n - 1)) if n > 1 else 0.0


# metrics that are this rank's share of a global sum (Σ_rank / N_global): summed over ranks, not averaged
SUMMED_METRICS = ("loss", "value_loss")


# ----------------------------------------------------------------------------------------------
# Checkpoints: model(s), optimizer, RNG states, step; the config rides along

def save_checkpoint(path, state):
    """Write `path` atomically: a kill leaves the previous checkpoint or this one, never a torn file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint (else a crash can leave it empty)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # e.g. a full disk, which torch reports as "basic_ios::clear"
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ValueError(f"--out: cannot write {path} ({e})") from None


def write_file(path: str, text: str, mode: str) -> None:
    """Write or append `text`; a full disk (or a folder gone read-only) is a one-line error naming --out."""
    try:
        with open(path, mode) as f:
            f.write(text)
    except OSError as e:
        raise ValueError(f"--out: cannot write {path} ({e.strerror or e})") from None


def prepare_out_dir(out: str) -> None:
    """Create `out` and check that it takes files: now, not after warm-up and evaluation."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out!r} is a file, not a folder")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out: cannot write in {out!r} ({e.strerror or e})") from None
    stale = os.path.join(out, CHECKPOINT + ".tmp")
    if os.path.exists(stale):  # a checkpoint write cut short; the checkpoint beside it is the last whole one
        os.remove(stale)
        print(f"removed {stale}: a checkpoint write that did not finish")
    shutil.rmtree(os.path.join(out, export.TMP), ignore_errors=True)  # a model export cut short


def run_dir(resume: str) -> str:
    """The folder of the run that `--resume` (a run folder or its checkpoint file) points at."""
    return resume if os.path.isdir(resume) else os.path.dirname(resume) or "."


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def load_checkpoint(resume: str) -> dict:
    path = os.path.join(resume, CHECKPOINT) if os.path.isdir(resume) else resume
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no {CHECKPOINT} in {resume!r}")
    try:
        # tensors and plain Python values only (all a trainer checkpoint holds): a crafted file runs no code
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated, foreign or crafted file: say which flag pointed at it
        msg = str(e)
        name = re.search(r"GLOBAL (\S+)", msg)
        if isinstance(e, pickle.UnpicklingError) and name:
            raise ValueError(f"--resume: refusing {path!r}: it asks for {name.group(1)}, and a checkpoint of "
                             f"rlkernels.train holds only tensors and plain values (nothing in it was run)") from None
        reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", msg)
        raise ValueError(f"--resume: cannot read checkpoint {path!r} "
                         f"({type(e).__name__}: {reason.group(1) if reason else _one_line(e)})") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(saved, dict) or k not in saved]
    if missing or not isinstance(saved["config"], dict):
        raise ValueError(f"--resume: {path!r} is not a checkpoint of rlkernels.train "
                         f"(no {', '.join(missing or ['config'])})")
    return saved


def merge_resume(cfg: Config, saved: dict, explicit: Optional[set] = None) -> Config:
    """The checkpoint's config, with the fields set explicitly (by default: those that differ
    from the defaults) taken from `cfg`. `resume` always comes from `cfg`, and `out` unless
    given is the run's own folder."""
    default = Config()
    # checkpoints from before --dtype ran in float32; older names (--prompts) are today's
    saved = {"dtype": "float32", **{trl_names.RENAMED.get(k, k): v for k, v in saved.items()}}
    if explicit is None:
        explicit = {f for f in saved if getattr(cfg, f, None) != getattr(default, f, None)}
    for f in RESUME_FIXED:
        if f in explicit and f in saved and getattr(cfg, f) != saved[f]:
            raise ValueError(f"{_flag(f)}: the run in {cfg.resume!r} has {saved[f]!r} and a resumed run keeps it "
                             f"(start a new run to change it), got {getattr(cfg, f)!r}")
    merged = {**saved, **{f: getattr(cfg, f) for f in explicit if f in saved}}
    merged.update({f: getattr(cfg, f) for f in RESUME_FRESH})
    merged["out"] = cfg.out or run_dir(cfg.resume)
    out = Config(**{k: v for k, v in merged.items() if k in Config.__dataclass_fields__})
    validate(out)
    return out


# ----------------------------------------------------------------------------------------------

def loss_config(cfg: Config, group_size: int):
    """The preset of `--algo` with the trainer's overrides. PPO's KL goes into the reward (docs/math.md §6), so
    its loss config carries none; the GRPO family's KL is in the loss (k3 unless the preset says). Dr. GRPO's
    constant (`agg="constant"`) is the maximum completion length, `--max-new-tokens`."""
    constant = presets.fields(cfg.algo).get("agg") == "constant"
    base = presets.get(cfg.algo, **({"norm_length": cfg.max_new_tokens} if constant else {}))
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


def lr_factor(cfg: Config, step: int) -> float:
    """The learning rate of RL step `step` (from 1) as a fraction of --lr: a linear ramp over --lr-warmup-steps,
    then --lr-scheduler-type: constant, or a linear or cosine decay towards 0 after the last step (as transformers'
    schedules, whose step s counts from 0)."""
    if step < cfg.lr_warmup_steps:
        return step / cfg.lr_warmup_steps
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    progress = max(0, step - 1 - cfg.lr_warmup_steps) / max(1, cfg.steps - cfg.lr_warmup_steps)
    return 1.0 - progress if cfg.lr_scheduler_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


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
    with stop_lib.StopRequest(print if dist_info()[0] == 0 else lambda *a, **k: None) as stop:
        return _train(config, reward_fn, explicit, stop)


def _train(config: Config, reward_fn, explicit: Optional[set], stop) -> dict:
    t_start = time.time()
    validate(config)
    saved = load_checkpoint(config.resume) if config.resume else None
    cfg = merge_resume(config, saved["config"], explicit) if saved else config
    reward_fns, reward_weights = rewards_lib.reward_functions(cfg, reward_fn)  # a wrong count of weights: now
    rank, world = dist_info()
    master = rank == 0
    if cfg.fsdp and world == 1:
        raise ValueError("--fsdp: shards the models over the processes of torchrun (torchrun --nproc-per-node N "
                         "-m rlkernels.train ... --fsdp), and this is one process; drop --fsdp (or --fsdp false)")
    # The demo model is so small that one thread per process is fastest (more threads spin on
    # tiny matmuls, badly so on a shared machine); real models get up to 4 per process.
    torch.set_num_threads(cfg.threads or (1 if not cfg.model else max(1, min(4, os.cpu_count() or 1) // world)))
    out_dir = cfg.out or time.strftime("runs/%Y%m%d-%H%M%S")
    cfg = dataclasses.replace(cfg, out=out_dir)
    log = print if master else (lambda *a, **k: None)
    place = device.placement(cfg.device, cfg.dtype, world)
    runs_on = place.describe()
    if master:
        prepare_out_dir(out_dir)
    layout = ("one process" if world == 1 else
              f"{'FSDP2' if cfg.fsdp else 'DDP'} over {world} processes ({runs_on['backend']})")
    log(f"rlkernels.train: {'resuming ' + cfg.resume + ' with ' if saved else ''}{describe(cfg)}\n"
        f"  {layout} on {runs_on['device']}, compute dtype {runs_on['dtype']} (float32 weights); writing {out_dir}/")

    # the task (its file's errors) before any model loads; its own seeded shuffle draws no global random numbers
    if cfg.dataset:
        train_set, eval_set, held_out = data.load(cfg)
    else:
        train_set, eval_set = task.addition_task(cfg.digits, cfg.eval_size, cfg.seed)
        held_out = f"{len(eval_set)} held-out sums"
    answers = "answer" in train_set[0] and "answer" in eval_set[0]
    for _, name, _, spec in reward_fns:
        if name in ("exact", "regex") and spec.startswith(name) and not answers:
            raise ValueError(f"--reward {spec}: compares completions with the answer column, which the prompts of "
                             f"{cfg.dataset} lack; give --reward a function, or --reward-model")
    # before the seeds: a reward model whose head is initialised on loading leaves the policy's weights as they were
    reward_fn = rewards_lib.build(reward_fns, reward_weights, cfg.reward_model, place)

    # ---- seeds: model init and data order are identical on every rank; sampling differs per rank
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)  # prompt order, mini-batch order, tree cut depths

    # ---- tokenizer, policy
    if cfg.model:
        policy, tok = task.load_model(cfg.model)
    else:
        tok = task.CharTokenizer()
        for ex in train_set[:1] + eval_set[:1]:
            tok.encode(ex["prompt"])  # a clear error for characters outside the demo vocabulary
        prompt_len = max(len(tok.encode(ex["prompt"])) for ex in train_set + eval_set)
    source = f" in {cfg.dataset}" if cfg.dataset else ""
    if cfg.prompts_per_step * world > len(train_set):
        ranks = f" × {world} ranks" if world > 1 else ""
        raise ValueError(f"--prompts-per-step: {cfg.prompts_per_step}{ranks} is more than the {len(train_set)} "
                         f"training prompts{source} (after {len(eval_set)} held out for eval)")
    warmup = not saved and not cfg.model and cfg.warmup_steps
    if warmup:
        stop.until = "the warm-up and the evaluation before RL"
    if warmup and not answers:
        raise ValueError(f"--warmup-steps: the demo's supervised warm-up trains on the answer column, which --dataset "
                         f"{cfg.dataset} lacks; give --warmup-steps 0")
    if warmup and cfg.warmup_batch > len(train_set):
        raise ValueError(f"--warmup-batch: {cfg.warmup_batch} is more than the {len(train_set)} training "
                         f"prompts{source} (after {len(eval_set)} held out for eval)")
    if not cfg.model:
        policy = task.tiny_model(cfg, tok, prompt_len)
    policy.to(place.device)  # built on the CPU, so a seed gives the same weights on every device
    head_args = output_head_of(policy, cfg.temperature, place)
    if cfg.gradient_checkpointing:
        enable_checkpointing(policy)
    policy.generation_config.top_k = None  # pure temperature sampling (see `generate`)
    n_params = sum(p.numel() for p in policy.parameters())
    log(f"policy: {type(policy).__name__}, {n_params / 1e6:.2f}M parameters; {len(train_set)} training prompts, "
        f"{held_out}")

    # ---- supervised warm-up (demo model only; a resumed run loads the weights instead)
    eval_before = saved["eval_reward_before"] if saved else None
    if warmup:
        policy.train()
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.warmup_lr, weight_decay=0.0, betas=(0.9, 0.98))
        in_a_row, reached = 0, None  # checks at or above the target in a row: one alone can be a fluctuation
        bar = tqdm(total=cfg.warmup_steps, desc="warm-up", disable=not (cfg.progress and master), dynamic_ncols=True)
        for it in range(1, cfg.warmup_steps + 1):
            sup = task.supervised_batch(tok, rng.sample(train_set, cfg.warmup_batch))
            ids, attn, labels = (t.to(place.device) for t in sup)
            with place.autocast():
                loss = policy(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            bar.update(1)
            if cfg.warmup_target is not None and it % cfg.warmup_eval_every == 0 and it < cfg.warmup_steps:
                reached = evaluate(policy, tok, eval_set, reward_fn, cfg, place)[0]
                bar.set_postfix(eval=f"{reached:.3f}", target=cfg.warmup_target)
                in_a_row = in_a_row + 1 if reached >= cfg.warmup_target else 0
                if in_a_row == 2:
                    break
        bar.close()
        why = "the target twice in a row" if in_a_row == 2 else "--warmup-steps"
        last_check = f", held-out greedy reward {reached:.3f} at the last check" if reached is not None else ""
        log(f"warm-up: {it} supervised steps (stopped at {why}){last_check}, final loss {loss.item():.3f}")

    # ---- reference model: the policy as RL starts, frozen. Needed for any KL term.
    algo_ppo = cfg.algo == "ppo"
    G = cfg.num_generations
    loss_cfg = loss_config(cfg, cfg.pods_keep or G)
    beta = (0.05 if cfg.kl_coef is None else cfg.kl_coef) if algo_ppo else loss_cfg.kl_coef  # PPO: β in the reward
    ref = None
    if beta > 0:
        if saved and saved["ref"] is None and not cfg.model:  # the demo's reference lives only in checkpoints
            raise ValueError(f"--kl-coef: the run in {cfg.resume!r} trained without a KL term, so its checkpoint "
                             f"has no reference model; resume it with --kl-coef 0")
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        if saved and saved["ref"] is not None:
            try:
                ref.load_state_dict(saved["ref"])
            except RuntimeError as e:
                raise ValueError(f"--resume: the checkpoint in {cfg.resume!r} does not fit this run "
                                 f"({type(e).__name__}: {_one_line(e)})") from None
    if cfg.lora_rank:
        policy = task.add_lora(policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target).to(place.device)
    trunk, _ = _parts(policy)
    critic = Critic(trunk, policy.config.hidden_size, cfg.critic == "separate").to(place.device) if algo_ppo else None
    # under FSDP the export writes a plain copy of the policy, taken here (sharded modules cannot be copied)
    meta_policy = sharding.meta_copy(policy) if cfg.fsdp and world > 1 and master else None
    # the engine before the optimizer: under FSDP it shards the parameters the optimizer and a checkpoint load into
    engine = update_engine(UpdateForward(policy, critic, loss_cfg, head_args, cfg.loss_path), place,
                           find_unused=cfg.dynamic_sampling, fsdp=cfg.fsdp)
    if ref is not None and sharding.is_sharded(policy):
        sharding.shard(ref, place.device)  # else every rank holds a whole copy of it
    params = [p for p in engine.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    start = 0
    if saved:
        try:
            sharding.load_state_dict(policy, saved["model"])
            if critic is not None:
                sharding.load_state_dict(critic, saved["critic"])
            sharding.load_optimizer_state_dict(engine, optimizer, saved["optimizer"])
            start, beta = saved["step"], saved["kl_coef"]
            rng.setstate(saved["rng"]["python"])
            random.setstate(saved["rng"]["python_global"])
            cuda_rngs = saved["rng"].get("cuda")  # absent from checkpoints of CPU runs
            device.set_rng_state(saved["rng"]["torch"][rank], cuda_rngs[rank] if cuda_rngs else None, place.device)
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"--resume: the checkpoint in {cfg.resume!r} does not fit this run "
                             f"({type(e).__name__}: {_one_line(e)})") from None
        log(f"resumed at step {start} from {cfg.resume}")
    else:
        torch.manual_seed(cfg.seed * 1000 + rank + 1)  # per-rank sampling streams (CPU and CUDA generators)
    def evaluate_policy():
        """`evaluate` of the policy on the held-out set (under FSDP, as a forward of the root)."""
        return sharding.gathered(engine, evaluate, policy, tok, eval_set, reward_fn, cfg, place)

    before_samples = []  # a resumed run's are in its completions.jsonl
    if eval_before is None:
        eval_before, before_samples = evaluate_policy()
    log(f"held-out greedy reward ({reward_fn.label}) before RL: {eval_before:.3f}; loss {_loss_text(cfg.algo, loss_cfg)}")

    # a resumed run keeps the metrics up to its checkpoint, read from the run's folder (also when --out moves it)
    metrics_path, completions_path = os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "completions.jsonl")
    history = []
    if master:
        if saved:
            history = report.truncate_metrics(os.path.join(run_dir(cfg.resume), "metrics.jsonl"), metrics_path, start)
            report.truncate_metrics(os.path.join(run_dir(cfg.resume), "completions.jsonl"), completions_path, start)
        else:
            write_file(metrics_path, "", "w")
            write_file(completions_path, "", "w")

    def checkpoint(step):
        rngs = [device.rng_state(place.device)]
        if world > 1:
            rngs = [None] * world
            dist.all_gather_object(rngs, device.rng_state(place.device))
        cpu_rngs, cuda_rngs = zip(*rngs)
        # whole tensors (under FSDP gathered onto rank 0: every rank takes part)
        model_state, optimizer_state = sharding.full_state_dict(policy), sharding.optimizer_state_dict(engine, optimizer)
        critic_state = sharding.full_state_dict(critic) if critic is not None else None
        ref_state = sharding.full_state_dict(ref) if ref is not None and not cfg.model else None
        if master:
            save_checkpoint(os.path.join(out_dir, CHECKPOINT), {
                "config": dataclasses.asdict(cfg), "step": step, "kl_coef": beta,
                "model": model_state, "critic": critic_state, "ref": ref_state,
                "optimizer": optimizer_state, "eval_reward_before": eval_before,
                "rng": {"torch": list(cpu_rngs), "cuda": list(cuda_rngs) if cuda_rngs[0] is not None else None,
                        "python": rng.getstate(), "python_global": random.getstate()},
            })
            plain = policy if meta_policy is None else sharding.with_weights(meta_policy, model_state)
            with run_folder.writing(out_dir):
                export.save_pretrained(plain, tok, out_dir, merge_lora=cfg.merge_lora)

    tracking = trackers.Trackers(cfg.report_to if master else [], out_dir, cfg, start + 1)

    def log_completions(step, samples):
        """One eval's sample completions: completions.jsonl, and --report-to's backends."""
        rows = [{"step": step, **s} for s in samples]
        if master and rows:
            write_file(completions_path, "".join(report.dumps(r) + "\n" for r in rows), "a")
            tracking.completions(step, rows)

    log_completions(0, before_samples)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (cfg.progress and master),
               dynamic_ncols=True, desc=cfg.algo)
    # a resumed run's summary counts the steps before its checkpoint too
    skipped_total, last = sum(r.get("skipped", 0) for r in history), (history[-1] if history else {})
    policy.train()
    stop.until = "this step"
    stopping = all_sum(float(stop.requested)) > 0  # a signal before RL: a checkpoint where RL starts
    try:
        if stopping:
            checkpoint(start)
            log(f"stopped before step {start + 1}; continue with: python -m rlkernels.train --resume {out_dir}")
        for step in range(start + 1, cfg.steps + 1):
            if stopping:
                break
            t0 = time.time()
            # ==== 1. rollout and 2. reward: this rank's share of the step's prompts ==========
            # Dynamic sampling (DAPO) drops the groups whose rewards are all equal, then samples more
            # prompts while some rank has fewer than prompts_per_step groups, up to max_gen_batches
            # rollouts; the decision is global, so the ranks stay in step.
            policy.eval()
            parts = []
            while True:
                chosen = rng.sample(train_set, cfg.prompts_per_step * world)
                prompts = chosen[rank * cfg.prompts_per_step:(rank + 1) * cfg.prompts_per_step]
                first_group = (len(parts) * world + rank) * cfg.prompts_per_step
                parts.append(sharding.gathered(engine, sample_groups, policy, tok, prompts, cfg, rng, reward_fn,
                                               first_group, place))
                if not cfg.dynamic_sampling or len(parts) == cfg.max_gen_batches:
                    break
                n_kept = len(set(torch.cat([p["group_ids"] for p in parts]).tolist()))
                if all_sum(float(n_kept < cfg.prompts_per_step)) == 0:
                    break
            b = concat_rows(parts, tok.pad_id)
            P, score, all_lengths, reward_parts = b["P"], b["score"], b["all_lengths"], b["reward_parts"]
            train_rows = torch.arange(len(b["rewards"]), device=b["rewards"].device)
            if cfg.dynamic_sampling:  # the first prompts_per_step groups kept; none when a rank has none
                first_groups = b["group_ids"].unique()[:cfg.prompts_per_step]
                train_rows = train_rows[torch.isin(b["group_ids"], first_groups)]
                if all_sum(float(len(train_rows) == 0)) > 0:
                    train_rows = train_rows[:0]
                    if master:
                        bar.write(f"step {step}: no group with unequal rewards{' on some rank' if world > 1 else ''} "
                                  f"in {len(parts)} rollout batches (--dynamic-sampling); update skipped")
            seq, attn, targets, mask, rewards, group_ids, lengths, fn_rewards = (b[k][train_rows] for k in (
                "seq", "attn", "targets", "mask", "rewards", "group_ids", "lengths", "parts"))
            tree_ids = b["tree_ids"][train_rows] if b["tree_ids"] is not None else None

            # ==== 3. behaviour log-probs ℓ_old: a forward pass at the sampling temperature ====
            # (not generate's scores: the same forward as the update, so the first ratio is 1 up
            # to rounding; test_trainer checks it equals generate's own τ-softmax of the logits.)
            with place.autocast():
                old_logp, h = sharding.gathered(engine, token_logp, policy, seq, attn, P, head_args)
                ref_logp = sharding.gathered(ref, token_logp, ref, seq, attn, P, head_args)[0] if ref is not None else None

            # ==== 4. advantages ===============================================================
            if algo_ppo:
                # PPO: per-token reward = −β·k1(π_old ‖ π_ref) at every token, + R at the last
                # token; GAE(γ, λ) on the critic's values; returns are the value targets.
                with torch.no_grad(), place.autocast():
                    values = sharding.gathered(engine, critic, h, seq, attn, P)
                kl_tok = (old_logp - ref_logp) if ref is not None else torch.zeros_like(old_logp)
                tok_reward = -beta * kl_tok * mask
                last_tok = (lengths - 1).clamp(min=0)
                tok_reward[torch.arange(len(rewards), device=rewards.device), last_tok] += rewards * (lengths > 0)
                advantages, returns = adv_lib.gae(tok_reward, values, mask, cfg.gamma, cfg.lam)
            elif cfg.tree:
                # Tree-GRPO: the prompt-level plus the tree-level normalised reward
                advantages = adv_lib.tree_grpo(rewards, group_ids, tree_ids)
            elif loss_cfg.ratio == "snis":
                advantages = None  # SNIS takes the rewards and builds its own baseline
            elif cfg.multi_objective_aggregation == "normalize_then_sum":
                # GDPO: each reward normalised in its group, their weighted sum over the batch. DAPO's overlong
                # penalty is one more reward of weight 1 here (in TRL it is a reward function)
                weights = reward_fn.weights
                if cfg.overlong_buffer:
                    penalty = sampling.overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
                    fn_rewards = torch.cat([fn_rewards, penalty[:, None].to(fn_rewards.dtype)], 1)
                    weights = weights + [1.0]
                advantages = rewards_lib.normalize_then_sum(fn_rewards, weights, group_ids, nan_mean_std).float()
            else:
                # GRPO family: each reward against its prompt group, divided by the group's std, the batch's or
                # nothing (Dr. GRPO's default); the batch's is over every rank's rewards, as TRL's over its processes
                scale = cfg.scale_rewards or ("none" if cfg.algo == "dr_grpo" else "group")
                std = nan_mean_std(rewards.double())[1] if scale == "batch" else None
                advantages = adv_lib.group_normalized(rewards, group_ids, scale="group" if scale == "group" else None
                                                      ) if len(rewards) else rewards
                if std is not None:
                    advantages = advantages / (std + 1e-6)  # group_normalized's ε
            batch = dict(seq=seq, attn=attn, targets=targets, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                         group_ids=group_ids, rewards=rewards, advantages=advantages,
                         values=values if algo_ppo else None, returns=returns if algo_ppo else None)

            # ==== 5. update: μ epochs over mini-batches of whole prompt groups ================
            # (the learning rate ramps up linearly over the first `lr_warmup_steps` steps: a fresh
            # AdamW state after the supervised warm-up otherwise takes too large first steps)
            for g in optimizer.param_groups:
                g["lr"] = cfg.lr * lr_factor(cfg, step)
            policy.train()
            groups = sorted(set(group_ids.tolist()))
            n_groups_global = int(all_sum(len(groups)))
            collected, skipped, n_updates = [], 0, 0
            for epoch in range(cfg.epochs):
                order = groups[:]
                rng.shuffle(order)
                per = max(1, math.ceil(len(order) / cfg.minibatches)) if order else 1
                for mb in range(cfg.minibatches):
                    gsel = torch.tensor(order[mb * per:(mb + 1) * per], dtype=group_ids.dtype, device=group_ids.device)
                    rows = torch.isin(group_ids, gsel).nonzero().squeeze(-1)
                    mbatch = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
                    # global normalisers: the loss is Σ_local / N_global, so summed gradients are exact
                    num_items = all_sum(mbatch["mask"].sum())
                    num_seqs = all_sum((mbatch["mask"].sum(-1) > 0).sum())
                    if num_items == 0:
                        continue
                    m, bad = minibatch_update(engine, optimizer, params, mbatch, P, cfg, place,
                                              num_items=num_items, num_seqs=num_seqs)
                    if bad:
                        skipped += 1
                        bar.write(f"step {step}: non-finite loss/gradient ({m['loss']}); update skipped")
                        continue
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
                   "response_len": all_sum(all_lengths.float().sum()) / max(all_sum(len(all_lengths)), 1),
                   "rows_trained": int(all_sum(len(rewards))), "groups": n_groups_global,
                   "updates": n_updates, "skipped": skipped, "kl_coef": beta, "rollout_kl": kl_obs}
            if cfg.dynamic_sampling:
                row["gen_batches"] = len(parts)
            for j, name in enumerate(reward_fn.names):  # over the rows each function scored (TRL's nanmean, nanstd)
                row[f"rewards/{name}/mean"], row[f"rewards/{name}/std"] = nan_mean_std(reward_parts[:, j])
            keys = sorted({k for m in collected for k in m})
            for k in keys:
                mean = sum(m[k] for m in collected if k in m) / len(collected)
                row[k] = all_sum(mean) / (1 if k in SUMMED_METRICS else world)
            for k in ("loss", "kl", "entropy", "clip_frac"):
                row.setdefault(k, None)
            if "time/update_s" in row:  # the ratio of the means over optimizer steps (and ranks)
                row["time/loss_head_share"] = row["time/loss_head_s"] / row["time/update_s"]
            samples = []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                row["eval_reward"], samples = evaluate_policy()
            row["time_s"] = round(time.time() - t0, 4)  # wall-clock fields differ between identical runs
            row["tokens_per_s"] = round(all_sum(all_lengths.sum()) / row["time_s"], 1)
            last = row
            stopping = all_sum(float(stop.requested)) > 0  # a signal that reached only some ranks stops them all
            logged = step % cfg.logging_steps == 0 or "eval_reward" in row or step == cfg.steps or stopping
            if master and logged:
                write_file(metrics_path, report.dumps(row) + "\n", "a")
                tracking.metrics(row)
            log_completions(step, samples)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl'] or 0:.4f}",
                            ent=f"{row['entropy'] or 0:.3f}",
                            **({"eval": f"{row['eval_reward']:.3f}"} if "eval_reward" in row else {}))
            if step % cfg.ckpt_every == 0 or step == cfg.steps or stopping:
                checkpoint(step)
            if stopping:
                log(f"stopped at step {step}; continue with: python -m rlkernels.train --resume {out_dir}")
                break
    finally:
        bar.close()
        tracking.close()

    # ---- summary: eval after RL, table, plot, files
    done = last.get("step", start)
    eval_after = last.get("eval_reward") if last.get("eval_reward") is not None else evaluate_policy()[0]
    summary = {"algo": cfg.algo, "steps": done, "eval_reward_before": eval_before, "eval_reward_after": eval_after,
               "final_reward_mean": last.get("reward_mean"), "final_kl": last.get("kl"),
               "final_entropy": last.get("entropy"), "skipped_steps": skipped_total,
               "wall_time_s": round(time.time() - t_start, 1), **runs_on, "out": out_dir,
               "config": dataclasses.asdict(cfg)}
    if master:
        write_file(os.path.join(out_dir, "summary.json"), report.dumps(summary, indent=2), "w")
        with run_folder.writing(out_dir):
            plotted = report.plot(report.read_metrics(metrics_path), os.path.join(out_dir, "metrics.png"),
                                  f"rlkernels.train --algo {cfg.algo}", reward_fn.label, eval_before)
        log(report.summary_table(summary))
        log(f"files in {out_dir}/: metrics.jsonl, completions.jsonl, summary.json, {CHECKPOINT}, the model and its "
            f"tokenizer (from_pretrained)" + "".join(f", {name} logs" for name in cfg.report_to if name != "none")
            + (", metrics.png" if plotted else " (no plot: matplotlib is not installed)"))
    return summary
