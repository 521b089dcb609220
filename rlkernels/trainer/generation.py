"""Sampling from the policy: rollouts (plain groups or Tree-GRPO trees), scored and filtered into training rows,
and the greedy evaluation on held-out prompts."""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from rlkernels import sampling


@torch.no_grad()
def generate(model, tok, ids, attn, part, *, greedy=False, max_new_tokens=None):
    """(sequences (B, P + max_new_tokens), attention over them): prompts then completions,
    padded after eos. Pure temperature sampling: no top-k / top-p, so the recorded ℓ_old
    (a forward pass at the same temperature) is the sampling distribution."""
    n = max_new_tokens or part.max_new_tokens
    ids, attn = ids.to(model.device), attn.to(model.device)
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=part.temperature, top_k=0, top_p=1.0)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=0,
                         pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, **kw)
    if out.shape[1] < ids.shape[1] + n:  # every row stopped early
        out = torch.cat([out, out.new_full((out.shape[0], ids.shape[1] + n - out.shape[1]), tok.pad_id)], 1)
    full_attn = torch.cat([attn, torch.ones_like(out[:, ids.shape[1]:])], 1)
    return out, full_attn


@torch.no_grad()
def evaluate(model, tok, examples, reward_fn, part, place, batch=256, context=None):
    """(mean reward of greedy completions over held-out examples (accuracy for `exact`), the first
    `eval_completions` of them as {prompt, completion, the example's other columns, reward, and the columns
    reward functions sent through `log_extra`}). `context`: a rewards.RewardContext, for TRL's arguments."""
    was_training = model.training
    model.eval()
    total, samples = 0.0, []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        ids, attn = left_pad([tok.encode(ex["prompt"]) for ex in chunk], tok.pad_id)
        with place.autocast():
            seq, _ = generate(model, tok, ids, attn, part, greedy=True)
        targets = seq[:, ids.shape[1]:]
        completions = [tok.decode(row) for row in targets.tolist()]  # one copy off the GPU
        scores = reward_fn(chunk, completions, _trl_kwargs(context, targets, tok))
        total += sum(scores)
        extra = context.log.take_extra() if context is not None else {}
        extra = {k: v for k, v in extra.items() if len(v) == len(chunk)}  # one value per completion, as TRL's
        samples += [dict(prompt=ex["prompt"], completion=c, **{k: v for k, v in ex.items() if k != "prompt"},
                         **{k: v[j] for k, v in extra.items()}, reward=r)
                    for j, (ex, c, r) in enumerate(zip(chunk, completions, scores))][:part.eval_completions - len(samples)]
    model.train(was_training)
    return total / max(len(examples), 1), samples


def rollout(model, tok, prompts, part, rng):
    """Sample completions: `num_generations` per prompt (rows grouped by prompt), or Tree-GRPO
    trees: `tree_roots` sampled roots per prompt, each cut at a random depth and branched into
    `num_generations / tree_roots` continuations that share that prefix.
    Returns (seq, attn, P, tree_ids or None)."""
    ids, attn = left_pad([tok.encode(ex["prompt"]) for ex in prompts], tok.pad_id)
    P, G = ids.shape[1], part.num_generations
    if not part.tree:
        seq, full_attn = generate(model, tok, ids.repeat_interleave(G, 0), attn.repeat_interleave(G, 0), part)
        return seq, full_attn, P, None
    R, K = part.tree_roots, G // part.tree_roots
    roots, root_attn = generate(model, tok, ids.repeat_interleave(R, 0), attn.repeat_interleave(R, 0), part)
    roots, root_attn = roots.view(len(prompts), R, -1), root_attn.view(len(prompts), R, -1)
    seqs, attns = [], []
    for r in range(R):  # one cut depth per root index keeps every branch input the same length
        cut = rng.randint(1, part.max_new_tokens - 1)
        pre, pre_attn = roots[:, r, :P + cut].repeat_interleave(K, 0), root_attn[:, r, :P + cut].repeat_interleave(K, 0)
        s, a = generate(model, tok, pre, pre_attn, part, max_new_tokens=part.max_new_tokens - cut)
        seqs.append(s.view(len(prompts), K, -1))
        attns.append(a.view(len(prompts), K, -1))
    seq = torch.cat(seqs, 1).flatten(0, 1)  # (prompts × R × K, P + T): grouped by prompt, then tree
    full_attn = torch.cat(attns, 1).flatten(0, 1)
    tree_ids = torch.arange(R, device=seq.device).repeat_interleave(K).repeat(len(prompts))
    return seq, full_attn, P, tree_ids


def _trl_kwargs(context, targets, tok):
    """TRL's extra reward arguments for these completions: their token ids up to and including the first eos."""
    if context is None:
        return None
    mask = first_eos_mask(targets, tok.eos_id)
    return context.kwargs([row[m].tolist() for row, m in zip(targets, mask)])


def sample_groups(policy, tok, prompts, part, rng, reward_fn, first_group, place, context=None):
    """Roll out `prompts` (groups numbered from `first_group`), score every completion (+ DAPO's
    overlong penalty), and choose the rows the update trains on: PODS, and dynamic sampling's
    drop of the groups whose rewards are all equal (their advantages are zero).
    Returns the chosen rows (a dict of tensors; `parts`: each reward function's rewards), with P, the rewards of all
    rows (`score`) and each reward function's (`reward_parts`, (rows, functions), NaN where a function
    returned None)."""
    G = part.num_generations
    with place.autocast():
        seq, attn, P, tree_ids = rollout(policy, tok, prompts, part, rng)
    targets = seq[:, P:]
    mask = first_eos_mask(targets, tok.eos_id)
    lengths = mask.sum(-1)
    if part.mask_truncated_completions:  # TRL's: no eos, no loss (the reward still counts in the group's advantages)
        mask = mask & (targets == tok.eos_id).any(-1, keepdim=True)
    group_ids = torch.arange(len(prompts), device=seq.device).repeat_interleave(G) + first_group
    texts = [tok.decode(row) for row in targets.tolist()]
    totals, parts = reward_fn.score([ex for ex in prompts for _ in range(G)], texts, _trl_kwargs(context, targets, tok))
    if context is not None:  # log_extra's columns are logged with the evaluation's completions only
        context.log.take_extra()
    rewards = torch.tensor(totals, dtype=torch.float32, device=seq.device)
    reward_parts = torch.tensor([[math.nan if r is None else r for r in fn_rewards] for fn_rewards in parts],
                                dtype=torch.float64).T
    score = rewards.clone()  # the weighted reward before the overlong penalty, reported as reward_mean
    if part.overlong_buffer:
        rewards = rewards + sampling.overlong_penalty(lengths, part.max_new_tokens, part.overlong_buffer)
    baselines = (greedy_rewards(policy, tok, prompts, part, reward_fn, place, context).repeat_interleave(G)
                 if part.greedy_baseline else None)
    keep = torch.arange(len(rewards), device=seq.device)
    if part.pods_keep:  # the m rollouts per prompt with the largest reward variance
        keep = sampling.pods_select(rewards, part.pods_keep, group_ids)
    if part.dynamic_sampling:
        keep = keep[sampling.filter_uniform_groups(rewards[keep], group_ids[keep])]
    rows = dict(seq=seq, attn=attn, targets=targets, mask=mask, rewards=rewards, group_ids=group_ids,
                lengths=lengths, tree_ids=tree_ids, parts=reward_parts.to(seq.device), baselines=baselines)
    rows = {k: v[keep] if v is not None else None for k, v in rows.items()}
    return dict(rows, P=P, score=score, all_lengths=lengths, reward_parts=reward_parts)


@torch.no_grad()
def greedy_rewards(policy, tok, prompts, part, reward_fn, place, context=None) -> torch.Tensor:
    """ReMax's baselines (prompts,): the reward of each prompt's greedy completion, shaped as the sampled ones
    (DAPO's overlong penalty included). Greedy decoding draws no random numbers."""
    ids, attn = left_pad([tok.encode(ex["prompt"]) for ex in prompts], tok.pad_id)
    with place.autocast():
        seq, _ = generate(policy, tok, ids, attn, part, greedy=True)
    targets = seq[:, ids.shape[1]:]
    totals, _ = reward_fn.score(prompts, [tok.decode(row) for row in targets.tolist()],
                                _trl_kwargs(context, targets, tok))
    if context is not None:
        context.log.take_extra()
    out = torch.tensor(totals, dtype=torch.float32, device=seq.device)
    if part.overlong_buffer:
        lengths = first_eos_mask(targets, tok.eos_id).sum(-1)
        out = out + sampling.overlong_penalty(lengths, part.max_new_tokens, part.overlong_buffer)
    return out


def left_pad(seqs: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both (B, P), prompts right-aligned so completions start at column P."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
        attn[i, P - len(s):] = 1
    return ids, attn


def first_eos_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) bool: the completion tokens up to and including the first eos."""
    is_eos = completions == eos_id
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first eos
    return ~after
