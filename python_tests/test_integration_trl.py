"""`rlkernels.integrations.trl` against TRL's own `GRPOTrainer`, on CPU, with a tiny Llama and a
word-level tokenizer built here (nothing downloaded).

* Every micro-batch of a real training run (gradient accumulation 2, stale old log-probs, KL to a
  reference model) is scored by our `_compute_loss` and by TRL's (TRL's log-probs too) for every
  loss_type × importance_sampling_level: equal loss and equal gradients of every parameter.
* Two optimizer steps with and without rlkernels, from the same seed: equal logged losses and
  equal parameters afterwards (the README's code).
"""
from __future__ import annotations

import logging
import math
import types
import warnings

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import plugin_objectives  # noqa: E402
import rlkernels  # noqa: E402
from doc_blocks import block  # noqa: E402
from op_calls import count_op_calls, forward_only_in_a_graph  # noqa: E402
from rlkernels import presets  # noqa: E402
from rlkernels.integrations import trl as rk_trl  # noqa: E402
from rlkernels.integrations.trl import RLKernelsGRPOTrainer  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(40)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: threads only add OpenMP spin-waiting, which on a loaded 2-core machine costs 10-50×."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def model_id(tmp_path_factory):
    """A tiny Llama and its tokenizer saved to a folder, so TRL can also load its reference model from it."""
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    return _saved_sharp_model(tmp_path_factory.mktemp("tiny-llama"), LlamaForCausalLM, cfg)


def _saved_sharp_model(path, model_class, cfg) -> str:
    """A tiny `model_class(cfg)` and the tokenizer saved to `path` (TRL loads its reference model from there too),
    its head sharpened so that the policy is far from uniform and the clip bites."""
    _tokenizer().save_pretrained(path)
    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset():
    return datasets.Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(8)]})


def reward_fn(completions, **kwargs):
    return [float(c.count("w7")) - 0.1 * len(c.split()) for c in completions]


def _config(tmp_path, **overrides):
    # 4 completions per prompt, 8 micro-batch rows, gradient accumulation 2; one generation serves 4 micro-batches,
    # so from the second on the old log-probs differ from the current ones. SGD: parameters follow the gradients.
    fields = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, gradient_accumulation_steps=2, steps_per_generation=4, max_steps=2,
                  learning_rate=0.5, optim="sgd", use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                  save_strategy="no", seed=0, disable_tqdm=True, beta=0.04, use_bias_correction_kl=False,
                  epsilon=0.02, epsilon_high=0.03)
    return GRPOConfig(**{**fields, **overrides})


# loss_type × importance_sampling_level × beta, with the epsilon_high each needs (TRL's cispo caps the ratio at ε_high)
CASES = [(t, lvl, 0.03, 0.04) for t in ("grpo", "bnpo", "dr_grpo", "dapo") for lvl in ("token", "sequence")]
CASES += [("cispo", "token", 1.02, 0.04), ("dapo", "token", 0.03, 0.0), ("grpo", "sequence", 0.03, 0.0)]
CASES += [("cispo", "sequence", 1.02, 0.04), ("cispo", "token", 0.9, 0.0)]  # a cap below 1 on token ratios
CASES += [(t, lvl, 0.03, 0.04) for t in ("sapo", "luspo") for lvl in ("token", "sequence")]
CASES += [("vespo", "token", 0.03, 0.04)]
IS_CASES = [c for c in CASES[::3] if c[0] != "vespo"]
# TRL's vespo folds vLLM IS into its sequence ratio, and takes the token-level modes only
VESPO_IS_CASE = ("vespo", "token", 0.03, 0.04)
OPSM_CASES = [("dapo", "token", 0.03, 0.04), ("grpo", "sequence", 0.03, 0.04), ("cispo", "token", 1.02, 0.04)]
# ragged completions, where TRL's metrics count rows at sequence level and tokens at token level
RAGGED_CASES = [("grpo", "sequence", 0.03, 0.04), ("dapo", "token", 0.03, 0.04), ("cispo", "sequence", 1.02, 0.0)]
# TRL's entropy bonus is its own token mean, apart from every loss type's aggregation
ENTROPY_CASES = [("dapo", "token", 0.03, 0.04), ("bnpo", "sequence", 0.03, 0.0), ("cispo", "token", 1.02, 0.04),
                 ("vespo", "token", 0.03, 0.04), ("grpo", "sequence", 0.03, 0.04), ("dr_grpo", "token", 0.03, 0.0),
                 ("sapo", "token", 0.03, 0.04), ("luspo", "sequence", 0.03, 0.04)]


def _grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("bf16", [False, True])
def test_every_micro_batch_matches_trl(model_id, dataset, tmp_path, bf16):
    """bf16: TRL's default, autocast on CPU; the head's matmul in bf16 on both sides, so looser tolerances."""
    trainer = RLKernelsGRPOTrainer(model=model_id, reward_funcs=reward_fn, args=_config(tmp_path, bf16=bf16),
                                   train_dataset=dataset)
    ours_fn = trainer._compute_loss
    trl_logps = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    seen, clipped = [], 0.0

    def compare(model, inputs, params, loss_type, level, eps_high, beta, what="", between=None):
        nonlocal clipped
        trainer.loss_type, trainer.importance_sampling_level, trainer.epsilon_high = loss_type, level, eps_high
        trainer.beta = beta
        assert rk_trl.loss_config(trainer)[0] is not None, rk_trl.loss_config(trainer)[1]
        logged = trainer._metrics["train"]
        before = {k: len(v) for k, v in logged.items()}
        ours = ours_fn(model, inputs)
        ours_logged = {k: len(v) for k, v in logged.items()}
        ours_grads = _grads(ours, params)
        if between is not None:
            between()
        trainer._get_per_token_logps_and_entropies = trl_logps  # TRL all the way down
        try:
            ref = GRPOTrainer._compute_loss(trainer, model, inputs)
        finally:
            del trainer._get_per_token_logps_and_entropies
        ref_grads = _grads(ref, params)
        tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ours.detach(), ref.detach(), **tol, msg=f"{loss_type}/{level}{what}")
        for key, values in logged.items():  # the same metrics, by the same definitions
            n_ours = ours_logged.get(key, 0) - before.get(key, 0)
            n_trl = len(values) - ours_logged.get(key, 0)
            assert n_ours == n_trl, f"{key}: {loss_type}/{level}{what}"
            if n_ours:
                a, b = torch.tensor(values[-2]), torch.tensor(values[-1])
                torch.testing.assert_close(a, b, rtol=2e-2 if bf16 else 1e-5, atol=2e-2 if bf16 else 1e-6,
                                           equal_nan=True, msg=f"{key}: {loss_type}/{level}{what}")
        for p, a, b in zip(params, ours_grads, ref_grads):
            scale = b.abs().max().item() + 1e-12
            assert (a - b).abs().max().item() <= (3e-2 if bf16 else 1e-5) * scale, f"{loss_type}/{level}{what}"
        seen.append((loss_type, level, "old_per_token_logps" in inputs))
        clipped = max(clipped, trainer._metrics["train"]["clip_ratio/region_mean"][-1])

    def checked(model, inputs):
        params = [p for p in model.parameters() if p.requires_grad]
        for case in CASES if not bf16 else CASES[::4]:
            compare(model, inputs, params, *case)
        if not bf16:  # TRL's unbiased KL (the k3 times the token ratio, with its gradient)
            trainer.args.use_bias_correction_kl = True
            try:
                for case in CASES:  # token level: the token ratio; sequence level: the row's
                    if case[3] != 0:
                        compare(model, inputs, params, *case, what=" use_bias_correction_kl")
            finally:
                trainer.args.use_bias_correction_kl = False
        if not bf16:  # DeepSeek-V3.2's off-policy sequence mask, against the old or the sampler's log-probs
            g = torch.Generator().manual_seed(len(seen))
            old = inputs.get("old_per_token_logps")
            try:
                # thresholds away from 0: at an on-policy point the gap is 0 for us and TRL's rounding for TRL
                for threshold, sampled in ((-0.01, False), (0.05, True)):
                    trainer.off_policy_mask_threshold = threshold
                    if sampled and old is not None:  # vLLM's log-probs, NaN where it could not score a token
                        noisy = old + 0.2 * torch.randn(old.shape, generator=g)
                        nan = torch.rand(old.shape, generator=g) < 0.1
                        inputs["sampling_per_token_logps"] = noisy.masked_fill(nan, float("nan"))
                    for case in OPSM_CASES:
                        compare(model, inputs, params, *case, what=f" off-policy mask {threshold}")
            finally:
                trainer.off_policy_mask_threshold = None
                inputs.pop("sampling_per_token_logps", None)
        if not bf16:  # the 80/20 rule: only the highest-entropy tokens keep their policy term
            try:
                for rho in (0.2, 0.5):
                    trainer.top_entropy_quantile = rho
                    for case in OPSM_CASES:
                        compare(model, inputs, params, *case, what=f" top_entropy_quantile {rho}")
            finally:
                trainer.top_entropy_quantile = 1.0
        if not bf16:  # vLLM importance sampling correction, as TRL's four modes leave the ratio: per token or per row
            B, T = inputs["completion_mask"].shape
            g = torch.Generator().manual_seed(len(seen))
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
            try:
                for shape in ((B, T), (B, 1)):
                    ratio = torch.rand(shape, generator=g) * 1.6
                    ratio = ratio.masked_fill(ratio < 0.3, 0.0)  # the mask modes' zeros
                    if shape == (B, T):  # padding: TRL's ratio there is e^0 = 1 (its log-prob difference is masked)
                        ratio = torch.where(inputs["completion_mask"].bool(), ratio, 1.0)
                    inputs["importance_sampling_ratio"] = ratio
                    for case in IS_CASES + ([VESPO_IS_CASE] if shape == (B, T) else []):
                        compare(model, inputs, params, *case, what=f" vLLM IS {tuple(shape)}")
            finally:
                trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
                inputs.pop("importance_sampling_ratio", None)
        if not bf16:
            full = inputs["completion_mask"]
            ragged = full.clone()
            ragged[::2, -3:] = 0
            inputs["completion_mask"] = ragged
            try:
                for case in RAGGED_CASES:
                    compare(model, inputs, params, *case, what=" ragged completions")
            finally:
                inputs["completion_mask"] = full
            trainer.entropy_coef, trainer._entropy_bonus_enabled = 0.05, True
            try:
                for case in ENTROPY_CASES:
                    compare(model, inputs, params, *case, what=" entropy bonus")
                trainer.top_entropy_quantile = 0.5  # the bonus on the same high-entropy tokens as the policy term
                for case in (ENTROPY_CASES[0], ENTROPY_CASES[4]):
                    compare(model, inputs, params, *case, what=" entropy bonus, top_entropy_quantile 0.5")
                trainer.top_entropy_quantile = 1.0
                # the adaptive coefficient: applied while the last window's entropy is at or below the target,
                # moved at each optimizer step; our call and TRL's start from the same controller state
                trainer.use_adaptive_entropy, trainer.args.entropy_target = True, 10.0
                for last_entropy in (0.5, float("inf")):
                    state = (trainer.entropy_coef, last_entropy, None)
                    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = state
                    moved = []

                    def between():
                        moved.append((trainer.entropy_coef, trainer._last_world_entropy))
                        trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = state

                    compare(model, inputs, params, *ENTROPY_CASES[4], what=f" adaptive bonus {last_entropy}",
                            between=between)
                    moved.append((trainer.entropy_coef, trainer._last_world_entropy))
                    assert moved[0][0] == pytest.approx(moved[1][0]) and moved[0][1] == pytest.approx(moved[1][1])
            finally:
                trainer.entropy_coef, trainer._entropy_bonus_enabled = 0.0, False
                trainer.use_adaptive_entropy, trainer.top_entropy_quantile = False, 1.0
        trainer.loss_type, trainer.importance_sampling_level, trainer.epsilon_high, trainer.beta = "dapo", "token", 0.03, 0.04
        return ours_fn(model, inputs)

    trainer._compute_loss = checked
    trainer.train()
    bias_cases = sum(1 for _, level, _, beta in CASES if beta != 0)
    expected = len(CASES) + bias_cases + 2 * len(IS_CASES) + 1 + 4 * len(OPSM_CASES) + len(ENTROPY_CASES) + 2 + \
        len(RAGGED_CASES) + 2 \
        if not bf16 else len(CASES[::4])
    assert len(seen) == 4 * expected  # 2 steps × 2 micro-batches
    assert any(old for _, _, old in seen), "some micro-batches are off-policy"
    assert clipped > 0, "the clip is active somewhere"


def _losses_and_params(trainer):
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_two_steps_with_and_without_rlkernels(model_id, dataset, tmp_path):
    """The README's TRL example against a plain GRPOTrainer, from the same seed: dapo (TRL's default loss),
    KL to a reference model, gradient accumulation 2, two SGD steps."""
    grpo_config = _config(tmp_path)
    plain = GRPOTrainer(model=model_id, reward_funcs=reward_fn, args=grpo_config, train_dataset=dataset)
    plain.train()
    ref_losses, ref_params = _losses_and_params(plain)

    namespace = dict(model_id=model_id, reward_fn=reward_fn, grpo_config=grpo_config, dataset=dataset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(block("trl", "docs/integrations.md"), namespace)  # builds RLKernelsGRPOTrainer, then patches a GRPOTrainer and trains it
    assert not [w for w in caught if "TRL computes this loss itself" in str(w.message)], "the fused path ran"
    losses, params = _losses_and_params(namespace["trainer"])

    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-6, msg=name)
    start = LlamaForCausalLM.from_pretrained(model_id).state_dict()
    assert max((ref_params[n] - start[n]).abs().max().item() for n in ref_params) > 1e-3, "the steps moved the model"


def test_no_forward_in_a_graph_without_its_backward(model_id, dataset, tmp_path, monkeypatch):
    """Issue 37's memory section: the drop-in's forward-only calls (old and reference log-probs) build no graph, so
    the two-pass path never writes an N × V gradient that no backward reads."""
    calls = count_op_calls(monkeypatch, rk_trl, ("linear_token_logprobs", "fused_linear_policy_loss"))
    RLKernelsGRPOTrainer(model=model_id, reward_funcs=reward_fn, args=_config(tmp_path, max_steps=1),
                         train_dataset=dataset).train()
    assert any(c["graph"] for c in calls) and not all(c["graph"] for c in calls)
    assert not forward_only_in_a_graph(calls)


def test_fallbacks_warn_and_keep_trl_loss(model_id, dataset, tmp_path, monkeypatch):
    args = _config(tmp_path, loss_type="grpo", importance_sampling_level="sequence", use_bias_correction_kl=True)
    trainer = RLKernelsGRPOTrainer(model=model_id, reward_funcs=reward_fn, args=args, train_dataset=dataset)
    assert rk_trl.loss_config(trainer)[0].kl_bias_ratio == "sequence"  # mapped
    trainer._entropy_bonus_enabled, trainer.top_entropy_quantile = True, 0.5  # the bonus on the top tokens: mapped
    assert rk_trl.loss_config(trainer)[0] is not None
    with monkeypatch.context() as m:  # TRL's quantile spans every process's tokens: so does the call's
        m.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
        assert rk_trl.loss_config(trainer)[0] is not None
        assert rk_trl._quantile_group(trainer) is torch.distributed.group.WORLD
    trainer._entropy_bonus_enabled, trainer.top_entropy_quantile = False, 1.0
    monkeypatch.setattr(rk_trl, "loss_config", lambda trainer: (None, "a reason of this test"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()  # TRL's own loss on rlkernels' log-probs
    assert any("TRL computes this loss itself" in str(w.message) for w in caught)


def test_config_mapping(model_id, dataset, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlkernels")
    trainer = RLKernelsGRPOTrainer(model=model_id, reward_funcs=reward_fn, train_dataset=dataset,
                                   args=_config(tmp_path, loss_type="dr_grpo", delta=1.5, beta=0.0))
    # issue 40 item 8: the drop-in says once which loss replaces TRL's
    said = [r.getMessage() for r in caplog.records if r.name == "rlkernels"]
    assert said == ["rlkernels: loss_type='dr_grpo' (importance_sampling_level='token') is computed by rlkernels' "
                    "fused_linear_policy_loss: objective clip, ratio token, agg constant, clip (0.02, 0.03)"], said
    cfg, _ = rk_trl.loss_config(trainer)
    assert (cfg.agg, cfg.norm_length, cfg.delta, cfg.kl_coef) == ("constant", 6, 1.5, 0.0)
    assert (cfg.clip_low, cfg.clip_high) == (0.02, 0.03)


def test_softcapped_head_matches_trl(dataset, tmp_path):
    """Gemma 2's final-logit cap c·tanh(z/c) is the kernels' softcap: loss and gradients equal TRL's, whose
    log-probs come from model(...).logits (the cap at 5 binds on this head)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=5.0,
                       max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    path = _saved_sharp_model(tmp_path / "tiny-gemma2", Gemma2ForCausalLM, cfg)
    trainer = RLKernelsGRPOTrainer(model=path, reward_funcs=reward_fn, train_dataset=dataset,
                                   args=_config(tmp_path, loss_type="grpo", max_steps=1))
    _each_loss_matches_trl(trainer)


def _each_loss_matches_trl(trainer, also=lambda: None):
    """Train `trainer`; at every micro-batch its loss and gradients equal GRPOTrainer's own on the same inputs
    (then `also()` checks more)."""
    ours_fn = trainer._compute_loss
    trl_logps = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    seen = []

    def checked(model, inputs):
        params = [p for p in model.parameters() if p.requires_grad]
        ours = ours_fn(model, inputs)
        ours_grads = _grads(ours, params)
        trainer._get_per_token_logps_and_entropies = trl_logps
        try:
            ref = GRPOTrainer._compute_loss(trainer, model, inputs)
        finally:
            del trainer._get_per_token_logps_and_entropies
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-7)
        for p, a, b in zip(params, ours_grads, _grads(ref, params)):
            if a is None or b is None:
                assert a is None and b is None
                continue
            assert (a - b).abs().max().item() <= 1e-5 * (b.abs().max().item() + 1e-12)
        also()
        seen.append(1)
        return ours_fn(model, inputs)

    trainer._compute_loss = checked
    trainer.train()
    assert seen


class _CappedLlama(LlamaForCausalLM):
    """A forward that caps its logits with no config attribute announcing it."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if getattr(out, "logits", None) is not None:
            out.logits = 3 * torch.tanh(out.logits / 3)
        return out


def test_refuses_a_head_that_transforms_its_logits_unannounced(model_id, dataset, tmp_path):
    model = _CappedLlama.from_pretrained(model_id)
    trainer = RLKernelsGRPOTrainer(model=model, reward_funcs=reward_fn, train_dataset=dataset,
                                   processing_class=_tokenizer(), args=_config(tmp_path, beta=0.0))
    with pytest.raises(ValueError, match="_CappedLlama.*nats away"):
        trainer.train()


def test_moe_auxiliary_loss_matches_trl(dataset, tmp_path):
    """A mixture-of-experts model: the load-balancing loss, formed from the backbone's router logits as the
    model's own forward forms it, is added as TRL adds it (loss, gradients and the `aux_loss` metric)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                        output_router_logits=True, router_aux_loss_coef=0.3)
    path = _saved_sharp_model(tmp_path / "tiny-mixtral", MixtralForCausalLM, cfg)
    trainer = RLKernelsGRPOTrainer(model=path, reward_funcs=reward_fn, train_dataset=dataset,
                                   args=_config(tmp_path, loss_type="dapo", max_steps=1))
    assert trainer.aux_loss_enabled and rk_trl.loss_config(trainer)[0] is not None

    def aux_logged():
        aux = trainer._metrics["train"]["aux_loss"]
        assert aux[-1] > 0 and abs(aux[-2] - aux[-1]) <= 1e-6 * aux[-1]

    _each_loss_matches_trl(trainer, aux_logged)


# ---- a user's objective and preset (python_tests/plugin_objectives.py): loss_type="rlkernels_<preset>" -------------
@pytest.mark.parametrize("preset,beta", [("my_dapo", 0.04), ("my_seq", 0.0)])
def test_a_users_preset_is_a_trl_loss_type(model_id, dataset, tmp_path, preset, beta):
    """Every micro-batch of a real run with `loss_type="rlkernels_<preset>"`: loss and gradient of every parameter
    equal the preset called directly (`fused_policy_loss` on the model's own logits, TRL's β as its KL and TRL's
    normaliser: the token mean over an accumulation window for `token_mean`, the mean over its B·G rows for
    `seq_mean_token_mean`)."""
    with plugin_objectives.registered(preset):
        args = _config(tmp_path, loss_type=f"rlkernels_{preset}", beta=beta)
        trainer = RLKernelsGRPOTrainer(model=model_id, reward_funcs=reward_fn, args=args, train_dataset=dataset)
        ours_fn, seen = trainer._compute_loss, []
        config = presets.get(preset, **(dict(kl_estimator="k3", kl_coef=beta) if beta else {}))

        def checked(model, inputs):
            params = [p for p in model.parameters() if p.requires_grad]
            ours = ours_fn(model, inputs)
            ours_grads = _grads(ours, params)
            prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
            mask = inputs["completion_mask"].bool()
            logits = model(input_ids=torch.cat([prompt, completion], 1),
                           attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)).logits
            rows, accum = mask.shape[0], args.gradient_accumulation_steps
            # num_items_in_batch counts the tokens of a whole generation (steps_per_generation micro-batches)
            counts = (dict(num_items=float(inputs["num_items_in_batch"]) * accum / args.steps_per_generation)
                      if config.agg == "token_mean" else dict(num_seqs=float(rows * accum)))
            direct = rlkernels.fused_policy_loss(
                logits[:, -completion.size(1) - 1:-1] / trainer.temperature, completion, inputs["advantages"], mask,
                config, old_logp=inputs.get("old_per_token_logps"), ref_logp=inputs.get("ref_per_token_logps"),
                **counts)
            assert direct.loss.abs() > 1e-6, "a vacuous comparison"
            torch.testing.assert_close(ours.detach(), direct.loss.detach(), rtol=1e-5, atol=1e-7)
            for p, a, b in zip(params, ours_grads, _grads(direct.loss, params)):
                if b is not None:
                    assert (a - b).abs().max().item() <= 1e-5 * (b.abs().max().item() + 1e-12)
            seen.append("old_per_token_logps" in inputs)
            return ours_fn(model, inputs)  # a fresh graph for the training step

        trainer._compute_loss = checked
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    assert not [w for w in caught if "TRL computes this loss itself" in str(w.message)]
    assert len(seen) == 4 and any(seen), "2 steps × 2 micro-batches, some off-policy"


def test_a_users_preset_errors_name_the_setting(model_id, dataset, tmp_path):
    """An unknown preset, one TRL cannot feed (whole prompt groups) and one unregistered after the trainer was built:
    ValueErrors naming loss_type (and the registered presets), at construction where they can be; TRL's own loss
    types keep their meaning (`rk_trl.preset_of` is None for them)."""
    def build(loss_type, trainer_class=RLKernelsGRPOTrainer):
        return trainer_class(model=model_id, reward_funcs=reward_fn, args=_config(tmp_path, loss_type=loss_type),
                             train_dataset=dataset)

    with plugin_objectives.registered("my_dapo"):
        with pytest.raises(ValueError, match=r"loss_type: expected one of TRL's .*'my_dapo'.*got 'rlkernels_nope'"):
            build("rlkernels_nope")
        with pytest.raises(ValueError, match=r"loss_type: expected one of TRL's .*got 'rlkernels_nope'"):
            rk_trl.patch_trl_grpo_trainer(build("rlkernels_nope", GRPOTrainer))
        with pytest.raises(ValueError, match=r"loss_type='rlkernels_gepo'.*ratio='group_expectation'"):
            build("rlkernels_gepo")
        trainer = build("rlkernels_my_dapo")
        assert rk_trl.loss_config(trainer)[0] == presets.get("my_dapo", kl_estimator="k3", kl_coef=0.04)
    with pytest.raises(ValueError, match=r"loss_type: expected one of TRL's .*got 'rlkernels_my_dapo'"):
        rk_trl.loss_config(trainer)
    assert all(rk_trl.preset_of(t) is None for t in rk_trl._AGG)
