"""Vocabulary-parallel hidden-state path: 2 gloo processes on CPU, each holding half the rows of
the head (uneven halves), give the unsharded log-probs, entropy, loss and gradients, also for logits
near 1e4, where merging the ranks' rows through a rounded logsumexp would cost 5e-4, and at a
temperature (the ranks' raw row maxima are merged in units of 1/τ)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlkernels
from rlkernels import presets

from loss_inputs import random_loss_inputs

WORLD = 2
B, T, H, V = 4, 5, 8, 37
SPLIT = (20, 17)  # rows of the head per rank: uneven on purpose


def _data(shift=0.0):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 2 / H**0.5
    bias = torch.randn(V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    inputs = random_loss_inputs(B, T, dtype=torch.float32, noise=0.2, group_size=2, seed=3)
    if shift:
        # On grids (1/8, and 1/64 for the bias) every logit near `shift` is exact in fp32, however
        # the matmul orders its sums: sharded and unsharded heads see the same values.
        hidden, weight = (torch.round(t * 8) / 8 for t in (hidden, weight))
        bias = torch.round(bias * 64) / 64 + shift
    return hidden, weight, bias, targets, inputs


def _run(hidden, weight, bias, targets, inputs, name, backend, tau, group=None):
    """(logp, entropy, loss, metrics, grads of linear_token_logprobs, grads of the loss)."""
    config = presets.get(name, entropy_coef=0.01)
    kw = dict(old_logp=inputs["old_logp"], ref_logp=inputs["ref_logp"], group_ids=inputs["group_ids"],
              rewards=inputs["rewards"])
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    logp, ent = rlkernels.linear_token_logprobs(*leaves[:2], targets, bias=leaves[2], return_entropy=True,
                                                temperature=tau, backend=backend, chunk_size=3, process_group=group)
    (logp.sum() + 0.3 * ent.sum()).backward()
    grads_lp = [x.grad for x in leaves]
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    out = rlkernels.fused_linear_policy_loss(leaves[0], leaves[1], targets, inputs["advantages"], inputs["mask"], config,
                                             bias=leaves[2], temperature=tau, backend=backend, chunk_size=3, process_group=group, **kw)
    (2.0 * out.loss).backward()
    return logp.detach(), ent.detach(), out.loss.detach(), out.metrics, grads_lp, [x.grad for x in leaves]


BACKENDS = [b for b in ("torch", "cpu") if rlkernels.backend_info()[b]["available"]]
# one pass / two passes unsharded, large logits, a temperature
CASES = [(name, backend, shift, tau) for name, shift, tau in (("grpo", 0.0, 1.0), ("gspo", 0.0, 1.0), ("grpo", 1e4, 1.0),
                                                              ("grpo", 0.0, 0.6))
         for backend in BACKENDS]


def _worker(rank, path, result_path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        lo = sum(SPLIT[:rank])
        rows = slice(lo, lo + SPLIT[rank])
        res = {}
        for name, backend, shift, tau in CASES:
            hidden, weight, bias, targets, inputs = _data(shift)
            res[name, backend, shift, tau] = _run(hidden, weight[rows], bias[rows], targets, inputs, name, backend, tau,
                                                  group=dist.group.WORLD)
        torch.save(res, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results():
    """Every case run once in one pair of processes (spawning and importing torch dominates)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result")
        mp.spawn(_worker, args=(store, result), nprocs=WORLD, join=True)
        return [torch.load(f"{result}.{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name,backend,shift,tau", CASES)
def test_two_ranks_equal_the_unsharded_head(sharded_results, name, backend, shift, tau):
    hidden, weight, bias, targets, inputs = _data(shift)
    logp, ent, loss, metrics, grads_lp, grads_loss = _run(hidden, weight, bias, targets, inputs, name, backend, tau)
    for r in range(WORLD):
        lp_r, ent_r, loss_r, metrics_r, g_lp, g_loss = sharded_results[r][(name, backend, shift, tau)]
        rows = slice(sum(SPLIT[:r]), sum(SPLIT[: r + 1]))
        torch.testing.assert_close(lp_r, logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_r, ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss_r, loss, rtol=1e-5, atol=1e-6)
        for key in metrics:
            torch.testing.assert_close(metrics_r[key], metrics[key], rtol=1e-5, atol=1e-6, msg=key)
        for mine, full in ((g_lp, grads_lp), (g_loss, grads_loss)):
            torch.testing.assert_close(mine[0], full[0], rtol=1e-5, atol=1e-6)  # ∂hidden, all-reduced
            torch.testing.assert_close(mine[1], full[1][rows], rtol=1e-5, atol=1e-6)  # this rank's ∂weight rows
            torch.testing.assert_close(mine[2], full[2][rows], rtol=1e-5, atol=1e-6)
