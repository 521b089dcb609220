"""What a user keeps and reads (issue 25): the run folder loads with AutoModelForCausalLM and AutoTokenizer, the
plots start at the step-0 evaluation, name the reward and fit their figures, the log is short and says the
process layout, metrics come every --logging-steps, TRL's schedule and reward scaling options work, and our
own calls raise no deprecation warnings. Runs reuse test_trainer's tiny config: seconds each."""
import json
import warnings

import matplotlib
import pytest
import torch
from test_trainer import _local_checkpoint, run
from test_trainer_rewards import _reward_model

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from rlkernels import demo  # noqa: E402
from rlkernels.trainer import Config, outputs, task  # noqa: E402
from rlkernels.trainer import update as trainer_update  # noqa: E402


@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure saved, checked first: what it draws (labels, titles, tick labels) lies inside it."""
    figures, savefig = [], Figure.savefig

    def save(fig, *args, **kwargs):
        fig.canvas.draw()
        drawn, page = fig.get_tightbbox(fig.canvas.get_renderer()), fig.bbox_inches  # inches
        assert drawn.x0 >= page.x0 - 0.02 and drawn.x1 <= page.x1 + 0.02, f"cut at a side: {drawn} in {page}"
        assert drawn.y0 >= page.y0 - 0.02 and drawn.y1 <= page.y1 + 0.02, f"cut at the top or bottom: {drawn} in {page}"
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    return figures


def test_metrics_plot_starts_at_the_step_0_evaluation_and_names_the_reward(tmp_path, saved_figures):
    rows = [{"step": 1, "reward_mean": 0.2, "kl": 0.0, "entropy": 1.0, "clip_frac": 0.0},
            {"step": 2, "reward_mean": 0.3, "kl": 0.01, "entropy": 0.9, "clip_frac": 0.1, "eval_reward": 0.5}]
    assert outputs.plot(rows, "title", "0.5·exact + 1·rm", 0.25).startswith(b"\x89PNG")
    reward_axes = saved_figures[0].axes[0]
    assert reward_axes.get_title() == "reward: 0.5·exact + 1·rm"
    held_out = [line for line in reward_axes.get_lines() if line.get_label() == "held-out (greedy)"][0]
    assert list(held_out.get_xdata()) == [0, 2] and list(held_out.get_ydata()) == [0.25, 0.5]


def test_bench_png_labels_fit_the_figure(tmp_path, saved_figures):
    assert demo._draw(str(tmp_path / "d.png"), {"rlkernels": (0.01, 2**20), "plain": (0.05, 2**24)}, "GRPO loss")
    assert len(saved_figures) == 1  # the fixture checked every label against the figure's edges


def test_run_folder_loads_with_auto_classes_and_the_log_is_short(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run(tmp_path, steps=2, progress=False)
    log = capsys.readouterr().out.splitlines()
    assert len(log) <= 20 and "one process on cpu" in log[1], log
    assert not [line for line in log if len(line) > 300]  # no config repr
    tok, ours = AutoTokenizer.from_pretrained(tmp_path), task.CharTokenizer()
    assert tok("12+7=")["input_ids"] == ours.encode("12+7=")
    assert tok.decode(ours.encode("12+7=") + [ours.eos_id], skip_special_tokens=True) == "12+7="
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tok(["3+4="], return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 3  # generated, up to eos


def test_metrics_every_logging_steps_and_at_evaluations(tmp_path):
    _, rows = run(tmp_path, steps=5, eval_every=3, logging_steps=2)
    assert [r["step"] for r in rows] == [2, 3, 4, 5]  # 2 and 4; 3 and 5 evaluate (5 is the last)


def test_lr_schedule():
    cfg = Config(steps=10, lr_warmup_steps=2)
    assert [trainer_update.lr_factor(cfg, s) for s in (1, 2, 10)] == [0.5, 1.0, 1.0]
    linear = Config(steps=10, lr_warmup_steps=2, lr_scheduler_type="linear")
    # transformers' linear schedule at its step s = step - 1: (T - s) / (T - W) after the warm-up
    assert [trainer_update.lr_factor(linear, s) for s in (1, 2, 3, 4, 10)] == pytest.approx([0.5, 1.0, 1.0, 0.875, 1 / 8])
    cosine = Config(steps=6, lr_warmup_steps=0, lr_scheduler_type="cosine")
    assert trainer_update.lr_factor(cosine, 1) == 1.0 and trainer_update.lr_factor(cosine, 4) == pytest.approx(0.5)


def test_scale_rewards_batch_divides_by_every_reward_std(tmp_path, monkeypatch):
    seen = []
    real = trainer_update.minibatch_update

    def update(engine, optimizer, params, mbatch, *args, **kw):
        seen.append((mbatch["rewards"].clone(), mbatch["group_ids"].clone(), mbatch["advantages"].clone()))
        return real(engine, optimizer, params, mbatch, *args, **kw)

    monkeypatch.setattr(trainer_update, "minibatch_update", update)
    run(tmp_path, steps=1, minibatches=1, scale_rewards="batch", warmup_steps=40)
    rewards, groups, adv = seen[0]
    centered = rewards - torch.stack([rewards[groups == g].mean() for g in groups.tolist()])
    torch.testing.assert_close(adv, centered / (rewards.double().std().float() + 1e-6))


def test_no_deprecation_warnings_from_our_calls(tmp_path):
    """A --model run with a reward model and gradient checkpointing: transformers' torch_dtype (a logged warning)
    and gradient_checkpointing_enable (a FutureWarning) are deprecated, and we call their successors."""
    import logging

    from transformers.utils import logging as hf_logging

    _local_checkpoint(tmp_path / "m")
    _reward_model(tmp_path / "rm")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n" for a in (1, 2) for b in (3, 4)))
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)
    hf_logging.warning_once.cache_clear()  # said once per process: maybe already, by another test
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(tmp_path / "o", model=str(tmp_path / "m"), dataset=str(data), eval_size=2, steps=1, prompts_per_step=2,
                reward_model=str(tmp_path / "rm"), reward=["exact"], reward_weights=[1.0, 0.1],
                gradient_checkpointing=True)
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    deprecated += [m for m in logged if "deprecated" in m]
    assert not deprecated, deprecated
