"""`entropy_quantile_group`: `top_entropy_quantile`'s quantile over every rank's masked tokens (TRL's
quantile spans every process). Two gloo processes with batches of different sizes: the tokens that keep
their policy gradient on each rank are those whose entropy is at least torch.quantile of both ranks'
masked entropies together; `fused_policy_loss` passes the group on (its loss, with the separate entropy
bonus over the same tokens, equals `policy_loss` at its own log-probs and entropies with the group, and
differs from the loss without it)."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlkernels
from rlkernels import presets

from loss_inputs import random_loss_inputs

WORLD, RHO, V = 2, 0.3, 13
SHAPES = ((5, 7), (3, 11))  # (B, T) of each rank: different token counts, so the gather pads
# no clip binds and no KL: every kept token has a policy gradient, every other none
CONFIG = presets.get("grpo", top_entropy_quantile=RHO, kl_coef=0.0, clip_low=0.99, clip_high=1e6)


def _inputs(rank):
    B, T = SHAPES[rank]
    return random_loss_inputs(B, T, dtype=torch.float32, noise=0.3, group_size=1, empty_rows=(), seed=10 + rank)


def _rank_results(rank, group):
    x = _inputs(rank)
    logp = x["logp"].clone().requires_grad_(True)
    out = rlkernels.policy_loss(logp, x["advantages"], x["mask"], CONFIG, old_logp=x["old_logp"], entropy=x["entropy"],
                                entropy_quantile_group=group)
    (grad,) = torch.autograd.grad(out.loss, logp)

    gen = torch.Generator().manual_seed(rank)
    logits = (torch.randn(*SHAPES[rank], V, generator=gen) * 2).requires_grad_(True)
    targets = torch.randint(0, V, SHAPES[rank], generator=gen)
    config = CONFIG.replace(entropy_coef=0.5, entropy_agg="token_mean")
    kw = dict(old_logp=x["old_logp"], entropy_quantile_group=group)
    fused = rlkernels.fused_policy_loss(logits, targets, x["advantages"], x["mask"], config, **kw)
    composed = rlkernels.policy_loss(fused.logp, x["advantages"], x["mask"], config, entropy=fused.entropy, **kw)
    alone = rlkernels.fused_policy_loss(logits, targets, x["advantages"], x["mask"], config, old_logp=x["old_logp"])
    return grad != 0, fused.loss.detach(), composed.loss.detach(), alone.loss.detach()


def _worker(rank, path, result):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        torch.save(_rank_results(rank, dist.group.WORLD), f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_quantile_spans_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), os.path.join(tmp, "result")), nprocs=WORLD, join=True)
        results = [torch.load(f"{os.path.join(tmp, 'result')}.{r}") for r in range(WORLD)]
    inputs = [_inputs(r) for r in range(WORLD)]
    joint = torch.quantile(torch.cat([x["entropy"][x["mask"]] for x in inputs]), 1 - RHO)
    for rank, (x, (kept, fused, composed, alone)) in enumerate(zip(inputs, results)):
        assert torch.equal(kept, (x["entropy"] >= joint) & x["mask"]), rank
        own = torch.quantile(x["entropy"][x["mask"]], 1 - RHO)
        assert not torch.equal(kept, (x["entropy"] >= own) & x["mask"]), "this case must tell the joint quantile apart"
        torch.testing.assert_close(fused, composed, rtol=1e-6, atol=1e-7)
        assert not torch.isclose(fused, alone), rank
