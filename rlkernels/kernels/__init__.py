"""Kernels: the passes over logits. They know only tensors, shapes and scalars.

`Kernels` is the contract every backend module meets (docs/design.md §3): `torch_chunked`, `cpu` and
`cuda` (the extension's ops, `_extension.py`), and `triton`. Each also has `available() -> (ok, reason)`.
The ops take inputs that `ops/` has already validated, over flattened rows: the ``N`` rows of logits
``(N, V)`` or ``(B, T, V)`` with unit stride over V and any other strides, row ``n = b·T + t`` at
``b·stride(0) + t·stride(1)`` (a batch stride beside the row stride: a view such as ``logits[:, :-1]``
of a ``(B, T + 1, V)`` parent is read where it lies, in one launch); every per-row tensor is ``(N,)``
in that order.
"""
from __future__ import annotations

from typing import Mapping, Optional, Protocol, Tuple

from torch import Tensor

from .token_loss_params import CovarianceChoiceParams, TokenLossParams

# every op of the contract; the fused policy ops are optional (`Kernels.supports`)
OPS = ("token_logprobs_fwd", "token_logprobs_bwd", "policy_token_fwd", "policy_token_fwd_grad", "policy_token_loss",
       "covariance_choice")


class Kernels(Protocol):
    """A backend's kernels. A backend module is one: its functions are these methods."""

    def supports(self, op: str) -> Optional[str]:
        """None when the backend implements `op` (one of `OPS`), else why not. The ops then take the
        general path of docs/design.md §4."""

    def token_logprobs_fwd(self, logits: Tensor, targets: Tensor, temperature: float, need_entropy: bool,
                           softcap: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
        """(logp, entropy, lse_parts) of N rows of logits.

        logits ``(N, V)`` or ``(B, T, V)`` (the rows of the module docstring) fp16/bf16/fp32 (fp64
        where the backend supports it), targets ``(N,)`` int64 in ``[0, V)``. With ``m = max_v logits_v`` (raw, not divided by τ),
        ``d_v = (logits_v - m) / temperature`` and ``s = sum_v e^{d_v}``, returns in the accumulation
        dtype (fp32; fp64 for fp64 logits): ``logp (N,) = d_y - log s``, the entropy
        ``H (N,) = log s - sum_v p_v d_v`` (an empty tensor when ``need_entropy`` is False) and
        ``lse_parts (N, 2) = [m, log s]``, what the backward needs of the row. τ scales differences
        only: ``logits / τ`` overflows near ±3e38 at τ < 1. logsumexp(logits/τ) is ``m/τ + log s``,
        but no backend forms that sum: it rounds to ulp(m/τ), which at ``|m| ≈ 1e3`` already costs
        more precision than all else and near ±3e38 all of ``log s``; every log-probability is
        ``d_v - log s``, as in log_softmax.
        A row that is all −inf, or holds a NaN or +inf, has NaN ``logp`` and ``H`` (log_softmax's
        NaN), on every backend. ``softcap`` c > 0: every logit z is read as ``c·tanh(z/c)`` (−inf
        stays −inf) before anything above, and the backward multiplies by ``1 − tanh²(z/c)``.
        """

    def token_logprobs_bwd(self, logits: Tensor, targets: Tensor, lse_parts: Tensor, entropy: Tensor,
                           grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], temperature: float,
                           out: Optional[Tensor] = None, softcap: float = 0.0) -> Tensor:
        """grad_logits of the forward's outputs.

        ``grad_logits[n, v] = (1/τ)·[g·(1[v=y] − p_v) − h·p_v·(log p_v + H)]`` with
        ``log p_v = (logits_v − m)/τ − log s`` from the forward's ``lse_parts``, ``g = grad_logp`` and
        ``h = grad_entropy`` (``None`` means 0; ``entropy`` may then be empty), in the dtype and
        shape of ``logits``. ``out``: a tensor of that shape with unit stride over V and its own
        strides (rows apart: the box of a parent-shaped buffer) to write into instead of a new one;
        it may be ``logits`` itself (every element is read before
        it is overwritten), which is how ``fused_policy_loss(inplace=True)`` saves an N×V buffer.
        """

    def policy_token_fwd(self, logits: Tensor, targets: Tensor, mask: Tensor, weight: Tensor, adv: Tensor,
                         old_logp: Optional[Tensor], ref_logp: Optional[Tensor], is_weights: Optional[Tensor],
                         temperature: float, params: TokenLossParams,
                         softcap: float = 0.0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(logp, entropy, lse_parts, grad_logp, grad_entropy, stats): the forward plus the per-token loss. cpu, cuda
        and triton have it, torch does not (`supports`).

        The forward above (logits ``(N, V)`` or ``(B, T, V)``) plus the token-level policy loss of
        docs/math.md, in the same program that reads the row. ``mask (N,)`` bool; ``weight (N,)`` the aggregation weight w_agg of each
        token (0 where masked); ``adv (N,)`` the advantage A; ``old_logp (N,)`` ℓ_old or ``None``
        (on-policy: ℓ_old = ℓ, no gradient through it); ``ref_logp (N,)`` ℓ_ref or ``None``;
        ``is_weights (N,)`` the surrogate's importance weights ω ≥ 0 or ``None`` (ω = 1); all
        contiguous in the accumulation dtype (fp32; fp64 for fp64 logits). ``params`` is a
        ``kernels.token_loss_params.TokenLossParams`` (the ops take it packed, ``params.packed()``). With ℓ
        the log-prob and H the entropy of a row (c = log_ratio_clamp; inf means "no bound"):

            r = clamp(ℓ − ℓ_old, −c, c),  w = e^r              (∂r/∂ℓ = 1 iff |ℓ − ℓ_old| ≤ c)
            s, clip_low, clip_high: the surrogate of ``params.objective`` and its two flags, each objective's
                       formula as `OBJECTIVES` of rlkernels/_token_loss_table.py declares it (its `doc`; also the
                       comment of its id in csrc/include/rlkernels/token_loss_table.h), in the terms above: A, w,
                       ℓ, ℓ_old and the parameters (ε_low = clip_low, ε_high = clip_high, δ = delta); flags false
                       where it declares none
            ω:         s and ∂s/∂ℓ of the surrogate above times ω; clip_low = clip_high = false where ω = 0
            KL (ref_logp given): Δ = clamp(ℓ_ref − ℓ, −c, c); with KL_NONE or β = 0 the `kl` statistic
                       is k3(Δ) = e^Δ − 1 − Δ and the loss has no KL term; else k = est(Δ)
                       (k1 = −Δ, k2 = Δ²/2, k3; abs = |e| of the unclamped e = ℓ_ref − ℓ; low_var_kl+ =
                       clamp(k3(Δ), ±10) with the gradient of ½e², e unclamped), clamped to ±kl_clamp, times w
                       under kl_bias_correction (differentiated through w too), and s += β·k; the `kl` statistic
                       is that k. No ref: kl = 0.
            entropy:   s −= c_H·H
            approx_kl = k3(clamp(ℓ_old − ℓ, −c, c)),  ratio = w

        Derivatives follow torch's autograd of `losses/` (clamp passes the gradient on its closed
        interval, max / min take the larger / smaller branch and give half to each on a tie). Outputs, all in
        the accumulation dtype: ``logp, entropy (N,)`` and ``lse_parts (N, 2)`` as in the forward; ``grad_logp (N,) = w_agg·∂s/∂ℓ``,
        ``grad_entropy (N,) = w_agg·∂s/∂H = −w_agg·c_H`` (0 where masked); ``stats (N, 7)``, columns
        ``token_loss_params.STATS``: w_agg·s, then clip_low, clip_high, ratio, approx_kl, kl, H, each
        0 where masked (so ``stats.sum(0)`` gives the loss and the metrics' masked sums, and
        ``stats[:, Stat.RATIO].amax()`` the masked ratio max (``token_loss_params.Stat`` names the columns), as every ratio is ≥ 0). A row whose target is
        outside [0, V) is an error (cpu: raised; cuda, triton: NaN logp, and `ops/` asserts the range
        on the device).
        """

    def policy_token_fwd_grad(self, logits: Tensor, targets: Tensor, mask: Tensor, weight: Tensor, adv: Tensor,
                              old_logp: Optional[Tensor], ref_logp: Optional[Tensor], is_weights: Optional[Tensor],
                              entropy_grad: Optional[Tensor], temperature: float, params: TokenLossParams,
                              scale: float, out: Optional[Tensor] = None,
                              softcap: float = 0.0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(logp, entropy, stats, grad_logits): the two-pass row (docs/design.md §2). Every backend but torch has it
        (with `scale_grad_`): cpu; cuda on sm_90 and later, where a row of up to 8 blocks' shared memory is held by a
        thread-block cluster (it raises on an older device or a longer row); triton as a split row, K programs per
        row meeting through counters in global memory (docs/design.md §7).

        ``policy_token_fwd``'s ``logp``, ``entropy`` and ``stats`` and, from the same read of each row,
        ``token_logprobs_bwd`` at ``g = scale·grad_logp`` and ``h = scale·h₀``, where h₀ is
        ``entropy_grad (N,)`` when given (∂/∂H of an entropy bonus outside the token's loss), else the
        token's ``grad_entropy`` when ``params.entropy_coef != 0``, else 0. ``scale`` (finite, nonzero) is
        the gradient the caller expects to flow into the loss. ``out`` as in ``token_logprobs_bwd``
        (it may be ``logits`` itself); without it, a new contiguous gradient.
        """

    def scale_grad_(self, grad: Tensor, grad_out: Tensor, assumed: float) -> None:
        """``grad ×= grad_out / assumed`` (contiguous ``grad``, in the accumulation precision), unless the one
        number ``grad_out`` equals ``assumed`` rounded to its dtype: then nothing is read or written. It reads
        ``grad_out`` where it lies, with no host sync (a GPU kernel returns at once when it matches). With
        ``policy_token_fwd_grad``."""

    def policy_token_loss(self, logp: Tensor, entropy: Optional[Tensor], mask: Tensor, weight: Tensor,
                          adv: Optional[Tensor], old_logp: Optional[Tensor], ref_logp: Optional[Tensor],
                          params: TokenLossParams, chosen: Optional[Tensor] = None,
                          is_weights: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """(grad_logp, grad_entropy, stats): the per-token loss at given log-probs. cpu, cuda and
        triton have it, torch does not (`supports`).

        The per-token loss of ``policy_token_fwd`` at given log-probs, without logits: ``logp (N,)``
        in the accumulation dtype (fp32; cpu also fp64), contiguous; ``entropy (N,)`` or ``None``
        (H = 0); ``adv`` ``(N,)`` or ``None`` (A = 0: no surrogate, only the KL and entropy terms);
        the other inputs, the params and the three outputs as in ``policy_token_fwd``. The
        sequence-level losses call it once over the tokens for their KL and entropy terms and once
        over the rows (or tokens) for their surrogate (SNIS: its REINFORCE surrogate in the first
        call, as its advantage) (``ops/_sequence_step.py``). The objectives whose `ops` in the table are this op
        alone (CLIP_COV, KL_COV) read ``chosen (N,)`` (``None``: 0 everywhere), the output of
        ``covariance_choice``, as their formulas there say.
        """

    def covariance_choice(self, logp: Tensor, adv: Tensor, old_logp: Optional[Tensor], mask: Tensor,
                          draws: Optional[Tensor], params: CovarianceChoiceParams) -> Tensor:
        """chosen (N,): Clip-Cov's or KL-Cov's tokens of the call. cpu, cuda and triton have it,
        torch does not (`supports`).

        Clip-Cov's and KL-Cov's choice of tokens (docs/math.md §5) in one launch. ``logp``, ``adv``
        ``(N,)`` in the accumulation dtype, ``old_logp`` ``(N,)`` or ``None`` (on-policy), ``mask (N,)``
        bool; ``params`` a ``token_loss_params.CovarianceChoiceParams``.
        Over the masked tokens (n of them), with means of A and ℓ summed in float64 and rounded to
        the dtype, Cov = (A − mean A)·(ℓ − mean ℓ) in the dtype, and k = max(⌊n·fraction⌋, 1) in float64:
        CHOOSE_CLIP_COV takes ``draws (N,)`` fp32 uniform; the candidates are the tokens with
        cov_lb < Cov < cov_ub that PPO's clip leaves unclipped (−A·clamp(w, 1 − clip_low, 1 + clip_high)
        ≤ −A·w, w = e^clamp(ℓ − ℓ_old, ±log_ratio_clamp)), and the min(k, candidates) of smallest draw
        are chosen. CHOOSE_KL_COV (``draws=None``): the k tokens of largest Cov (NaN largest, −0 = +0,
        as torch.sort). Ties go to the first position. Returns ``chosen (N,)`` in the dtype of logp:
        ``scale`` on each chosen token, 0 elsewhere. At most 2^31 − 1 tokens.
        """


def supports_all_but(missing: Mapping[str, str]):
    """A backend's `Kernels.supports`: it has every op of `OPS` but those of `missing` (op: why not)."""
    unknown = set(missing) - set(OPS)
    assert not unknown, unknown

    def supports(op: str) -> Optional[str]:
        if op not in OPS:
            raise ValueError(f"no kernel op {op!r}; the ops are {OPS}")
        return missing.get(op)

    return supports
