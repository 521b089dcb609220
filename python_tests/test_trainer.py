"""The trainer (DESIGN.md §5): short end-to-end runs per algorithm family, exact resume, the
non-finite guard, the log-probs it records, data parallel equality, and bad-config errors.

Runs use a 1-layer, 32-wide Llama on 1-digit addition: a few seconds each on 2 cores."""
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from rlkernels.train import main
from rlkernels.trainer import Config, from_args, loop, task, train

TINY = dict(n_layer=1, n_embd=32, n_head=2, digits=1, eval_size=16, warmup_steps=5, warmup_batch=16,
            prompts_per_step=4, num_generations=4, max_new_tokens=3, steps=3, eval_every=2, ckpt_every=2,
            progress=False)
REQUIRED = ("step", "reward_mean", "kl", "entropy", "clip_frac", "loss")


def run(tmp, **kw):
    cfg = Config(**{**TINY, "out": str(tmp), **kw})
    summary = train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))]
    return summary, rows


def check_run(tmp, summary, rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for k in REQUIRED:
            assert r[k] is not None and math.isfinite(r[k]), (k, r)
        assert r["skipped"] == 0
    on_disk = json.load(open(os.path.join(tmp, "summary.json")))
    for k in ("eval_reward_before", "eval_reward_after"):
        assert 0.0 <= summary[k] <= 1.0 and on_disk[k] == summary[k]
    assert os.path.getsize(os.path.join(tmp, "metrics.png")) > 1000
    ckpt = torch.load(os.path.join(tmp, "checkpoint.pt"), weights_only=False)
    assert ckpt["step"] == steps and ckpt["config"]["algo"] == summary["algo"]


@pytest.mark.parametrize("algo, extra", [
    ("grpo", {}),
    ("gspo", {"loss_path": "split"}),
    ("grpo", {"loss_path": "fused"}),
    ("ppo", {"critic": "shared", "kl_target": 0.01}),
    ("ppo", {"critic": "separate", "epochs": 2}),
])
def test_end_to_end(tmp_path, algo, extra):
    summary, rows = run(tmp_path, algo=algo, **extra)
    check_run(tmp_path, summary, rows, 3)
    # the first mini-batch of the first step is on-policy: ℓ_old was recorded by the same forward
    assert rows[0]["updates"] == 2 * extra.get("epochs", 1) and rows[0]["ratio_max"] < 3
    if algo == "ppo":
        assert "value_loss" in rows[0] and rows[0]["kl_coef"] > 0


@pytest.mark.parametrize("algo", ["dr_grpo", "dapo", "gspo_token", "fspo", "gepo", "cispo", "gmpo", "snis"])
def test_every_preset_runs(tmp_path, algo):
    summary, rows = run(tmp_path, algo=algo, steps=2, eval_every=5)
    check_run(tmp_path, summary, rows, 2)


@pytest.mark.parametrize("extra", [
    {"pods_keep": 2},
    {"algo": "dapo", "dynamic_sampling": True, "overlong_buffer": 1},
    {"tree": True, "tree_roots": 2},
])
def test_options_run(tmp_path, extra):
    summary, rows = run(tmp_path, steps=2, eval_every=5, **extra)
    assert len(rows) == 2 and all(math.isfinite(r["reward_mean"]) for r in rows)
    if "pods_keep" in extra:
        assert rows[0]["rows_trained"] == TINY["prompts_per_step"] * 2


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s")} for r in rows]


def test_resume_is_exact(tmp_path):
    _, full = run(tmp_path / "full", steps=4)
    run(tmp_path / "half", steps=2)
    summary = train(Config(resume=str(tmp_path / "half"), steps=4, progress=False))
    resumed = [json.loads(line) for line in open(tmp_path / "half" / "metrics.jsonl")]
    assert _strip(resumed) == _strip(full)
    assert summary["steps"] == 4


def nan_reward(prompt, completion, answer):
    return float("nan")


def test_non_finite_loss_never_reaches_the_weights(tmp_path):
    summary, rows = run(tmp_path, steps=1, reward="module:test_trainer:nan_reward")
    assert rows[0]["skipped"] == 2 and rows[0]["updates"] == 0 and summary["skipped_steps"] == 2
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    for name, w in ckpt["model"].items():  # "ref" is the policy as RL started
        assert torch.equal(w, ckpt["ref"][name]), name


def test_recorded_logprobs_match_the_sampler():
    """ℓ_old from the forward pass equals log softmax(logits / τ) of generate's own logits."""
    torch.manual_seed(0)
    cfg = Config(**{**TINY, "temperature": 0.7})
    tok = task.CharTokenizer()
    model = task.tiny_model(cfg, tok, 6).eval()
    ids, attn = task.left_pad([tok.encode("1+2="), tok.encode("13+4=")], tok.pad_id)  # left padding
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=0.7, top_k=None, top_p=1.0,
                         max_new_tokens=3, min_new_tokens=3, pad_token_id=tok.pad_id, eos_token_id=-1,
                         return_dict_in_generate=True, output_logits=True)
    seq = out.sequences
    P = ids.shape[1]
    gen = torch.stack(out.logits, 1).float()
    expected = torch.log_softmax(gen / 0.7, -1).gather(-1, seq[:, P:, None])[..., 0]
    got, _ = loop.token_logp(model, seq, torch.cat([attn, torch.ones_like(seq[:, P:])], 1), P, 0.7)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# ---- data parallel: 2 gloo processes give the loss and gradients of one process on the same data

def _tiny_batch(algo):
    torch.manual_seed(0)
    cfg = Config(**TINY)
    tok = task.CharTokenizer()
    model = task.tiny_model(cfg, tok, 5)
    B, P, T = 8, 5, 3
    seq = torch.randint(3, tok.vocab_size, (B, P + T))
    attn = torch.ones_like(seq)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 1:] = False
    mask[5, 2:] = False
    old, _ = loop.token_logp(model, seq, attn, P, 1.0)
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])
    group_ids = torch.arange(B) // 4
    adv = torch.randn(B)
    batch = dict(seq=seq, attn=attn, targets=seq[:, P:], mask=mask, old_logp=old - 0.1 * torch.rand(B, T),
                 ref_logp=old + 0.05, group_ids=group_ids, rewards=rewards, advantages=adv)
    return model, batch, P, loop.loss_config(Config(**{**TINY, "algo": algo}), 4)


def _loss_and_grads(model, batch, P, loss_cfg, rows):
    mb = {k: v[rows] for k, v in batch.items()}
    num_items = loop.all_sum(mb["mask"].sum())
    num_seqs = loop.all_sum((mb["mask"].sum(-1) > 0).sum())
    trunk, _ = loop._parts(model)
    hid = loop.hidden_states(trunk, mb["seq"], mb["attn"])[:, P - 1:-1]
    out = loop.loss_head(model, hid, mb, loss_cfg, num_items=num_items, num_seqs=num_seqs, temperature=1.0)
    model.zero_grad()
    out.loss.backward()
    params = list(model.parameters())
    loop.sync_grads(params)
    return loop.all_sum(out.loss.detach()), [p.grad.clone() for p in params]


ALGOS_DP = ("grpo", "dapo", "gspo")  # seq_mean_token_mean (num_seqs), token_mean (num_items), per row


def _ddp_worker(rank, world, init_file, result_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for algo in ALGOS_DP:
            model, batch, P, loss_cfg = _tiny_batch(algo)
            rows = torch.arange(8)[rank * 4:(rank + 1) * 4]  # whole groups on each rank
            results[algo] = _loss_and_grads(model, batch, P, loss_cfg, rows)
        if rank == 0:
            torch.save(results, result_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes import torch and transformers: ~20-50 s on 2 cores
def test_two_gloo_processes_match_one(tmp_path):
    torch.set_num_threads(1)
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "r.pt")), nprocs=2, join=True)
    got = torch.load(tmp_path / "r.pt")
    for algo in ALGOS_DP:
        model, batch, P, loss_cfg = _tiny_batch(algo)
        loss, grads = _loss_and_grads(model, batch, P, loss_cfg, torch.arange(8))
        dp_loss, dp_grads = got[algo]
        assert math.isclose(dp_loss, loss, rel_tol=1e-5, abs_tol=1e-7), algo
        for g1, g2 in zip(dp_grads, grads):
            torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-4)


# ---- bad flags and files: clear errors naming the flag

@pytest.mark.parametrize("argv, message", [
    (["--algo", "ppoo"], "--algo: expected one of"),
    (["--stepz", "3"], "unknown flag --stepz; did you mean --steps?"),
    (["--steps", "three"], "--steps: expected an int, got 'three'"),
    (["--steps", "0"], "--steps: expected an int >= 1"),
    (["--temperature", "-1"], "--temperature"),
    (["--lr"], "--lr: expected a value"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts: no such file"),
    (["--model", "/nonexistent"], "--model"),
    (["--resume", "/nonexistent"], "--resume"),
    (["--reward", "fuzzy"], "--reward"),
    (["--pods-keep", "9"], "--pods-keep"),
    (["--config", "/nonexistent.json"], "--config: no such file"),
    (["positional"], "unexpected argument"),
])
def test_bad_flags(argv, message, capsys):
    with pytest.raises(ValueError, match=message.replace("?", r"\?")):
        from_args(argv)
    assert main(argv) == 2
    assert message.split(":")[0] in capsys.readouterr().err


def test_config_file_and_flag_precedence(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"algo": "gspo", "steps": 7, "kl_coef": None}))
    cfg, explicit = from_args(["--config", str(path), "--steps", "9", "--dynamic-sampling"])
    assert (cfg.algo, cfg.steps, cfg.kl_coef, cfg.dynamic_sampling) == ("gspo", 9, None, True)
    path.write_text(json.dumps({"algo": "gspo", "stepss": 7}))
    with pytest.raises(ValueError, match="unknown key 'stepss'; did you mean 'steps'"):
        from_args(["--config", str(path)])
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--config: .* is not valid JSON"):
        from_args(["--config", str(path)])


def test_bad_files(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+2=", "answer": "3"}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match="--prompts: .* line 2"):
        train(Config(**{**TINY, "prompts": str(bad), "out": str(tmp_path / "o")}))
    bad.write_text('{"prompt": "1*2=", "answer": "2"}\n{"prompt": "1*3=", "answer": "3"}\n')
    with pytest.raises(ValueError, match="not in the demo vocabulary"):
        train(Config(**{**TINY, "prompts": str(bad), "out": str(tmp_path / "o")}))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoint.pt").write_text("garbage")
    with pytest.raises(ValueError, match="--resume: cannot read checkpoint"):
        train(Config(resume=str(tmp_path / "r")))
    with pytest.raises(ValueError, match="--reward: cannot load"):
        task.make_reward("module:no_such_module_xyz:f")


def _local_checkpoint(path):
    """A tiny Llama and a character-level fast tokenizer saved as a Hugging Face folder (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *"0123456789+= "])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)).save_pretrained(path)


def test_local_model_prompts_file_and_regex_reward(tmp_path):
    _local_checkpoint(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    # prompts of different lengths: left padding, positions from the attention mask
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                               for a in (1, 22, 333) for b in (4, 55)))
    summary, rows = run(tmp_path / "o", model=str(tmp_path / "m"), prompts=str(prompts), eval_size=2,
                        reward=r"regex:(\d+)", steps=2, prompts_per_step=2, algo="dapo")
    check_run(tmp_path / "o", summary, rows, 2)


def test_lora(tmp_path):
    pytest.importorskip("peft")
    summary, rows = run(tmp_path, lora_rank=4, steps=2)
    check_run(tmp_path, summary, rows, 2)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert any("lora_A" in k for k in ckpt["model"])
