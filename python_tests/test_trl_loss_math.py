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


def _trl_loss(logp, old_logp, adv, mask, loss_type, level="token", eps=(0.2, 0.2), **args):
    """TRL's `_compute_loss` on these log-probs: (loss, ∂loss/∂logp)."""
    B, T = logp.shape
    leaf = logp.clone().requires_grad_(True)
    trainer = types.SimpleNamespace(
        loss_type=loss_type, importance_sampling_level=level, beta=0.0, epsilon_low=eps[0], epsilon_high=eps[1],
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                                   sapo_temperature_pos=args.get("tau_pos", 1.0),
                                   sapo_temperature_neg=args.get("tau_neg", 1.05),
                                   vespo_k_pos=args.get("k_pos", 2.0), vespo_lambda_pos=args.get("lambda_pos", 3.0),
                                   vespo_k_neg=args.get("k_neg", 3.0), vespo_lambda_neg=args.get("lambda_neg", 2.0)),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=T, model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(), _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
    )
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old_logp, num_items_in_batch=mask.sum().to(logp.dtype))
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss.detach(), torch.autograd.grad(loss, leaf)[0]


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
