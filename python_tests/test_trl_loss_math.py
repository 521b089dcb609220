"""The presets of TRL's loss types `sapo` (token and sequence level), `luspo` and `vespo` against TRL 1.16's
own `GRPOTrainer._compute_loss`, called in fp64 on fresh random log-probs (no model: a stand-in trainer hands
TRL the log-probs, so this is TRL's loss math itself), and against `reference.py`: loss and gradient.
The full trainer round trip is test_integration_trl.py's."""
from __future__ import annotations

import collections
import types

import pytest
import torch

pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

import rlkernels  # noqa: E402
from rlkernels import presets, reference  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trl_loss(logp, old_logp, adv, mask, loss_type, level="token", eps=(0.2, 0.2), **args):
    """TRL's `_compute_loss` on these log-probs: (loss, ∂loss/∂logp)."""
    return _trl_call(logp, old_logp, adv, mask, loss_type, level, eps, **args)[:2]


def _trl_call(logp, old_logp, adv, mask, loss_type, level="token", eps=(0.2, 0.2), entropy=None, **args):
    """(loss, ∂loss/∂logp, the stand-in trainer (TRL's metrics in `_metrics`), TRL's inputs) of `_compute_loss`."""
    B, T = logp.shape
    leaf = logp.clone().requires_grad_(True)
    entropy = torch.zeros_like(logp) if entropy is None else entropy
    trainer = types.SimpleNamespace(
        loss_type=loss_type, importance_sampling_level=level, beta=0.0, epsilon_low=eps[0], epsilon_high=eps[1],
        args=types.SimpleNamespace(delta=args.get("delta"), use_bias_correction_kl=False, steps_per_generation=1,
                                   sapo_temperature_pos=args.get("tau_pos", 1.0),
                                   sapo_temperature_neg=args.get("tau_neg", 1.05),
                                   vespo_k_pos=args.get("k_pos", 2.0), vespo_lambda_pos=args.get("lambda_pos", 3.0),
                                   vespo_k_neg=args.get("k_neg", 3.0), vespo_lambda_neg=args.get("lambda_neg", 2.0)),
        top_entropy_quantile=args.get("top_entropy_quantile", 1.0), off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=T, model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(), _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, entropy, None),
    )
    trainer.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trainer, *a)
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old_logp, num_items_in_batch=mask.sum().to(logp.dtype))
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss.detach(), torch.autograd.grad(loss, leaf)[0], trainer, inputs


def _inputs(B=8, T=9, spread=0.3, seed=0):
    """fp64, finite everywhere (TRL multiplies by the mask), ragged lengths, an empty row, both advantage signs."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0
    mask = torch.arange(T)[None] < lengths[:, None]
    return logp, old, adv, mask


def _ours(fn, logp, old, adv, mask, config, **counts):
    leaf = logp.clone().requires_grad_(True)
    out = fn(leaf, adv, mask, config, old_logp=old, **counts)
    loss = out.loss if hasattr(out, "loss") else out[0]
    return loss.detach(), torch.autograd.grad(loss, leaf)[0]


def _check(trl, config, logp, old, adv, mask, tol=TOL, **counts):
    for fn in (rlkernels.policy_loss, reference.policy_loss):
        loss, grad = _ours(fn, logp, old, adv, mask, config, **counts)
        torch.testing.assert_close(loss, trl[0], **tol)
        torch.testing.assert_close(grad, trl[1], **tol)
    assert trl[1].abs().sum() > 0


# TRL's grpo-style normalisers average over all B rows (the empty one included): num_seqs = B.
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
@pytest.mark.parametrize("seed", range(3))
def test_sapo(level, taus, seed):
    logp, old, adv, mask = _inputs(spread=0.5, seed=seed)
    trl = _trl_loss(logp, old, adv[:, None], mask, "sapo", level, tau_pos=taus[0], tau_neg=taus[1])
    # TRL's torch.where(A > 0, τ_pos, τ_neg) of Python floats is an fp32 tensor: τ = 1.05 is rounded (by ~4e-8);
    # with the same τ the two agree in fp64
    tau_pos, tau_neg = (float(torch.tensor(t, dtype=torch.float32)) for t in taus)
    config = presets.sapo(ratio=level, sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    _check(trl, config, logp, old, adv, mask, num_seqs=float(len(adv)))


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("seed", range(3))
def test_luspo(eps, seed):
    logp, old, adv, mask = _inputs(spread=0.01 if eps[0] < 1e-3 else 0.3, seed=seed)
    trl = _trl_loss(logp, old, adv[:, None], mask, "luspo", "sequence", eps=eps)
    config = presets.luspo(clip_low=eps[0], clip_high=eps[1])
    _check(trl, config, logp, old, adv, mask, num_seqs=float(len(adv)))


@pytest.mark.parametrize("params", [(2.0, 3.0, 3.0, 2.0), (0.5, 0.0, 1.0, 5.0)])
@pytest.mark.parametrize("spread", [0.05, 0.5])
@pytest.mark.parametrize("seed", range(3))
def test_vespo(params, spread, seed):
    logp, old, adv, mask = _inputs(spread=spread, seed=seed)
    k_pos, lambda_pos, k_neg, lambda_neg = params
    trl = _trl_loss(logp, old, adv[:, None], mask, "vespo", "token", k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                    lambda_neg=lambda_neg)
    config = presets.vespo(vespo_k_pos=k_pos, vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg,
                           vespo_lambda_neg=lambda_neg)
    _check(trl, config, logp, old, adv, mask)


def test_sapo_and_vespo_on_policy_are_reinforce():
    # SAPO's gate has f(1) = 2/τ and f'(1) = 1, VESPO's φ(1) = 1: on-policy both have REINFORCE's gradient −A.
    logp, _, adv, mask = _inputs(seed=4)
    reinforce = _ours(rlkernels.policy_loss, logp, logp, adv, mask, presets.gpg(agg="seq_mean_token_mean"))[1]
    torch.testing.assert_close(_ours(rlkernels.policy_loss, logp, logp, adv, mask, presets.sapo())[1], reinforce)
    reinforce = _ours(rlkernels.policy_loss, logp, logp, adv, mask, presets.gpg())[1]
    torch.testing.assert_close(_ours(rlkernels.policy_loss, logp, logp, adv, mask, presets.vespo())[1], reinforce)


def _adapter(trainer, inputs, logp, mask, entropy=None):
    """What the TRL adapter computes for TRL's inputs: (its `PolicyLossConfig`, counts) (not TRL's own loss:
    `loss_config` once fell back for delta <= 1), loss and gradient, and the clip metrics it logs (in
    `trainer._metrics`, cleared first)."""
    from rlkernels.integrations import trl as adapter

    config, why = adapter.loss_config(trainer)
    assert config is not None, why
    counts = adapter._counts(trainer, trainer.loss_type, mask, inputs)
    loss, grad = _ours(rlkernels.policy_loss, logp, inputs["old_per_token_logps"], inputs["advantages"].squeeze(-1),
                       mask, config, entropy=entropy, **counts)
    trainer._metrics.clear()
    adapter._log_ratio_metrics(trainer, logp, inputs, mask, config, None)
    return config, counts, loss, grad


@pytest.mark.parametrize("delta", [0.5, 1.0, 1.1, 1.5])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_delta_at_or_below_one_and_its_clip_metrics(delta, level, loss_type):
    """TRL takes any δ > 0 (INTELLECT-2's two-sided clip min(w, δ)); PolicyLossConfig once refused δ <= 1, so the
    adapter fell back to TRL's loss. TRL counts its clip metrics on the δ-clamped ratio: with δ < 1 + ε_high
    none is high-clipped (the adapter once counted the unclamped ratio)."""
    logp, old, adv, mask = _inputs(spread=0.5, seed=7)
    trl_loss, trl_grad, trainer, inputs = _trl_call(logp, old, adv[:, None], mask, loss_type, level, eps=(0.2, 0.28),
                                                    delta=delta)
    expected = {k: v for k, v in trainer._metrics["train"].items() if k.startswith("clip_ratio")}
    config, counts, loss, grad = _adapter(trainer, inputs, logp, mask)
    assert config.delta == delta
    torch.testing.assert_close(loss, trl_loss, **TOL)
    torch.testing.assert_close(grad, trl_grad, **TOL)
    _check((trl_loss, trl_grad), config, logp, old, adv, mask, **counts)  # and the reference
    got = {k: v for k, v in trainer._metrics["train"].items() if k.startswith("clip_ratio")}
    assert got.keys() == expected.keys() and len(got) == 5
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key  # TRL takes its means in fp32
    if delta < 1.28:
        assert expected["clip_ratio/high_mean"] == [0.0]


@pytest.mark.parametrize("rho", [0.0, 0.3])
def test_top_entropy_quantile_zero_keeps_the_highest_entropy_token(rho):
    """TRL's top_entropy_quantile = 0 keeps the token of the largest entropy alone; PolicyLossConfig once refused 0."""
    logp, old, adv, mask = _inputs(spread=0.3, seed=2)
    entropy = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    trl_loss, trl_grad, trainer, inputs = _trl_call(logp, old, adv[:, None], mask, "dapo", entropy=entropy,
                                                    top_entropy_quantile=rho)
    config, _, loss, grad = _adapter(trainer, inputs, logp, mask, entropy=entropy)
    assert config.top_entropy_quantile == rho
    torch.testing.assert_close(loss, trl_loss, **TOL)
    torch.testing.assert_close(grad, trl_grad, **TOL)
    if rho == 0.0:  # one token, the masked one of largest entropy, has a gradient
        top = torch.where(mask, entropy, -1.0).argmax()
        assert (grad != 0).sum() == 1 and grad.reshape(-1)[top] != 0
