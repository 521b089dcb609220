"""A run's set-up, in the order train() calls it: the config (merged over the checkpoint's on --resume), the task
and reward, the policy, the demo's supervised warm-up, the update's models and optimizer (with a resumed run's
weights and optimizer state; its step and random states are checkpoint.restore's, the logs loop._train's)."""
from __future__ import annotations

import copy
import dataclasses
import os
import random
import time
from typing import Optional

import torch
from tqdm.auto import tqdm

from . import config_parts, data, device, generation, rewards as rewards_lib, sharding, task
from .checkpoint import load_checkpoint, unfit
from .run_config import Config, describe, merge_resume, run_dir
from .distributed import dist_info
from .model import Critic, add_lora, enable_checkpointing, output_head_of, parts
from .run_folder import prepare_out_dir
from .state import Run
from .update import UpdateForward


def configure(config: Config, explicit: Optional[set], reward_fn, stop):
    """The run's config (merged over the checkpoint's on --resume), processes, device and folder; (Run, the
    reward functions). `config` has passed `validate` (train() or from_args); merge_resume validates the merge."""
    t_start = time.time()
    saved = load_checkpoint(config.resume) if config.resume else None
    cfg = merge_resume(config, saved["config"], explicit) if saved else config
    rank, world = dist_info()
    reward_fns = rewards_lib.reward_functions(cfg.reward, cfg.reward_model, cfg.reward_weights, reward_fn)  # a wrong count of weights: now
    if cfg.fsdp and world == 1:
        raise ValueError("--fsdp: shards the models over the processes of torchrun (torchrun --nproc-per-node N "
                         "-m rlkernels.train ... --fsdp), and this is one process; drop --fsdp (or --fsdp false)")
    # The demo model is so small that one thread per process is fastest (more threads spin on
    # tiny matmuls, badly so on a shared machine); real models get up to 4 per process.
    torch.set_num_threads(cfg.threads or (1 if not cfg.model else max(1, min(4, os.cpu_count() or 1) // world)))
    cfg = dataclasses.replace(cfg, out=cfg.out or time.strftime("runs/%Y%m%d-%H%M%S"))
    run = Run(cfg, device.placement(cfg.device, cfg.dtype, world), rank, world, stop, saved, t_start)
    config_parts.attach(run, cfg)
    runs_on = run.place.describe()
    if run.master:
        resuming = saved is not None and os.path.realpath(cfg.out) == os.path.realpath(run_dir(config.resume))
        run.folder = prepare_out_dir(cfg.out, resuming, cfg.overwrite)
    layout = ("one process" if world == 1 else
              f"{'FSDP2' if cfg.fsdp else 'DDP'} over {world} processes ({runs_on['backend']})")
    run.log(f"rlkernels.train: {'resuming ' + cfg.resume + ' with ' if saved else ''}{describe(cfg)}\n"
            f"  {layout} on {runs_on['device']}, compute dtype {runs_on['dtype']} (float32 weights); "
            f"writing {cfg.out}/")
    return run, reward_fns


def load_task(run: Run, reward_fns) -> None:
    """The prompts and the reward, before any model loads (so their errors come first), then the seeds.
    The task's own seeded shuffle draws no global random numbers."""
    cfg, source = run.cfg, run.data
    if source.dataset:
        run.train_set, run.eval_set, run.held_out = data.load(source)
    else:
        run.train_set, run.eval_set = task.addition_task(cfg.digits, source.eval_size, source.seed)
        run.held_out = f"{len(run.eval_set)} held-out sums"
    schedule, said = config_parts.schedule(cfg, len(run.train_set), run.sampling.prompts_per_step * run.world)
    if schedule:
        config_parts.attach(run, dataclasses.replace(cfg, **schedule))
        run.log(said)
    fns, weights = reward_fns
    columns = [k for k in run.train_set[0] if k != "prompt"]
    for f, _, flag, what in fns:  # a reward that cannot be called as it will be: now, not after the model loads
        rewards_lib.check_signature(f, what, columns, flag)
    run.reward_context = rewards_lib.RewardContext(run.logs.steps)
    for _, name, _, spec in fns:
        if name in ("exact", "regex") and spec.startswith(name) and not run.has_answers:
            raise ValueError(f"--reward {spec}: compares completions with the answer column, which the prompts of "
                             f"{source.dataset} lack; give --reward a function, or --reward-model")
    # before the seeds: a reward model whose head is initialised on loading leaves the policy's weights as they were
    run.reward_fn = rewards_lib.build(fns, weights, cfg.reward_model, run.place)
    # model init and data order are identical on every rank; sampling differs per rank (`restore`)
    random.seed(source.seed)
    torch.manual_seed(source.seed)
    run.rng = random.Random(source.seed)


def warms_up(run: Run) -> bool:
    """Whether the demo's supervised warm-up runs (a resumed run loads the weights instead)."""
    return bool(not run.saved and not run.cfg.model and run.warmup.warmup_steps)


def load_policy(run: Run) -> None:
    """The tokenizer and the policy, on the run's device, its output head checked; the checks of the prompts'
    count come first, before a model loads."""
    cfg, source = run.cfg, f" in {run.data.dataset}" if run.data.dataset else ""
    per_step = run.sampling.prompts_per_step
    if not cfg.model:  # a clear error for characters outside the demo vocabulary, first
        run.tok = task.CharTokenizer()
        prompt_len = max(len(run.tok.encode(ex["prompt"])) for ex in run.train_set + run.eval_set)
    if per_step * run.world > len(run.train_set):
        ranks = f" × {run.world} ranks" if run.world > 1 else ""
        raise ValueError(f"--prompts-per-step: {per_step}{ranks} is more than the {len(run.train_set)} "
                         f"training prompts{source} (after {len(run.eval_set)} held out for eval)")
    if warms_up(run):
        run.stop.until = "the warm-up and the evaluation before RL"
        if not run.has_answers:
            raise ValueError(f"--warmup-steps: the demo's supervised warm-up trains on the answer column, which "
                             f"--dataset {run.data.dataset} lacks; give --warmup-steps 0")
        if run.warmup.warmup_target is not None and not run.eval_set:
            raise ValueError("--eval-size 0: the demo's warm-up stops at --warmup-target, measured on held-out prompts; "
                             "give --warmup-target none or an --eval-size")
        if run.warmup.warmup_batch > len(run.train_set):
            raise ValueError(f"--warmup-batch: {run.warmup.warmup_batch} is more than the {len(run.train_set)} training "
                             f"prompts{source} (after {len(run.eval_set)} held out for eval)")
    if cfg.model:
        run.policy, run.tok = task.load_model(cfg.model, cfg.attn_implementation, cfg.chat_template)
        cut = task.check_prompt_lengths(run.tok, run.train_set + run.eval_set, cfg.max_prompt_length,
                                        run.sampling.max_new_tokens, run.policy.config)
        if cut:
            run.log(cut)
    else:
        run.policy = task.tiny_model(run.tok, prompt_len, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                                     max_new_tokens=run.sampling.max_new_tokens)
    run.policy.to(run.place.device)  # built on the CPU, so a seed gives the same weights on every device
    run.head_args = output_head_of(run.policy, run.sampling.temperature, run.place)
    if cfg.gradient_checkpointing:
        enable_checkpointing(run.policy)
    run.policy.generation_config.top_k = None  # pure temperature sampling (see `generate`)
    n_params = sum(p.numel() for p in run.policy.parameters())
    run.log(f"policy: {type(run.policy).__name__}, {n_params / 1e6:.2f}M parameters; {len(run.train_set)} training "
            f"prompts, {run.held_out}")


def warm_up(run: Run) -> None:
    """The demo model's supervised warm-up, until the held-out reward reaches --warmup-target twice in a row."""
    w, policy, place = run.warmup, run.policy, run.place
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=w.warmup_lr, weight_decay=0.0, betas=(0.9, 0.98))
    in_a_row, reached = 0, None  # checks at or above the target in a row: one alone can be a fluctuation
    bar = tqdm(total=w.warmup_steps, desc="warm-up", disable=not (w.progress and run.master), dynamic_ncols=True)
    for it in range(1, w.warmup_steps + 1):
        sup = task.supervised_batch(run.tok, run.rng.sample(run.train_set, w.warmup_batch))
        ids, attn, labels = (t.to(place.device) for t in sup)
        with place.autocast():
            loss = policy(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        bar.update(1)
        if w.warmup_target is not None and it % w.warmup_eval_every == 0 and it < w.warmup_steps:
            reached = generation.evaluate(policy, run.tok, run.eval_set, run.reward_fn, run.sampling, place,
                                          context=run.reward_context)[0]
            run.reward_context.log.take_metrics()  # the warm-up's checks are not RL step 1's
            bar.set_postfix(eval=f"{reached:.3f}", target=w.warmup_target)
            in_a_row = in_a_row + 1 if reached >= w.warmup_target else 0
            if in_a_row == 2:
                break
    bar.close()
    why = "the target twice in a row" if in_a_row == 2 else "--warmup-steps"
    last_check = f", held-out greedy reward {reached:.3f} at the last check" if reached is not None else ""
    run.log(f"warm-up: {it} supervised steps (stopped at {why}){last_check}, final loss {loss.item():.3f}")


def build_update(run: Run) -> None:
    """The frozen reference (the policy as RL starts: any KL term needs it), LoRA, PPO's critic, the update engine
    (DDP / FSDP) and the optimizer; on --resume, with the weights and optimizer state of the checkpoint."""
    cfg, saved, place = run.cfg, run.saved, run.place
    algo_ppo = cfg.algo == "ppo"
    # PPO: β in the reward
    run.beta = (0.05 if cfg.kl_coef is None else cfg.kl_coef) if algo_ppo else run.loss_cfg.kl_coef
    if run.beta > 0:
        if saved and saved["ref"] is None and not cfg.model:  # the demo's reference lives only in checkpoints
            raise ValueError(f"--kl-coef: the run in {cfg.resume!r} trained without a KL term, so its checkpoint "
                             f"has no reference model; resume it with --kl-coef 0")
        run.ref = copy.deepcopy(run.policy).eval().requires_grad_(False)
    if cfg.lora_rank:
        run.policy = add_lora(run.policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target,
                                   lora_dropout=cfg.lora_dropout, target_parameters=cfg.lora_target_parameters,
                                   modules_to_save=cfg.lora_modules_to_save, use_rslora=cfg.use_rslora,
                                   use_dora=cfg.use_dora).to(place.device)
    if algo_ppo:
        trunk = parts(run.policy)[0]
        run.critic = Critic(trunk, run.policy.config.hidden_size, cfg.critic == "separate").to(place.device)
    # under FSDP the export writes a plain copy of the policy, taken here (sharded modules cannot be copied)
    forward = UpdateForward(run.policy, run.critic, run.loss_cfg, run.head_args, cfg.loss_path)
    run.meta_policy = sharding.meta_copy(run.policy) if cfg.fsdp and run.master else None
    # the engine before the optimizer: under FSDP it shards the parameters the optimizer and a checkpoint load into
    run.engine = sharding.update_engine(forward, place, find_unused=run.sampling.dynamic_sampling, fsdp=cfg.fsdp)
    if run.ref is not None and sharding.is_sharded(run.policy):
        sharding.shard(run.ref, place.device)  # else every rank holds a whole copy of it
    run.params = [p for p in run.engine.parameters() if p.requires_grad]
    # fused: the same update as the foreach default without its temporaries of every parameter's size (at V = 152k
    # the peak of a step falls by 141 MB, benchmarks/RESULTS.md)
    run.optimizer = torch.optim.AdamW(run.params, lr=run.optim.lr, weight_decay=cfg.weight_decay,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True)
    if saved:  # into the engine's layout: sharded under FSDP
        try:
            sharding.load_state_dict(run.policy, saved["model"])
            if run.critic is not None:
                sharding.load_state_dict(run.critic, saved["critic"])
            if run.ref is not None and saved["ref"] is not None:  # the demo's (a --model's is the model itself)
                sharding.load_state_dict(run.ref, saved["ref"])
            sharding.load_optimizer_state_dict(run.engine, run.optimizer, saved["optimizer"])
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise unfit(cfg.resume, e) from None

