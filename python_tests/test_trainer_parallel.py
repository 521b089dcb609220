"""The trainer across processes and with gradient checkpointing (docs/design.md §10).

Data parallel: two gloo processes, each with half of a global batch, take the update step of one
process on the whole batch, through DistributedDataParallel and through FSDP2 (both sum the gradients;
averaging them would halve every gradient, which AdamW or clipping would hide: so the gradients are
compared, and the steps are plain SGD, clipped only where clipping is the point)."""
import dataclasses
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from rlkernels.trainer import Config, config_parts, device, distributed, sharding, task, train
from rlkernels.trainer import model as trainer_model
from rlkernels.trainer import update as trainer_update

TINY = dict(n_layer=1, n_embd=32, n_head=2, digits=1, eval_size=16, warmup_steps=5, warmup_batch=16,
            prompts_per_step=4, num_generations=4, max_new_tokens=3, steps=2, eval_every=2, ckpt_every=2,
            progress=False)
CPU32 = device.Placement(torch.device("cpu"), torch.float32)
B, P, T = 8, 5, 3
HALVES = (torch.arange(4), torch.arange(4, 8))  # whole prompt groups on each rank
HEAD_ARGS = {"temperature": 1.0, "softcap": None}  # the ops' arguments for a plain head (trainer_model.output_head_of)


def _setup(algo, path="linear", critic=None, lora=False):
    """(UpdateForward, params, a batch of 8 rows in 2 groups, Config): the same on every call."""
    torch.manual_seed(0)
    cfg = Config(**{**TINY, "algo": algo, "loss_path": path, "max_grad_norm": 1e6})
    tok = task.CharTokenizer()
    model = task.tiny_model(tok, P, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, max_new_tokens=cfg.max_new_tokens)
    seq = torch.randint(3, tok.vocab_size, (B, P + T))
    attn = torch.ones_like(seq)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 1:] = False  # unequal lengths: token and row counts differ between the ranks
    mask[5, 2:] = False
    mask[6, 1:] = False
    old, _ = trainer_model.token_logp(model, seq, attn, P, HEAD_ARGS)
    batch = dict(seq=seq, attn=attn, targets=seq[:, P:], mask=mask, old_logp=old - 0.1 * torch.rand(B, T),
                 ref_logp=old + 0.05, group_ids=torch.arange(B) // 4, rewards=torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1]),
                 advantages=torch.randn(B, T) if critic else torch.randn(B), values=torch.randn(B, T),
                 returns=torch.randn(B, T))
    if lora:
        model = trainer_model.add_lora(model, 4, 16.0)
    value_model = trainer_model.Critic(trainer_model.parts(model)[0], 32, critic == "separate") if critic else None
    forward = trainer_update.UpdateForward(model, value_model, config_parts.loss_config(cfg, 4), HEAD_ARGS, path)
    params = [p for p in forward.parameters() if p.requires_grad]
    return forward, params, batch, cfg


CASES = {  # name: (_setup arguments, find_unused)
    "grpo": (("grpo",), False),  # seq_mean_token_mean: num_seqs
    "dapo": (("dapo",), False),  # token_mean: num_items
    "gspo": (("gspo",), False),  # a sequence ratio
    "grpo-fused": (("grpo", "fused"), False),
    "ppo-shared": (("ppo", "linear", "shared"), False),  # the value loss, the critic on the actor's trunk
    "ppo-separate": (("ppo", "linear", "separate"), False),
    "lora": (("grpo", "linear", None, True), False),
}


def _whole(t):
    """A tensor as one process holds it: FSDP's shards gathered (every rank calls this)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _steps(forward, params, batch, cfg, rows_per_step, find_unused=False, poison=False, fsdp=False):
    """Optimizer steps on `rows_per_step` (this rank's rows of each step's mini-batch); per step the
    (globally reduced) metrics, gradients, and parameters after it."""
    engine = sharding.update_engine(forward, CPU32, find_unused, fsdp)
    params = [p for p in engine.parameters() if p.requires_grad]  # FSDP replaces them with sharded ones
    optimizer = torch.optim.SGD(params, lr=0.1)
    out = []
    for i, rows in enumerate(rows_per_step):
        mb = {k: v[rows] for k, v in batch.items()}
        if poison and i == 0:  # a non-finite loss on one rank: every rank skips the step
            mb["advantages"] = mb["advantages"] * (math.inf if distributed.dist_info()[0] == 0 else 1.0)
        num_items = distributed.all_sum(mb["mask"].sum())
        num_seqs = distributed.all_sum((mb["mask"].sum(-1) > 0).sum())
        m, skipped = trainer_update.minibatch_update(engine, optimizer, params, mb, P, cfg, CPU32,
                                           num_items=num_items, num_seqs=num_seqs)
        summed = {k: distributed.all_sum(m[k]) for k in trainer_update.SUMMED_METRICS if k in m}
        grads = [_whole(p.grad).clone() if p.grad is not None else None for p in params]
        out.append((skipped, summed, m.get("grad_norm"), grads, [_whole(p.detach()).clone() for p in params]))
    return out


def _rank_rows(rank, name):
    """This rank's rows of the two steps: half the global batch each, or (`empty`) all of rank 0's
    rows and none of rank 1's (dynamic sampling can leave a rank with no group)."""
    if name == "empty":
        return [HALVES[0] if rank == 0 else HALVES[0][:0]] * 2
    return [HALVES[rank], HALVES[rank]]


def _global_rows(name):
    return [HALVES[0]] * 2 if name == "empty" else [torch.arange(B)] * 2


def _run(name, rows_per_step, fsdp=False):
    if name == "empty":
        return _steps(*_setup("grpo"), rows_per_step, find_unused=True, fsdp=fsdp)
    if name == "skip":
        return _steps(*_setup("grpo"), rows_per_step, poison=True, fsdp=fsdp)
    if name == "clip":  # the norm over every rank's gradients (FSDP: over the shards), each scaled by it
        forward, params, batch, cfg = _setup("grpo")
        return _steps(forward, params, batch, dataclasses.replace(cfg, max_grad_norm=0.1), rows_per_step, fsdp=fsdp)
    if name == "checkpointing":  # FSDP gathers each layer again for the recomputation in the backward
        forward, params, batch, cfg = _setup("grpo")
        trainer_model.enable_checkpointing(forward.policy)
        return _steps(forward.train(), params, batch, cfg, rows_per_step, fsdp=fsdp)
    setup, find_unused = CASES[name]
    return _steps(*_setup(*setup), rows_per_step, find_unused, fsdp=fsdp)


NAMES = (*CASES, "empty", "skip", "clip", "checkpointing")
ENGINES = ("ddp", "fsdp")


def _ddp_worker(rank, world, init_file, result_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {(engine, name): _run(name, _rank_rows(rank, name), engine == "fsdp")
                   for engine in ENGINES for name in NAMES}
        if rank == 0:
            torch.save(results, result_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes import torch and transformers: ~40-60 s on 2 cores
def test_two_gloo_processes_take_the_step_of_one(tmp_path):
    torch.set_num_threads(1)
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "r.pt")), nprocs=2, join=True)
    got = torch.load(tmp_path / "r.pt")
    expected = {name: _run(name, _global_rows(name)) for name in NAMES}
    for engine, name in got:
        for step, (one, two) in enumerate(zip(expected[name], got[engine, name])):
            where = f"{engine}: {name}, step {step + 1}"
            assert one[0] == two[0] == (name == "skip" and step == 0), where
            if not one[0]:
                for k, v in one[1].items():
                    assert math.isclose(two[1][k], v, rel_tol=1e-5, abs_tol=1e-7), (where, k)
                assert math.isclose(two[2], one[2], rel_tol=1e-5), (where, "grad_norm")
                for g1, g2 in zip(one[3], two[3]):
                    torch.testing.assert_close(g2, g1, atol=1e-6, rtol=1e-4, msg=where)
            for p1, p2 in zip(one[4], two[4]):
                torch.testing.assert_close(p2, p1, atol=1e-6, rtol=1e-4, msg=where)


def _train_worker(rank, world, init_file, configs):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for cfg in configs:
            train(cfg)
    finally:
        dist.destroy_process_group()


def _metrics(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s"))} for r in rows]


# PPO with its critic on its own trunk and a reference model: under FSDP all three are sharded
RUN = {**TINY, "algo": "ppo", "critic": "separate", "ckpt_every": 1, "eval_every": 1}


@pytest.mark.slow  # five short runs in two spawned processes: ~60-90 s on 2 cores
def test_two_process_runs_through_ddp_and_fsdp(tmp_path):
    """A DDP run; an FSDP2 run of the same config logs the same metrics and saves the same checkpoint (whole
    tensors, numbered as without FSDP), resumes exactly, and its folder loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    out = {name: str(tmp_path / name) for name in ("ddp", "fsdp", "half", "lora")}
    configs = [Config(**RUN, out=out["ddp"]), Config(**RUN, out=out["fsdp"], fsdp=True),
               Config(**{**RUN, "steps": 1}, out=out["half"], fsdp=True),
               Config(resume=out["half"], steps=2, progress=False),
               Config(**{**TINY, "steps": 1}, out=out["lora"], fsdp=True, lora_rank=4)]
    mp.spawn(_train_worker, args=(2, str(tmp_path / "init"), configs), nprocs=2, join=True)
    rows = _metrics(out["ddp"])
    assert [r["step"] for r in rows] == [1, 2] and all(r["updates"] == 2 and r["skipped"] == 0 for r in rows)
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "value_loss", "grad_norm"))
    assert rows[0]["groups"] == 8  # 4 prompts per step on each of the 2 ranks
    assert json.load(open(os.path.join(out["ddp"], "summary.json")))["backend"] == "gloo"

    sharded = _metrics(out["fsdp"])
    for r1, r2 in zip(rows, sharded, strict=True):
        assert r1.keys() == r2.keys()
        for k in r1:
            assert r2[k] == pytest.approx(r1[k], rel=1e-5, abs=1e-6), k
    assert _metrics(out["half"]) == sharded  # resumed from its checkpoint at step 1
    ckpt = {name: torch.load(os.path.join(out[name], "checkpoint.pt"), weights_only=True) for name in ("ddp", "fsdp")}
    for part in ("model", "critic", "ref"):
        assert ckpt["fsdp"][part].keys() == ckpt["ddp"][part].keys()
        for k, v in ckpt["ddp"][part].items():
            torch.testing.assert_close(ckpt["fsdp"][part][k], v.cpu(), atol=1e-6, rtol=1e-5, msg=f"{part} {k}")
    state = {name: ckpt[name]["optimizer"]["state"] for name in ckpt}
    assert state["fsdp"].keys() == state["ddp"].keys() and len(state["ddp"]) == len(list(ckpt["ddp"]["model"])) + len(
        ckpt["ddp"]["critic"])
    for i, s in state["ddp"].items():
        for k, v in s.items():
            torch.testing.assert_close(state["fsdp"][i][k], v.cpu(), atol=1e-6, rtol=1e-4, msg=f"optimizer {i} {k}")
    assert ckpt["fsdp"]["optimizer"]["param_groups"] == ckpt["ddp"]["optimizer"]["param_groups"]

    exported = AutoModelForCausalLM.from_pretrained(out["fsdp"])
    assert exported.config.architectures == ["LlamaForCausalLM"]
    assert exported.state_dict().keys() == ckpt["fsdp"]["model"].keys()
    for k, v in exported.state_dict().items():
        assert torch.equal(v, ckpt["fsdp"]["model"][k]), k
    # the demo's LoRA run exports the merged weights: the adapters of its checkpoint merged into its base
    from rlkernels.trainer.model import add_lora

    merged = AutoModelForCausalLM.from_pretrained(out["lora"])
    expected = add_lora(AutoModelForCausalLM.from_config(merged.config), 4, 16.0)
    expected.load_state_dict(torch.load(os.path.join(out["lora"], "checkpoint.pt"), weights_only=True)["model"])
    expected = expected.merge_and_unload().state_dict()
    assert merged.state_dict().keys() == expected.keys()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, expected[k], atol=1e-7, rtol=1e-6, msg=k)


# ---- gradient checkpointing: the same loss and gradients, the layers run twice

def _loss_and_grads(forward, params, batch, cfg):
    mb = {k: v[:4] for k, v in batch.items()}
    loss, _, _ = forward(mb, P, float(mb["mask"].sum()), float((mb["mask"].sum(-1) > 0).sum()))
    loss.backward()
    return loss.detach(), [p.grad for p in params]


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    forward, params, batch, cfg = _setup("grpo")
    loss, grads = _loss_and_grads(forward, params, batch, cfg)
    forward, params, batch, cfg = _setup("grpo")
    trainer_model.enable_checkpointing(forward.policy)
    mlp, calls = forward.policy.model.layers[0].mlp, []
    run_mlp = mlp.forward  # counted here: module hooks do not run again when the backward recomputes
    mlp.forward = lambda *a, **k: calls.append(1) or run_mlp(*a, **k)
    forward.train()  # Hugging Face checkpoints only in training mode
    ck_loss, ck_grads = _loss_and_grads(forward, params, batch, cfg)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    torch.testing.assert_close(ck_loss, loss, atol=0, rtol=0)
    for g1, g2 in zip(grads, ck_grads):
        torch.testing.assert_close(g2, g1, atol=1e-7, rtol=1e-6)


def test_gradient_checkpointing_in_a_run_changes_no_metric(tmp_path):
    pytest.importorskip("peft")

    def metrics(out, **kw):
        train(Config(**{**TINY, "out": str(out), "lora_rank": 4, **kw}))
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s"))} for r in rows]

    plain, checkpointed = metrics(tmp_path / "a"), metrics(tmp_path / "b", gradient_checkpointing=True)
    assert checkpointed[0]["updates"] == 2
    for r1, r2 in zip(plain, checkpointed):
        assert r1.keys() == r2.keys()
        for k in r1:
            assert r2[k] == pytest.approx(r1[k], rel=1e-5, abs=1e-6), k


def test_gradient_checkpointing_refused_where_the_model_has_none():
    with pytest.raises(ValueError, match="--gradient-checkpointing: Linear does not support it"):
        trainer_model.enable_checkpointing(torch.nn.Linear(2, 2))
