"""The loss of a sequence-level ratio at given log-probs, in a few launches and without autograd.

Once the forward pass has given every ℓ and H, a sequence-level loss is the token-level KL and
entropy terms plus a surrogate that couples the tokens of a row (docs/math.md §5). Both are
evaluated by the backend's `policy_token_loss` (the same per-token formula as the fused forward
kernel, `csrc/include/rlkernels/token_loss.h` and the Triton `token_loss`):

* the KL and entropy terms: once over the tokens, without advantages (A = 0 in the clip objective, whose
  −A·w is 0 whatever ℓ: `token_terms_params`), except that SNIS's surrogate, REINFORCE, comes in it as the
  advantage (`_snis`);
* the surrogate: once over the rows, the row's log-ratio as its "log-prob" (GSPO, GEPO: the clip
  objective, or SAPO's gate, of the mean log-ratio; FSPO: the clip objective of the summed log-ratio
  at its band's edge), its derivative passed to the row's tokens through the row's mean or sum of ℓ;
  or once over the tokens where the surrogate is per token with a row's value (GSPO-token: the clip
  objective or SAPO's gate at the clamped sequence log-ratio; VESPO and sequence-level CISPO: REINFORCE
  with A·φ(w_i) or A·clamp(s_i); GMPO: the log-space clip of each token, from which its row's geometric
  mean is formed).

Token-level configs come here too when their surrogate weights ω need ℓ or H first (the off-policy mask,
`top_entropy_quantile`): the token's own surrogate over the tokens, times ω in the op.

A surrogate is per row only when its loss is the same on every token of the row (then its
aggregation is W_i·loss_i, W_i = Σ_t w_agg·ω). What the row values are (means, group log-sums,
SNIS's coefficient, VESPO's φ) is computed by the functions of `losses/surrogates.py`, the spec.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from ..kernels.token_loss_params import CLIP_FLAGS, SURROGATE_STATS, Stat
from ..losses import LossOutput, PolicyLossConfig
from ..losses.spec import (LossInputs, aggregation_weights, cispo_weight, gepo_log_expectation, metrics_from_sums,
                           objectives, snis_advantage, surrogate_weights, vespo_weight)
from ._token_stats import loss_from_stats
from .kernel_params import log_band_params, surrogate_params, token_terms_params



def sequence_step(kernels, logp: Tensor, entropy: Tensor, inputs: LossInputs, config: PolicyLossConfig,
                  high_entropy: Optional[Tensor] = None):
    """(the loss and metrics, ∂loss/∂ℓ flat, ∂loss/∂H flat or None) at flat `(N,)` log-probs and entropies;
    `high_entropy`: the tokens `top_entropy_quantile` keeps (`losses.policy_loss.high_entropy_tokens`), or None."""
    mask = inputs.mask
    B, T = mask.shape
    zero = logp.new_zeros(())
    flat_mask = mask.reshape(-1)
    rows = _Rows(logp.view(B, T), inputs, zero)
    weights = aggregation_weights(mask, config.agg, num_items=inputs.num_items, num_seqs=inputs.num_seqs,
                                  norm_length=config.norm_length, dtype=logp.dtype, lengths=rows.lengths)
    omega = _surrogate_weights(logp, entropy, inputs, config, high_entropy)  # (B, T) or None, 0 where masked
    adv, snis_ratio = _snis(rows, omega, inputs, config) if config.ratio == "snis" else (None, None)
    tok_grad, tok_grad_h, tok_stats = kernels.policy_token_loss(
        logp, entropy, flat_mask, weights.view(-1), adv, inputs.flat("old_logp"), inputs.flat("ref_logp"),
        token_terms_params(config, reinforce=adv is not None))
    grad_h = tok_grad_h if config.entropy_coef != 0 else None
    if snis_ratio is not None:  # its ratio statistic is the row's ρ_i on each token, not the token's own ratio
        torch.where(mask, snis_ratio[:, None], zero, out=tok_stats[:, Stat.RATIO].view(B, T))
        return loss_from_stats(tok_stats, inputs), tok_grad, grad_h

    surrogate = (_weighted_token if config.ratio == "token" else
                 EVALUATORS[objectives.get(config.objective).sequence_steps[config.ratio]])
    sur_grad, sums, ratio_max = surrogate(kernels, logp, rows, weights, omega, inputs, config)

    tok_sums = tok_stats.sum(0)
    # the loss of both calls, the surrogate's clip flags and ratio, the token call's KL and entropy
    sums = torch.cat([tok_sums[:Stat.CLIP_LOW] + sums[:Stat.CLIP_LOW], sums[Stat.CLIP_LOW:Stat.APPROX_KL],
                      tok_sums[Stat.APPROX_KL:]])
    metrics = metrics_from_sums(sums[Stat.CLIP_LOW:], rows.lengths.sum().clamp(min=1), ratio_max, has_entropy=True)
    return LossOutput(sums[Stat.LOSS], metrics), tok_grad + sur_grad, grad_h


class _Rows:
    """Row sums of a `(B, T)` batch, each formed when first read (every one is a launch or two)."""

    def __init__(self, logp: Tensor, inputs: LossInputs, zero: Tensor):
        self.logp, self.mask, self.old_logp, self.zero = logp, inputs.mask, inputs.old_logp, zero
        self.lengths = self.mask.sum(-1, dtype=logp.dtype)  # L_i

    @functools.cached_property
    def valid(self) -> Tensor:
        """L_i > 0."""
        return self.lengths > 0

    @functools.cached_property
    def divisor(self) -> Tensor:
        """max(L_i, 1)."""
        return self.lengths.clamp(min=1)

    def masked_sum(self, x) -> Tensor:
        return torch.where(self.mask, x, self.zero).sum(-1)

    def means(self, *others: Tensor) -> Tensor:
        """(k, B): the row means Σ_t m x / max(L, 1) of ℓ, of ℓ_old (ℓ again on-policy) and of `others` (B, T), in
        one reduction."""
        old = self.logp if self.old_logp is None else self.old_logp
        return self.masked_sum(torch.stack([self.logp, old, *others])) / self.divisor

    @functools.cached_property
    def log_ratio_sum(self) -> Tensor:
        """Σ_t m (ℓ − ℓ_old), summed as differences (not S − S_old, which cancels), as `losses/` does."""
        return self.zero.expand(self.mask.shape[0]) if self.old_logp is None else self.masked_sum(self.logp - self.old_logp)

    def to_tokens(self, row_grad: Tensor) -> Tensor:
        """∂/∂ℓ of each token (flat) from ∂/∂S of its row: S = Σ_t m ℓ."""
        return torch.where(self.mask, row_grad[:, None], self.zero).reshape(-1)


def _surrogate_weights(logp, entropy, inputs: LossInputs, config: PolicyLossConfig,
                       high_entropy: Optional[Tensor]) -> Optional[Tensor]:
    """ω of docs/math.md §7 (importance weights times the off-policy and entropy masks), 0 where masked.
    (VESPO's importance weights are in its ratio, not here: `losses.policy_loss.surrogate_weights`.)"""
    if config.off_policy_mask is None and config.top_entropy_quantile is None:
        if inputs.is_weights is None or objectives.get(config.objective).weights_in_ratio:
            return None
        return torch.where(inputs.mask, inputs.is_weights, 0.0)
    B, T = inputs.mask.shape
    b, _, _ = inputs.masked(logp.view(B, T), entropy.view(B, T), config)
    return surrogate_weights(b, inputs, config, high_entropy)


def _snis(rows: _Rows, omega, inputs: LossInputs, config):
    """(A flat, ρ) of SNIS in the KL and entropy terms' call, REINFORCE: its loss −coef_i·S_i·W_i (S_i = Σ_t m ℓ,
    W_i = Σ_t w_agg·ω) is −A·ℓ per token weighted w_agg, with A = coef_i·Σ_t m ω (w_agg is the same on every token
    of a row, docs/math.md §8); ρ_i = e^clamp(Σ_t m (ℓ − ℓ_old)) is its ratio statistic (the coefficient takes
    the log-ratio unclamped)."""
    c = config.log_ratio_clamp
    log_rho = rows.log_ratio_sum
    coef = snis_advantage(log_rho, inputs.rewards, inputs.group, inputs.num_groups, rows.valid,
                          inputs.group_size)
    counted = rows.lengths if omega is None else omega.sum(-1)
    adv = coef[:, None] * counted[:, None].expand(rows.mask.shape)  # one product, already (B, T)
    return adv.view(-1), torch.exp(log_rho.clamp(-c, c))


@dataclasses.dataclass
class _RowInputs:
    """A per-row surrogate as `policy_token_loss` takes it over the rows: the row's "log-prob" x and its x_old, the
    advantage, the objective (or its params), and how its results map back (module docstring)."""

    x: Tensor
    x_old: Optional[Tensor]
    adv: Tensor
    objective: str = "clip"
    params: object = None  # the op's params when not surrogate_params(config, objective)
    grad_scale: Optional[Tensor] = None  # ∂x/∂ℓ_t·L_i when x is not a row mean (the same on each of the row's tokens)
    row_weight: Optional[Tensor] = None  # W_i / L_i when formed with the row means
    ratio_scale: Optional[Tensor] = None  # the ratio statistic is the op's times this


class _PerRow:
    """A surrogate with one value per row: `policy_token_loss` over the rows, row i weighted W_i / L_i, so that
    its statistics count once per token (Σ_i L_i·stats_i) and its derivative w.r.t. a row mean is each token's.
    Each subclass says what the rows are (`row_inputs`)."""

    def row_inputs(self, rows: _Rows, w: Tensor, inputs: LossInputs, config) -> _RowInputs:
        raise NotImplementedError

    def __call__(self, kernels, logp, rows: _Rows, weights, omega, inputs: LossInputs, config):
        w = weights if omega is None else weights * omega
        r = self.row_inputs(rows, w, inputs, config)
        row_weight = w.sum(-1) / rows.divisor if r.row_weight is None else r.row_weight
        x_old = None if r.x_old is None else r.x_old.contiguous()
        row_grad, _, stats = kernels.policy_token_loss(r.x.contiguous(), None, rows.valid, row_weight,
                                                       r.adv.contiguous(), x_old, None,
                                                       r.params or surrogate_params(config, r.objective))
        grad = rows.to_tokens(row_grad if r.grad_scale is None else row_grad * r.grad_scale)
        if r.ratio_scale is not None:
            stats[:, Stat.RATIO].mul_(r.ratio_scale)
        # Each row's values count once per token: its clip flags on the tokens with ω > 0 (docs/math.md §10).
        counted = None if omega is None else (omega > 0).sum(-1).to(stats.dtype)
        return grad, _row_sums(stats, counted, rows.lengths), _max(stats[:, Stat.RATIO])


class _Gspo(_PerRow):
    """GSPO, LUSPO: the clip objective (or SAPO's gate) of the mean log-ratio."""

    def row_inputs(self, rows, w, inputs, config):
        x = rows.log_ratio_sum / rows.divisor
        return _RowInputs(x, torch.zeros_like(x), inputs.adv_row, config.objective)


class _Fspo(_PerRow):
    """FSPO: the clip objective of s = clamp(Σ_t m (ℓ − ℓ_old)) in the band ±c·√L. Only the edge on A's side binds:
    the clip objective at the ratio e^(s − edge) with bounds 1 and advantage A·e^edge. The edge is clamped to
    [−c, c] (s lies there, so nothing changes; e^edge stays finite)."""

    def row_inputs(self, rows, w, inputs, config):
        c = config.log_ratio_clamp
        raw = rows.log_ratio_sum
        x = raw.clamp(-c, c)
        root = rows.lengths.sqrt()
        edge = torch.where(inputs.adv_row > 0, root * config.fspo_c_high, root * -config.fspo_c_low).clamp(-c, c)
        ratio_scale = torch.exp(edge)  # the op's ratio is e^(s − edge)
        return _RowInputs(x, edge, inputs.adv_row * ratio_scale,
                          params=log_band_params(config, 0.0, 0.0, 2 * c + 1),  # |s − edge| ≤ 2c: nothing more
                          grad_scale=torch.where(raw == x, rows.lengths, rows.zero),  # where s's clamp passes it
                          ratio_scale=ratio_scale)


class _Gepo(_PerRow):
    """GEPO: the clip objective of mean ℓ − log Ê_g."""

    def row_inputs(self, rows, w, inputs, config):
        x, old_mean, row_weight = rows.means(w)  # w: 0 where masked
        x_old = gepo_log_expectation(old_mean, inputs.group, inputs.num_groups, rows.valid, inputs.group_size)
        return _RowInputs(x, x_old, inputs.adv_row, row_weight=row_weight)


def _row_sums(stats: Tensor, counted: Optional[Tensor], lengths: Tensor) -> Tensor:
    """(loss, clip_low, clip_high, ratio) summed over tokens from the per-row stats of rows weighted W_i / L_i:
    each counts on the row's L_i tokens, except the clip flags on `counted` of them when given (ω > 0)."""
    if counted is None:
        return torch.mv(stats[:, SURROGATE_STATS].T, lengths)
    return (stats[:, SURROGATE_STATS] * torch.stack([lengths, counted, counted, lengths], 1)).sum(0)


def _weighted_token(kernels, logp, rows: _Rows, weights, omega, inputs: LossInputs, config):
    """A token-level surrogate with weights ω: the token's own surrogate, times ω in the kernel (its flags where
    ω > 0)."""
    grad, _, stats = kernels.policy_token_loss(
        logp, None, rows.mask.reshape(-1), weights.reshape(-1), inputs.flat("adv"), inputs.flat("old_logp"),
        None, surrogate_params(config, config.objective), is_weights=None if omega is None else omega.reshape(-1))
    return grad, stats[:, SURROGATE_STATS].sum(0), _max(stats[:, Stat.RATIO])


# The per-token surrogates with a row's value below take ω folded into A: exact for them (the clip objective,
# SAPO's gate, REINFORCE scale with A for ω ≥ 0, and their clip flags, by A's sign, then count only where ω > 0,
# docs/math.md §10).
def _folded_adv(inputs: LossInputs, omega):
    return inputs.adv if omega is None else inputs.adv * omega


def _gspo_token(kernels, logp, rows: _Rows, weights, omega, inputs: LossInputs, config):
    """GSPO-token: the objective at w = e^clamp(log s_i), differentiated as e^ℓ_t."""
    B, T = rows.mask.shape
    log_s = (rows.log_ratio_sum / rows.divisor).clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    # w = e^(sg(log s_i) + ℓ − sg(ℓ)): ℓ − ℓ is 0 but NaN where a valid token's ℓ is −inf (a −inf sampled-token
    # logit), as in the definition, which the clamp of log s_i alone would hide
    x = (log_s[:, None] + torch.where(rows.mask, rows.logp - rows.logp, rows.zero)).reshape(-1)
    grad, _, stats = kernels.policy_token_loss(x, None, rows.mask.reshape(-1), weights.reshape(-1),
                                               _folded_adv(inputs, omega).reshape(-1).contiguous(),
                                               torch.zeros_like(x), None, surrogate_params(config, config.objective))
    return grad, stats.sum(0)[SURROGATE_STATS], _max(stats[:, Stat.RATIO])


def _sequence_cispo(kernels, logp, rows: _Rows, weights, omega, inputs: LossInputs, config):
    """TRL's sequence-level CISPO: −sg(clamp(s_i))·A·ℓ."""
    c = config.log_ratio_clamp
    s = torch.exp((rows.log_ratio_sum / rows.divisor).clamp(-c, c))
    coef, low, high = cispo_weight(s, config)
    return _scaled_reinforce(kernels, logp, rows, weights, _folded_adv(inputs, omega), omega, coef, s, (low, high),
                             config)


def _vespo(kernels, logp, rows: _Rows, weights, omega, inputs: LossInputs, config):
    """VESPO: −φ(w_i)·A·ℓ; its ratio statistic is the sequence ratio w_i."""
    c, old = config.log_ratio_clamp, inputs.old_logp
    log_ratio_sum = rows.log_ratio_sum if old is None else rows.masked_sum((rows.logp - old).clamp(-c, c))
    phi, w = vespo_weight(log_ratio_sum, inputs.adv_row, config, inputs.is_weights, rows.mask)
    return _scaled_reinforce(kernels, logp, rows, weights, _folded_adv(inputs, omega), omega, phi, w, None, config)


def _geometric(kernels, logp, rows: _Rows, weights, omega, inputs: LossInputs, config):
    """GMPO: −A·exp(mean_t clip_t), clip_t = min(δ_t, ε_high) where A > 0, max(δ_t, −ε_low) where A < 0.

    e^clip_t is the clip objective with the ratio band [e^−ε_low, e^ε_high] at the advantage sign(A): its
    value is −sign(A)·e^clip_t (so clip_t = log |value|), its derivative is nonzero exactly where δ_t passes
    the clip (where the row's derivative reaches the token) and its clip flags are GMPO's."""
    B, T = rows.mask.shape
    c = config.log_ratio_clamp
    passed, _, stats = kernels.policy_token_loss(
        logp, None, rows.mask.reshape(-1), rows.mask.reshape(-1).to(logp.dtype), torch.sign(inputs.adv).reshape(-1),
        inputs.flat("old_logp"), None, log_band_params(config, config.clip_low, config.clip_high, c))
    # log e^clip_t and log e^δ_t (the kernel's ratio statistic), averaged over each row: log of the geometric
    # means of the clipped ratio and of the ratio (a row with A = 0 gets e^−inf = 0: its loss is 0 anyway).
    logs = torch.stack([stats[:, Stat.LOSS].abs(), stats[:, Stat.RATIO]]).log().view(2, B, T)
    geo = torch.exp(torch.where(rows.mask, logs, rows.zero).sum(-1) / rows.divisor)
    row_weight = (weights if omega is None else weights * omega).sum(-1)  # W_i
    row_loss = row_weight * (-inputs.adv_row * geo[0])  # W_i times the row's loss
    grad = torch.where(passed.view(B, T) != 0, (row_loss / rows.divisor)[:, None], rows.zero).reshape(-1)
    flags = stats[:, CLIP_FLAGS] if omega is None else stats[:, CLIP_FLAGS] * (omega > 0).reshape(-1, 1)
    ratio = torch.where(rows.valid, geo[1], rows.zero)
    sums = torch.cat([row_loss.sum().reshape(1), flags.sum(0), torch.dot(ratio, rows.lengths).reshape(1)])
    return grad, sums, _max(ratio)


def _scaled_reinforce(kernels, logp, rows: _Rows, weights, adv, omega, coef, ratio, flags, config):
    """−coef_i·A·ℓ per token (REINFORCE with A·coef_i, `adv` already times ω), where the row's sequence
    ratio `ratio` is the ratio statistic and `flags` = (below, above) its row clip flags, or None."""
    grad, _, stats = kernels.policy_token_loss(logp, None, rows.mask.reshape(-1), weights.reshape(-1),
                                               (adv * coef[:, None]).reshape(-1), None, None,
                                               surrogate_params(config, "reinforce"))
    ratio = torch.where(rows.valid, ratio, rows.zero)
    if flags is None:
        clipped = rows.zero.expand(2)
    else:  # each row's flag counts on its tokens with ω > 0 (docs/math.md §10)
        counted = rows.lengths if omega is None else (omega > 0).sum(-1).to(ratio.dtype)
        clipped = (torch.stack(flags, 1).to(ratio.dtype) * counted[:, None]).sum(0)
    sums = torch.cat([stats[:, Stat.LOSS].sum().reshape(1), clipped, torch.dot(ratio, rows.lengths).reshape(1)])
    return grad, sums, _max(ratio)


def _max(ratios: Tensor) -> Tensor:
    """The largest of ratios ≥ 0 that are 0 where masked (0 for none)."""
    return ratios.amax() if ratios.numel() else ratios.new_zeros(())


# The evaluators that the registry's entries name (`Objective.sequence_steps`, ratio → name); SNIS's surrogate comes
# in the KL and entropy call.
EVALUATORS = {"gspo": _Gspo(), "fspo": _Fspo(), "gepo": _Gepo(), "gspo_token": _gspo_token,
              "sequence_cispo": _sequence_cispo, "vespo": _vespo, "geometric": _geometric, "snis": None}
_named = {name for o in map(objectives.get, objectives.names()) for name in o.sequence_steps.values()}
if not _named <= set(EVALUATORS):  # a built-in entry naming an evaluator that is not here: fail at import
    raise ImportError(f"objectives name sequence-level evaluators that ops/_sequence_step.py lacks: "
                      f"{sorted(_named - set(EVALUATORS))}")


def takes(config: PolicyLossConfig) -> bool:
    """Whether a sequence-level evaluator here computes this config's surrogate (`_plan.plan`; token-level
    objectives of the kernels' table come too)."""
    return config.ratio in objectives.get(config.objective).sequence_steps
