"""The trainer's rewards (rlkernels/trainer/rewards.py, docs/design.md §10): several weighted reward functions
(None = not applicable, TRL's nansum), their per-function metrics, the flags, and a sequence-classification
reward model from a local folder.

Runs reuse test_trainer's tiny config: a few seconds each on 2 cores."""
import json
import math

import pytest
import torch
from test_trainer import TINY, _local_checkpoint, check_run, run

from rlkernels.train import main
from rlkernels.trainer import Config, device, distributed, from_args, rewards, run_config, train
from rlkernels.trainer import model as trainer_model

CPU = device.Placement(torch.device("cpu"), torch.float32)


def length_reward(prompts, completions, **kwargs):  # TRL's signature
    return [float(len(c)) for c in completions]


def first_digit_reward(prompt, completion, answer):  # per sample; None: "not applicable" to odd prompts
    return None if int(prompt[0]) % 2 else float(completion[:1] == answer[:1])


def never_reward(prompts, completions, **kwargs):
    return [None] * len(prompts)


def combined(cfg, reward_fn=None):
    return rewards.build(*rewards.reward_functions(cfg.reward, cfg.reward_model, cfg.reward_weights, reward_fn), cfg.reward_model, CPU)


def examples(prompts, answers, **columns):
    """The examples the trainer scores (trainer/data.py): each row's columns, the prompt under "prompt"."""
    return [{"prompt": p, "answer": a, **{k: v[i] for k, v in columns.items()}}
            for i, (p, a) in enumerate(zip(prompts, answers))]


def test_weighted_sum_skips_none_as_trl_does():
    exact = rewards.make_reward("exact")
    r = combined(Config(reward_weights=[2.0, -0.5, 3.0]), [length_reward, first_digit_reward, exact])
    prompts, completions, answers = ["1+2=", "2+2=", "4+4=", "3+5="], ["3", "5", "8", "44"], ["3", "4", "8", "8"]
    totals, parts = r.score(examples(prompts, answers), completions)
    assert parts == [[1.0, 1.0, 1.0, 2.0], [None, 0.0, 1.0, None], [1.0, 0.0, 1.0, 0.0]]
    # by hand: 2·len − 0.5·first digit (when it applies) + 3·exact
    assert totals == [2 + 3, 2 - 0, 2 - 0.5 + 3, 4 + 0]
    assert r(examples(prompts, answers), completions) == totals
    assert r.names == ["length_reward", "first_digit_reward", "<lambda>"]


def test_a_completion_no_function_scores_is_an_error_naming_them():
    r = combined(Config(), [first_digit_reward, never_reward])
    assert r.score(examples(["2+2="], ["4"]), ["4"])[0] == [1.0]
    with pytest.raises(ValueError, match=r"^--reward: .*first_digit_reward and --reward: .*never_reward returned None "
                                         r"on prompt '1\+2=' \(completion '3'\)"):
        r.score(examples(["2+2=", "1+2="], ["4", "3"]), ["4", "3"])


def test_weighted_sum_beyond_float32_is_an_error():
    r = combined(Config(reward_weights=[1e38, 1e38]), [length_reward, length_reward])
    assert r.names == ["length_reward", "length_reward_2"]  # a name used twice: distinct metrics
    with pytest.raises(ValueError, match="^--reward-weights: the weighted reward 1e\\+39 on prompt '1\\+2='"):
        r.score(examples(["1+2="], ["3"]), ["3" * 5])


def test_names_and_default():
    fns, weights = rewards.reward_functions([], "", [])
    assert [n for _, n, _, _ in fns] == ["exact"] and weights == [1.0]
    specs = ["regex:(\\d+)", "module:test_trainer_rewards:length_reward"]
    fns, weights = rewards.reward_functions(specs, "", [])
    assert [n for _, n, _, _ in fns] == ["regex", "length_reward"] and weights == [1.0, 1.0]
    fns, _ = rewards.reward_functions([], "/some/rm", [0.5])
    assert fns == []  # only the reward model (added by build)
    with pytest.raises(ValueError, match="^reward_fn: expected a callable or a list of callables"):
        rewards.reward_functions([], "", [], [length_reward, "exact"])


@pytest.mark.parametrize("argv, expected", [
    (["--reward", "exact", "regex:(\\d+)"], ["exact", "regex:(\\d+)"]),
    (["--reward", "exact", "--reward=regex:(\\d+)", "--steps", "2"], ["exact", "regex:(\\d+)"]),
    (["--reward", "exact", "--reward", "regex:(\\d+)"], ["exact", "regex:(\\d+)"]),
])
def test_several_reward_flags(argv, expected):
    cfg, explicit = from_args(argv + ["--reward-weights", "1", "-0.5"])
    assert cfg.reward == expected and cfg.reward_weights == [1.0, -0.5] and {"reward", "reward_weights"} <= explicit


@pytest.mark.parametrize("argv, message", [
    (["--reward-weights"], "--reward-weights: expected one or more values"),
    (["--reward-weights", "1", "x"], "--reward-weights: expected a number, got 'x'"),
    (["--reward-weights", "nan"], "--reward-weights: expected a finite number, got nan"),
    (["--reward", "exact", "fuzzy"], "--reward: expected exact | regex:PATTERN | package.module:function | "
                                     "path/to/file.py:function | trl grpo's accuracy_reward, "
                                     "reasoning_accuracy_reward, think_format_reward or get_soft_overlong_punishment, "
                                     "got 'fuzzy'"),
    (["--reward-model", "/nonexistent"], "--reward-model: expected a local Hugging Face model folder"),
])
def test_bad_reward_flags(argv, message, capsys):
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        from_args(argv)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"rlkernels.train: error: {message.split(':')[0]}")


def test_wrong_number_of_weights_is_an_error_before_any_work(tmp_path, capsys):
    argv = ["--reward", "exact", "regex:(\\d+)", "--reward-weights", "1", "2", "3", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err == ("rlkernels.train: error: --reward-weights: expected 2 weights (one per reward: 2 reward functions, "
                   "in that order), got 3\n") and out == ""
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match=r"^--reward-weights: expected 1 weight \(one per reward: 1 reward function\), "
                                         r"got 2$"):
        train(Config(**{**TINY, "out": str(tmp_path / "p"), "reward_weights": [1.0, 2.0]}),
              reward_fn=length_reward)


def test_config_file_lists_and_old_checkpoints(tmp_path):
    assert Config(reward="exact", reward_weights=2).reward == ["exact"]  # one value, as in checkpoints before lists
    assert Config(reward="exact").reward_weights == []
    saved = {**vars(Config()), "reward": "regex:(\\d+)"}  # a checkpoint's config from before several rewards
    assert run_config.merge_resume(Config(resume=str(tmp_path)), saved, explicit=set()).reward == ["regex:(\\d+)"]


def test_config_file_takes_a_list(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"reward": ["exact", "regex:(\\d)"], "reward_weights": [1, 0.25]}))
    cfg, _ = from_args(["--config", str(path)])
    assert cfg.reward == ["exact", "regex:(\\d)"] and cfg.reward_weights == [1.0, 0.25]
    path.write_text(json.dumps({"reward_weights": [1, "a"]}))
    with pytest.raises(ValueError, match="key 'reward_weights': expected a number, got 'a'"):
        from_args(["--config", str(path)])


def test_run_with_two_weighted_functions_logs_each(tmp_path):
    cfg = Config(**{**TINY, "out": str(tmp_path), "steps": 2, "reward_weights": [2.0, -0.5]})
    summary = train(cfg, reward_fn=[rewards.make_reward("exact"), length_reward])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert math.isfinite(summary["eval_reward_after"])  # greedy completions' weighted rewards
    for r in rows:
        # no None here, so the mean of the sums is the weighted sum of the means
        assert r["reward_mean"] == pytest.approx(2 * r["rewards/<lambda>/mean"] - 0.5 * r["rewards/length_reward/mean"],
                                                 abs=1e-6)
        assert 0 <= r["rewards/length_reward/mean"] <= TINY["max_new_tokens"] and r["rewards/<lambda>/std"] >= 0


def test_per_function_metrics_over_the_rows_it_scored(tmp_path):
    summary, rows = run(tmp_path, steps=1, reward=["exact", "test_trainer_rewards:first_digit_reward"])
    r = rows[0]
    assert set(k for k in r if k.startswith("rewards/")) == {
        "rewards/exact/mean", "rewards/exact/std", "rewards/first_digit_reward/mean", "rewards/first_digit_reward/std"}
    assert 0 <= r["rewards/first_digit_reward/mean"] <= 1 and math.isfinite(r["rewards/first_digit_reward/std"])


def test_nan_mean_std_matches_torch():
    x = torch.tensor([1.0, math.nan, 3.0, 0.5, math.nan], dtype=torch.float64)
    seen = x[~x.isnan()]
    mean, std = distributed.nan_mean_std(x)
    assert mean == pytest.approx(float(seen.mean())) and std == pytest.approx(float(seen.std()))
    assert distributed.nan_mean_std(x[1:2]) == (None, None) and distributed.nan_mean_std(x[:1]) == (1.0, 0.0)


# ---- the reward model

def _reward_model(path, chat_template=None):
    """A tiny random Llama sequence classifier (one label) and the character tokenizer of test_trainer, saved."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    _local_checkpoint(path)  # the tokenizer (and a causal LM, replaced below)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    torch.manual_seed(1)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)).save_pretrained(path)
    return tok


def _direct(path, texts):
    """Each text scored alone (no padding) by the model as transformers loads it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]) for t in texts]


def test_reward_model_scores_prompt_and_completion(tmp_path):
    _reward_model(tmp_path / "rm")
    rm = rewards.RewardModel(str(tmp_path / "rm"), CPU)
    prompts, completions = ["1+2=", "22+33=", "4+4="], ["3", "55", "8 "]
    got = rm(prompts, completions)
    assert got == pytest.approx(_direct(tmp_path / "rm", [p + c for p, c in zip(prompts, completions)]), abs=1e-5)
    assert len(set(got)) == 3  # a random head: different texts, different scores
    rm.batch = 2  # in batches of 2: the same scores
    assert rm(prompts, completions) == pytest.approx(got, abs=1e-5)
    # as one more reward: its own weight after the functions, its folder's name in the metrics
    r = combined(Config(reward_model=str(tmp_path / "rm"), reward_weights=[2.0, 0.5]), length_reward)
    totals, parts = r.score(examples(prompts, ["3", "55", "8"]), completions)
    assert r.names == ["length_reward", "rm"] and parts[1] == pytest.approx(got, abs=1e-6)
    assert totals == pytest.approx([2 * len(c) + 0.5 * s for c, s in zip(completions, got)], abs=1e-6)


def test_reward_model_on_conversations_uses_its_chat_template(tmp_path):
    _reward_model(tmp_path / "rm", chat_template="{% for m in messages %}{{ m['content'] }}={% endfor %}")
    rm = rewards.RewardModel(str(tmp_path / "rm"), CPU)
    prompts = [[{"role": "user", "content": "1+2"}], [{"role": "user", "content": "12+3"}]]
    completions = [[{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "15"}]]
    assert rm.texts(prompts, completions) == ["1+2=3=", "12+3=15="]
    assert rm(prompts, completions) == pytest.approx(_direct(tmp_path / "rm", ["1+2=3=", "12+3=15="]), abs=1e-5)
    rm.tok.chat_template = None
    with pytest.raises(ValueError, match="^--reward-model: conversational prompts need a reward tokenizer with a chat"):
        rm.texts(prompts, completions)


def test_reward_model_folder_that_is_not_one(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^--reward-model: cannot load .*empty"):
        rewards.RewardModel(str(tmp_path / "empty"), CPU)


def test_training_with_a_reward_model(tmp_path, capsys):
    _reward_model(tmp_path / "rm")
    out = tmp_path / "o"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, "steps": 2}.items()] + [
        "--out", str(out), "--reward", "exact", "--reward-model", str(tmp_path / "rm"),
        "--reward-weights", "1", "0.5"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0 and math.isfinite(r["loss"]) for r in rows)
    for r in rows:
        assert r["reward_mean"] == pytest.approx(r["rewards/exact/mean"] + 0.5 * r["rewards/rm/mean"], abs=1e-5)
        assert r["rewards/rm/std"] > 0
    # the reward model alone (no --reward): no exact-match reward
    summary, rows = run(tmp_path / "alone", steps=1, reward_model=str(tmp_path / "rm"))
    assert [k for k in rows[0] if k.startswith("rewards/")] == ["rewards/rm/mean", "rewards/rm/std"]
    assert rows[0]["reward_mean"] == pytest.approx(rows[0]["rewards/rm/mean"], abs=1e-5)


# ---- multi_objective_aggregation="normalize_then_sum" (GDPO, as TRL computes it)

def gdpo_by_hand(rows, groups, weights, eps=1e-4):
    """TRL's normalize_then_sum written out with the statistics module: per function and group, (r − mean)/(stdev + ε)
    over the rows it scored (stdev undefined below two: the term is dropped; a group of one row: 0), the weighted sum,
    then (s − mean)/(stdev + ε) over the batch."""
    import statistics

    sums = []
    for i, row in enumerate(rows):
        total = 0.0
        for k, r in enumerate(row):
            members = [j for j in range(len(rows)) if groups[j] == groups[i]]
            scored = [rows[j][k] for j in members if rows[j][k] is not None]
            if r is None or (len(members) > 1 and len(scored) < 2):
                continue
            z = 0.0 if len(members) == 1 else (r - statistics.mean(scored)) / (statistics.stdev(scored) + eps)
            total += weights[k] * z
        sums.append(total)
    mean, stdev = statistics.mean(sums), statistics.stdev(sums)
    return [(s - mean) / (stdev + eps) for s in sums]


def test_normalize_then_sum_equals_the_calculation_by_hand():
    rows = [[1.0, 3.0, None], [0.0, 7.0, 2.0], [1.0, None, 5.0], [0.0, 4.0, -1.0],  # group 7
            [1.0, 9.0, None], [1.0, 2.0, 4.0], [0.0, 0.5, None],                    # group -3: one score of the third
            [0.0, 1.0, 2.0],                                                        # group 5: one row
            [1.0, 1.0, None], [1.0, 1.0, None]]                                     # group 0: all equal
    groups = [7, 7, 7, 7, -3, -3, -3, 5, 0, 0]
    weights = [2.0, -0.5, 1.0]
    parts = torch.tensor([[math.nan if r is None else r for r in row] for row in rows], dtype=torch.float64)
    got = rewards.normalize_then_sum(parts, weights, torch.tensor(groups), distributed.nan_mean_std)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(gdpo_by_hand(rows, groups, weights), rel=1e-12, abs=1e-12)


def test_normalize_then_sum_weighs_rewards_by_weight_not_scale():
    """A reward's scale drops out of normalize_then_sum (up to ε): the second reward ×1000 leaves the advantages as
    they were, while the weighted sum normalised in its group follows the large reward (row 0 turns negative)."""
    from rlkernels.advantages import group_normalized

    ids = torch.tensor([0, 0, 0])
    small = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    large = small * torch.tensor([1.0, 1000.0], dtype=torch.float64)
    gdpo_small, gdpo_large = (rewards.normalize_then_sum(p, [1.0, 1.0], ids, distributed.nan_mean_std) for p in (small, large))
    assert gdpo_large.tolist() == pytest.approx(gdpo_small.tolist(), rel=1e-3) and gdpo_small[0] > 0
    assert group_normalized(small.sum(1), ids)[0] > 0 > group_normalized(large.sum(1), ids)[0]


@pytest.mark.parametrize("extra, message", [
    ({"algo": "ppo"}, "--algo ppo"), ({"algo": "snis"}, "--algo snis"), ({"tree": True}, "--tree")])
def test_normalize_then_sum_is_for_the_grpo_family(extra, message):
    with pytest.raises(ValueError, match=f"^--multi-objective-aggregation normalize_then_sum: .*{message}"):
        from_args(["--multi-objective-aggregation", "normalize_then_sum"] + [
            a for k, v in extra.items() for a in ([f"--{k}", str(v)] if v is not True else [f"--{k}"])])
    with pytest.raises(ValueError, match="^--multi-objective-aggregation: expected one of sum_then_normalize, "
                                         "normalize_then_sum, got 'sum'"):
        from_args(["--multi-objective-aggregation", "sum"])


def test_training_with_normalize_then_sum(tmp_path, monkeypatch):
    """The update trains on normalize_then_sum's advantages, DAPO's overlong penalty one more reward of weight 1."""
    from rlkernels import sampling

    seen, trained = [], []
    real_gdpo, real_head = rewards.normalize_then_sum, trainer_model.loss_head

    def gdpo(parts, weights, group_ids, batch_mean_std):
        out = real_gdpo(parts, weights, group_ids, batch_mean_std)
        seen.append((parts.clone(), list(weights), out))
        return out

    def head(model, hidden, batch, *args, **kw):
        trained.append(batch["advantages"].clone())
        return real_head(model, hidden, batch, *args, **kw)

    monkeypatch.setattr(rewards, "normalize_then_sum", gdpo)
    monkeypatch.setattr(trainer_model, "loss_head", head)
    summary, rows = run(tmp_path, steps=1, algo="dapo", overlong_buffer=1, reward_weights=[1.0, 0.5],
                        multi_objective_aggregation="normalize_then_sum",
                        reward=["exact", "test_trainer_rewards:first_digit_reward"])
    check_run(tmp_path, summary, rows, 1)
    (parts, weights, advantages), = seen
    assert weights == [1.0, 0.5, 1.0] and parts.shape[1] == 3 and parts[:, 1].isnan().any()
    assert set(parts[:, 2].tolist()) <= {0.0, -1.0}  # max_new_tokens 3, buffer 1: −1 at length 3, else 0
    assert sorted(torch.cat(trained).tolist()) == pytest.approx(sorted(advantages.float().tolist()))


# ---- reward forms and dataset columns (issue 25) -------------------------------------------------------------

def test_reward_forms(tmp_path, monkeypatch):
    """`package.module:function` (the form --help shows, refused before), `path/to/file.py:function`, TRL's dotted
    path, and the old `module:` prefix; a failure names the accepted forms."""
    (tmp_path / "myrewards.py").write_text("def per_sample(prompt, completion, answer):\n    return 1.0\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file_rewards.py").write_text("def batch(prompts, completions, **columns):\n"
                                                      "    return [2.0] * len(prompts)\n")
    monkeypatch.chdir(tmp_path)  # a module beside the run, as TRL's scripts import them
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, name in [("myrewards:per_sample", "per_sample"), ("sub/file_rewards.py:batch", "batch"),
                       ("myrewards.per_sample", "per_sample"), ("module:myrewards:per_sample", "per_sample")]:
        assert rewards.make_reward(spec).__name__ == name, spec
    for spec in ("myrewards:nope", "nowhere.py:f", "no_such_module_xyz:f"):
        with pytest.raises(ValueError, match=r"^--reward: cannot load .*; expected exact \| regex:PATTERN \| "
                                             r"package.module:function \| path/to/file.py:function"):
            rewards.make_reward(spec)


def test_every_column_reaches_trl_style_rewards_as_keywords():
    seen = {}

    def solution_reward(prompts, completions, solution, difficulty, **kwargs):  # TRL's signature, no prompts kwarg use
        seen.update(solution=solution, difficulty=difficulty, rest=sorted(kwargs))
        return [float(c == s) for c, s in zip(completions, solution)]

    def accuracy(completions, solution, **kwargs):  # TRL's own rewards have no `prompts` parameter
        return [float(c == s) for c, s in zip(completions, solution)]

    r = combined(Config(), [solution_reward, accuracy, first_digit_reward])
    rows = examples(["2+2=", "3+3="], ["4", None], solution=["4", "7"], difficulty=[1, 2])
    totals, parts = r.score(rows, ["4", "6"])
    assert parts[:2] == [[1.0, 0.0], [1.0, 0.0]] and parts[2] == [1.0, None]  # answer None: per-sample sees None
    assert seen == {"solution": ["4", "7"], "difficulty": [1, 2], "rest": ["answer"]}


def test_exact_needs_an_answer_column(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(8)))
    with pytest.raises(ValueError, match="^--reward exact: compares completions with the answer column"):
        run(tmp_path / "o", dataset=str(data), eval_size=2, warmup_steps=0)


def test_a_causal_lm_or_several_labels_is_refused_as_a_reward_model(tmp_path):
    """transformers loads a causal LM's folder as a classifier with a random score head; a run would train on it."""
    _local_checkpoint(tmp_path / "causal")
    with pytest.raises(ValueError, match=r"^--reward-model: expected a trained sequence classifier, and .*causal' "
                                         r"lacks score.weight \(transformers would initialise them at random"):
        rewards.RewardModel(str(tmp_path / "causal"), CPU)
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = _reward_model(tmp_path / "rm")
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=3, pad_token_id=0)
    ).save_pretrained(tmp_path / "rm")
    with pytest.raises(ValueError, match=r"^--reward-model: expected a sequence classifier with one label .*has 3$"):
        rewards.RewardModel(str(tmp_path / "rm"), CPU)


class TrlRewardProbe:
    """A TRL-style reward that records what it is given, and logs through log_metric and log_extra."""

    def __init__(self):
        self.steps, self.calls = [], []

    def __call__(self, prompts, completions, completion_ids, trainer_state, log_metric, log_extra, answer, **kwargs):
        self.steps.append(trainer_state.global_step)
        self.calls.append((list(completions), [list(ids) for ids in completion_ids], trainer_state.max_steps))
        log_metric("probe_len", sum(len(c) for c in completions) / len(completions))
        log_extra("probe_note", [f"n{len(c)}" for c in completions])
        return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_rewards_get_every_argument_trl_passes(tmp_path):
    """Issue 33: trainer_state, completion_ids, log_extra and log_metric were not passed (TRL 1.16 passes them)."""
    from rlkernels.trainer import task

    probe = TrlRewardProbe()
    train(Config(**{**TINY, "steps": 2, "eval_every": 1, "out": str(tmp_path)}), reward_fn=probe)
    tok = task.CharTokenizer()
    for completions, ids, max_steps in probe.calls:
        assert max_steps == 2
        # the ids are the sampled tokens up to and including the first eos; their text is the completion
        assert [tok.decode(row) for row in ids] == completions
    assert set(probe.steps) == {0, 1, 2}  # 0: evaluations before RL
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["probe_len"] >= 0 for r in rows)
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert logged and all(s["probe_note"] == f"n{len(s['completion'])}" for s in logged)


async def async_reward(prompts, completions, **kwargs):
    return [1.0 if c else 0.0 for c in completions]


def test_an_async_reward_is_awaited(tmp_path):
    """TRL awaits `async def` rewards; here their coroutine was taken as the reward (an error naming it)."""
    summary = train(Config(**{**TINY, "steps": 1, "out": str(tmp_path)}), reward_fn=async_reward)
    assert 0.0 <= summary["final_reward_mean"] <= 1.0 and 0.0 <= summary["eval_reward_before"] <= 1.0


def needs_a_column(prompts, completions, difficulty, **kwargs):
    return [0.0] * len(prompts)


def two_arguments(prompt, completion):
    return 0.0


@pytest.mark.parametrize("fn, message", [
    (needs_a_column, "--reward .*needs_a_column: parameter 'difficulty' is neither a column of the dataset "
                     r"\(answer\) nor an argument TRL passes"),
    (two_arguments, r"--reward .*two_arguments: expected \(prompt, completion, answer\) -> float, or TRL's"),
])
def test_a_reward_that_cannot_be_served_is_refused_before_any_model_loads(tmp_path, monkeypatch, fn, message):
    from rlkernels.trainer import task

    monkeypatch.setattr(task, "tiny_model", lambda *a, **k: pytest.fail("the trainer built its model"))
    with pytest.raises(ValueError, match=message):
        train(Config(**{**TINY, "out": str(tmp_path / "o")}), reward_fn=fn)
    assert not (tmp_path / "o").exists()


def test_a_column_named_as_a_trl_argument_is_refused(tmp_path):
    _local_checkpoint(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "completions": "x"}\n{"prompt": "1+2=", "completions": "y"}\n')
    cfg = Config(model=str(tmp_path / "m"), dataset=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"), steps=1,
                 progress=False)
    with pytest.raises(ValueError, match="^--dataset: column 'completions' has the name of an argument TRL passes"):
        train(cfg, reward_fn=length_reward)


@pytest.mark.parametrize("source, message", [
    ("def f(:\n", r"^--reward .*bad.py:f: .*bad.py, line 1: invalid syntax"),
    ("raise RuntimeError('no GPU')\n", r"^--reward .*bad.py:f: importing .*bad.py raised RuntimeError \(no GPU\)"),
])
def test_a_reward_file_that_fails_to_import_is_one_line(tmp_path, source, message):
    (tmp_path / "bad.py").write_text(source)
    with pytest.raises(ValueError, match=message):
        train(Config(**{**TINY, "out": str(tmp_path / "o"), "reward": [f"{tmp_path / 'bad.py'}:f"]}))


def test_resume_runs_only_the_code_the_command_line_names(tmp_path, capsys):
    """Issue 37 item 10: --resume imported the reward files (after a line) and --plugin files (silently) named in
    the checkpoint: a checkpoint from elsewhere ran its code. Now they are refused unless named again or
    --trust-checkpoint-code is given, and nothing is imported before the refusal."""
    (tmp_path / "noisy_reward.py").write_text("print('IMPORTED noisy_reward')\n"
                                              "def score(prompt, completion, answer):\n    return 0.0\n")
    (tmp_path / "noisy_plugin.py").write_text("print('IMPORTED noisy_plugin')\n")
    spec, plugin = f"{tmp_path / 'noisy_reward.py'}:score", str(tmp_path / "noisy_plugin.py")
    train(Config(**{**TINY, "steps": 1, "out": str(tmp_path / "o"), "reward": [spec], "plugin": [plugin]}))
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"^--resume: the checkpoint of .* runs code this command does not name: "
                                         r"--plugin .*noisy_plugin.py, --reward .*noisy_reward.py:score; name it "
                                         r"again .* or pass --trust-checkpoint-code"):
        train(Config(resume=str(tmp_path / "o"), steps=2, progress=False))
    assert "IMPORTED" not in capsys.readouterr().out
    train(Config(resume=str(tmp_path / "o"), steps=2, progress=False, reward=[spec], plugin=[plugin]))
    train(Config(resume=str(tmp_path / "o"), steps=3, progress=False, trust_checkpoint_code=True))
    rows = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_mask_truncated_completions_leaves_them_out_of_the_loss(tmp_path, monkeypatch):
    """Issue 40 item 3: TRL's `mask_truncated_completions` (set by DAPO recipes) was refused. A completion without
    eos trains no token; one with eos keeps its tokens up to it; both keep their reward in the group's advantages."""
    from rlkernels.trainer import generation

    trained = []
    real_head = trainer_model.loss_head

    def head(model, hidden, batch, *args, **kw):
        trained.append((batch["targets"].clone(), batch["mask"].clone(), batch["advantages"].clone()))
        return real_head(model, hidden, batch, *args, **kw)

    monkeypatch.setattr(trainer_model, "loss_head", head)
    run(tmp_path, steps=1, algo="dapo", mask_truncated_completions=True, max_new_tokens=2, eval_every=1,
        reward=["test_trainer_rewards:length_reward"])
    targets, mask, advantages = (torch.cat(x) for x in zip(*trained))
    ended = (targets == 2).any(-1)  # the demo tokenizer's eos is 2
    assert (~ended).any() and ended.any(), "the case needs both kinds of completion"
    assert not mask[~ended].any()
    assert torch.equal(mask[ended], generation.first_eos_mask(targets[ended], 2))
    assert advantages[~ended].abs().sum() > 0  # their rewards (the longest) still counted in their groups

    recipe = tmp_path / "dapo.yaml"
    recipe.write_text("loss_type: dapo\nmask_truncated_completions: true\n")
    assert from_args(["--config", str(recipe)])[0].mask_truncated_completions is True


def length_reward(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("strategy", ["no", "epoch"])
def test_save_strategy_no_and_epoch(tmp_path, monkeypatch, strategy):
    """Issue 40 item 2: TRL's save_strategy "no" and "epoch" were refused. "no" checkpoints only at the end (the
    final model is still written); "epoch" after each pass over the training prompts."""
    from rlkernels.trainer import checkpoint

    saved, real_save = [], checkpoint.save

    def save(run, step):
        saved.append((step, run.logs.ckpt_every, len(run.train_set)))
        return real_save(run, step)

    monkeypatch.setattr(checkpoint, "save", save)
    summary, rows = run(tmp_path, steps=3, ckpt_every=1, save_strategy=strategy)
    check_run(tmp_path, summary, rows, 3)
    epoch = math.ceil(saved[0][2] / TINY["prompts_per_step"])
    assert [s for s, _, _ in saved] == [3] and saved[0][1] == (3 if strategy == "no" else epoch)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"loss_type: dapo\nsave_strategy: {strategy}\n")
    assert from_args(["--config", str(recipe)])[0].save_strategy == strategy


def test_global_step_and_log_metric_follow_trl(tmp_path):
    """Issue 40 item 5: during step k's rollout `trainer_state.global_step` was k (TRL: k − 1, the optimizer steps
    taken), and log_metric calls of the evaluation before RL were averaged into step 1's row. Evaluations after
    step k see k, and their log_metric values are the row's `eval/` metrics."""
    seen = []

    def probe(prompts, completions, trainer_state, log_metric, **kwargs):
        kind = "eval" if len(completions) == 8 else "rollout"  # eval_size 8; rollouts 4 prompts × 4
        seen.append((kind, trainer_state.global_step))
        log_metric("probe", 100.0 if kind == "eval" else float(trainer_state.global_step))
        return [0.0] * len(completions)

    train(Config(**{**TINY, "steps": 2, "eval_every": 1, "eval_size": 8, "warmup_steps": 0, "out": str(tmp_path)}),
          reward_fn=probe)
    assert [s for k, s in seen if k == "rollout"] == [0, 1]
    assert [s for k, s in seen if k == "eval"] == [0, 1, 2]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["probe"], r["eval/probe"]) for r in rows] == [(0.0, 100.0), (1.0, 100.0)]


def fails_inside(prompts, completions, **kwargs):
    return [_helper_that_fails(c) for c in completions]


def _helper_that_fails(completion):
    return 1 / 0


def test_a_reward_that_raises_shows_where(tmp_path):
    """Issue 40 item 7 / 37 item 11: the error was one line without the user's file and line."""
    with pytest.raises(ValueError) as err:
        train(Config(**{**TINY, "steps": 1, "out": str(tmp_path / "o")}), reward_fn=fails_inside)
    text = str(err.value)
    assert "raised ZeroDivisionError (division by zero)" in text and "test_trainer_rewards.py" in text
    assert "in _helper_that_fails" in text and "return 1 / 0" in text and "rlkernels/trainer" not in text


def test_an_empty_dataset_and_a_metrics_folder_are_named(tmp_path):
    """Issue 37 item 11: an empty .jsonl said `(StopIteration: )`; --resume with metrics.jsonl a folder gave an
    IsADirectoryError traceback."""
    from rlkernels.trainer import data, outputs

    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"^--dataset: .*e.jsonl' is empty \(no prompts\)$"):
        data.examples(str(tmp_path / "e.jsonl"), "train", "prompt", "--dataset", "--dataset-split")
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"^--resume: .*metrics.jsonl is not a file"):
        outputs.truncate_metrics(str(tmp_path / "metrics.jsonl"), str(tmp_path / "m2.jsonl"), 1)
