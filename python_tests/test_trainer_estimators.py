"""--adv-estimator (issue 32 item 5): each of verl's estimators that rlkernels.advantages provides trains a step of
the tiny demo, and the advantages the update receives equal that function of rlkernels.advantages on the step's
own rewards; the names the trainer cannot form, and bad combinations, are errors naming the flag."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from rlkernels import advantages as adv_lib
from rlkernels.trainer import Config, checkpoint, from_args, generation, loop, train
from rlkernels.trainer import run_config

TINY = dict(n_layer=1, n_embd=32, n_head=2, digits=1, eval_size=16, warmup_steps=5, warmup_batch=16,
            prompts_per_step=4, num_generations=4, max_new_tokens=3, steps=1, eval_every=5, ckpt_every=5,
            progress=False)


def digit_overlap(prompt, completion, answer):
    """Graded, so that a group's rewards differ (the tiny model is right about nothing after 5 warm-up steps)."""
    return len(set(completion) & set(answer)) + 0.25 * len(completion)


def shortness(prompt, completion, answer):
    return -0.5 * len(completion)


def outcome(rewards, lengths, T):
    """verl's token-level outcome reward: each completion's reward at its last token."""
    tok = torch.zeros(len(rewards), T, dtype=rewards.dtype)
    for i, n in enumerate(lengths.tolist()):
        if n:
            tok[i, n - 1] = rewards[i]
    return tok


def expected(name, b, greedy):
    r, g, m = b["rewards"], b["group_ids"], b["mask"].bool()
    if name in ("grpo", "grpo_vectorized"):
        return adv_lib.group_normalized(r, g)
    if name in ("rloo", "rloo_vectorized"):
        return adv_lib.rloo(r, g)
    if name == "reinforce_plus_plus":
        return adv_lib.reinforce_plus_plus(outcome(r, b["lengths"], m.shape[1]), m, 1.0)[0]
    if name == "reinforce_plus_plus_baseline":
        return adv_lib.reinforce_plus_plus_baseline(r, m, g)
    if name == "remax":
        return adv_lib.remax(outcome(r, b["lengths"], m.shape[1]), greedy, m)[0]
    if name == "opo":
        return adv_lib.opo(r, m, g)
    if name == "gpg":
        return adv_lib.gpg(r, g)
    if name == "grpo_passk":
        return adv_lib.grpo_passk(r, g)
    if name == "gdpo":
        return adv_lib.gdpo(b["parts"].float(), m, g, weights=[1.0, 2.0])
    raise AssertionError(name)


@pytest.mark.parametrize("name", [n for n in run_config.ADV_ESTIMATORS if n != "gae"])
def test_each_estimator_trains_with_its_function_of_rlkernels_advantages(tmp_path, monkeypatch, name):
    seen, greedy = {}, []
    real_update, real_greedy = loop.optimizer_steps, generation.greedy_rewards

    def update(run, batch, step):
        seen.update(batch)
        return real_update(run, batch, step)

    def greedy_rewards(policy, tok, prompts, part, reward_fn, place, context=None):
        out = real_greedy(policy, tok, prompts, part, reward_fn, place, context)
        # the same greedy completions scored by the evaluation's code
        _, samples = generation.evaluate(policy, tok, prompts, reward_fn,
                                         dataclasses.replace(part, eval_completions=len(prompts)), place)
        assert out.tolist() == pytest.approx([s["reward"] for s in samples])
        greedy.append(out)
        return out

    monkeypatch.setattr(loop, "optimizer_steps", update)
    monkeypatch.setattr(generation, "greedy_rewards", greedy_rewards)
    fns = [digit_overlap, shortness] if name == "gdpo" else digit_overlap
    summary = train(Config(**TINY, out=str(tmp_path), adv_estimator=name,
                           **({"reward_weights": [1.0, 2.0]} if name == "gdpo" else {})), reward_fn=fns)
    assert summary["config"]["adv_estimator"] == name
    assert (name == "remax") == bool(greedy)
    baselines = torch.cat(greedy).repeat_interleave(TINY["num_generations"]) if greedy else None
    assert seen["rewards"].std() > 0  # a test on equal rewards would pass on zeros
    want = expected(name, seen, baselines)
    assert want.abs().max() > 0
    torch.testing.assert_close(seen["advantages"], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gdpo"])
def test_token_level_estimators_feed_a_sequence_ratio(tmp_path, name):
    """Their (B, T) advantages are one value per completion (the outcome reward at the last token), which GSPO's
    sequence ratio takes."""
    summary = train(Config(**TINY, out=str(tmp_path), algo="gspo", adv_estimator=name), reward_fn=digit_overlap)
    assert summary["final_reward_mean"] is not None and summary["skipped_steps"] == 0


@pytest.mark.parametrize("algo, name", [("grpo", "grpo"), ("ppo", "gae")])
def test_the_default_estimator_is_the_one_named(tmp_path, algo, name):
    rows = []
    for i, est in enumerate((None, name)):
        train(Config(**TINY, out=str(tmp_path / str(i)), algo=algo, adv_estimator=est), reward_fn=digit_overlap)
        rows.append([json.loads(line) for line in open(tmp_path / str(i) / "metrics.jsonl")])
    for a, b in zip(*rows):
        for k in ("reward_mean", "loss", "kl", "entropy", "grad_norm"):
            assert a[k] == b[k], k


def test_the_estimator_is_logged_and_resumed(tmp_path, capsys):
    out = str(tmp_path / "run")
    train(Config(**{**TINY, "ckpt_every": 1}, out=out, adv_estimator="rloo"), reward_fn=digit_overlap)
    assert "--adv-estimator rloo" in capsys.readouterr().out
    saved = checkpoint.load_checkpoint(out)
    cfg, explicit = from_args(["--resume", out, "--steps", "2"])
    assert run_config.merge_resume(cfg, saved["config"], explicit).adv_estimator == "rloo"


@pytest.mark.parametrize("argv, message", [
    (["--adv-estimator", "grpoo"], "--adv-estimator: expected one of gae, grpo, grpo_vectorized, rloo"),
    (["--adv-estimator", "optimal_token_baseline"], "--adv-estimator optimal_token_baseline: needs Σ_v π_v²"),
    (["--adv-estimator", "gae"], "--adv-estimator gae: GAE needs a critic's values"),
    (["--algo", "ppo", "--adv-estimator", "rloo", "--num-generations", "1"], "--adv-estimator rloo: --algo ppo trains a critic"),
    (["--adv-estimator", "rloo", "--tree"], "--adv-estimator rloo: --tree forms Tree-GRPO's"),
    (["--adv-estimator", "rloo", "--scale-rewards", "group"], "--scale-rewards group: not an option of "
                                                              "--adv-estimator rloo"),
    (["--adv-estimator", "gdpo", "--scale-rewards", "batch"], "--scale-rewards batch: not an option"),
    (["--adv-estimator", "opo", "--multi-objective-aggregation", "normalize_then_sum"], "forms GDPO's"),
    (["--adv-estimator", "rloo", "--algo", "snis"], "SNIS) takes the rewards"),
    (["--adv-estimator", "reinforce_plus_plus", "--gamma", "0.9", "--algo", "gspo"], "give --gamma 1"),
])
def test_bad_estimators_name_the_flag(argv, message):
    with pytest.raises(ValueError) as e:
        from_args(argv)
    assert message in str(e.value)


def test_batch_wide_estimators_are_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="normalises over the whole batch"):
        from_args(["--adv-estimator", "gpg"])
    assert from_args(["--adv-estimator", "rloo"])[0].adv_estimator == "rloo"


def test_a_bad_estimator_answers_before_torch_is_imported():
    script = """if True:
        import contextlib, io, sys
        from rlkernels.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["train", "--adv-estimator", "nope"])
        print(code, "torch" in sys.modules, err.getvalue().strip())
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "WORLD_SIZE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 False rlkernels.train: error: --adv-estimator: expected one of gae, grpo"), out.stdout


def test_the_table_holds_every_estimator_the_flag_names():
    from rlkernels.trainer import estimators

    assert set(run_config.ADV_ESTIMATORS) | {"snis", "tree_grpo", "trl_gdpo"} == set(estimators.ESTIMATORS)


ESTIMATOR_PLUGIN = '''
import torch
from rlkernels.trainer import estimators

CALLS = []


def minus_group_min(part, batch, weights, values, beta):
    """Each reward minus its group's least, as a user would write it."""
    r, g = batch["rewards"], batch["group_ids"]
    least = torch.stack([r[g == i].min() for i in g.tolist()])
    CALLS.append((r.clone(), g.clone()))
    return r - least, None


estimators.register("minus_group_min", minus_group_min)
'''


def test_a_plugin_estimator_forms_the_advantages(tmp_path, monkeypatch):
    from rlkernels.trainer import estimators, plugins

    path = tmp_path / "my_estimator.py"
    path.write_text(ESTIMATOR_PLUGIN)
    seen, real_update = {}, loop.optimizer_steps
    monkeypatch.setattr(loop, "optimizer_steps", lambda run, batch, step: seen.update(batch) or real_update(run, batch, step))
    try:
        cfg, _ = from_args(["--plugin", str(path), "--adv-estimator", "minus_group_min"])
        train(dataclasses.replace(cfg, **TINY, out=str(tmp_path / "run")), reward_fn=digit_overlap)
        module = plugins._LOADED[os.path.realpath(path)]
        (r, g), = module.CALLS
        assert r.std() > 0
        want = torch.stack([r[i] - r[g == g[i]].min() for i in range(len(r))])
        torch.testing.assert_close(seen["advantages"], want)
        with pytest.raises(ValueError, match="an estimator 'minus_group_min' exists already"):
            estimators.register("minus_group_min", module.minus_group_min)
    finally:
        estimators.ESTIMATORS.pop("minus_group_min", None)
    with pytest.raises(ValueError, match="registers"):
        from_args(["--adv-estimator", "minus_group_min"])
