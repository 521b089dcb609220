"""Triton forward of ``policy_token_fwd`` (kernels/__init__.py): log-probs plus the token loss.

One program per row makes the forward's single pass over the logits (`row_forward`, shared with
`token_logprobs`) and then, on the row's scalars, evaluates the per-token loss of
``token_loss.py``, writing ℓ, H, (m, log s), w_agg·∂s/∂ℓ, w_agg·∂s/∂H and the 7 statistics. The
loss adds 77 bytes of I/O per row (25 read, 52 written) to the V·b bytes of logits.
"""

import torch
import triton
import triton.language as tl

from .. import token_loss_params as P
from .launch import (
    INTERPRET, cap_args, check_logits, launch_config, on_device, plain, row_grids, row_layout, row_vector,
)
from .logprobs import program_row, row_forward, row_start
from .token_loss import ENTROPY_COEF, token_loss  # by name, as logprobs.py says


@triton.jit
def _policy_token_fwd_kernel(
    logits_ptr, targets_ptr, mask_ptr, weight_ptr, adv_ptr, old_logp_ptr, ref_logp_ptr, is_weights_ptr,
    logp_ptr, entropy_ptr, lse_parts_ptr, grad_logp_ptr, grad_entropy_ptr, stats_ptr,
    # loss_params: TokenLossParams.packed(), a tuple (not named `params`: Triton's argument binder has a local of
    # that name, which would shadow it)
    V, seq_len, first_batch, stride_batch, stride_row, inv_temp, cap, inv_cap, loss_params,
    OBJECTIVE: tl.constexpr, KL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr, BIAS_CORRECTION: tl.constexpr, NUM_STATS: tl.constexpr, HAS_CAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, b, t = program_row(seq_len, first_batch)
    target = tl.load(targets_ptr + row)
    logp, entropy, m, log_s = row_forward(row_start(logits_ptr, b, t, stride_batch, stride_row), target, V,
                                          inv_temp, cap, inv_cap, True, HAS_CAP, BLOCK_V)
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_parts_ptr + 2 * row, m)
    tl.store(lse_parts_ptr + 2 * row + 1, log_s)
    grad_logp, grad_entropy, loss, clip_low, clip_high, ratio, approx_kl, kl, h = row_loss(
        row, logp, entropy, mask_ptr, weight_ptr, adv_ptr, old_logp_ptr, ref_logp_ptr, is_weights_ptr, loss_params,
        OBJECTIVE, KL, HAS_OLD, HAS_REF, HAS_IS_WEIGHTS, BIAS_CORRECTION)
    tl.store(grad_logp_ptr + row, grad_logp)
    tl.store(grad_entropy_ptr + row, grad_entropy)
    store_stats(stats_ptr + row * NUM_STATS, loss, clip_low, clip_high, ratio, approx_kl, kl, h)


@triton.jit
def row_loss(row, logp, entropy, mask_ptr, weight_ptr, adv_ptr, old_logp_ptr, ref_logp_ptr, is_weights_ptr,
             loss_params, OBJECTIVE: tl.constexpr, KL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
             HAS_IS_WEIGHTS: tl.constexpr, BIAS_CORRECTION: tl.constexpr):
    """(w_agg·∂s/∂ℓ, w_agg·∂s/∂H, then the 7 statistics in token_loss_params.STATS order) of the token of `row`,
    at its log-prob and entropy, each 0 where masked."""
    # As the spec does (`LossInputs.masked`): a masked token enters the loss as zeros, so padding (NaN, inf)
    # never reaches the arithmetic, and every output below is 0 there.
    valid = tl.load(mask_ptr + row) != 0
    l = tl.where(valid, logp, 0.0)
    h = tl.where(valid, entropy, 0.0)
    adv = tl.where(valid, tl.load(adv_ptr + row), 0.0)
    old_logp = l  # on-policy: ℓ_old = ℓ, so w = 1
    if HAS_OLD:
        old_logp = tl.where(valid, tl.load(old_logp_ptr + row), 0.0)
    ref_logp = 0.0
    if HAS_REF:
        ref_logp = tl.where(valid, tl.load(ref_logp_ptr + row), 0.0)
    is_weight = 1.0
    if HAS_IS_WEIGHTS:
        is_weight = tl.where(valid, tl.load(is_weights_ptr + row), 0.0)
    s, ds, clip_low, clip_high, ratio, approx_kl, kl = token_loss(
        l, old_logp, ref_logp, adv, h, 0.0, is_weight, loss_params, OBJECTIVE, KL, HAS_REF, BIAS_CORRECTION,
    )
    weight = tl.load(weight_ptr + row)
    return (tl.where(valid, weight * ds, 0.0), tl.where(valid, -weight * loss_params[ENTROPY_COEF], 0.0),
            tl.where(valid, weight * s, 0.0), tl.where(valid, clip_low, 0.0), tl.where(valid, clip_high, 0.0),
            tl.where(valid, ratio, 0.0), tl.where(valid, approx_kl, 0.0), tl.where(valid, kl, 0.0), h)


@triton.jit
def store_stats(stats_row, loss, clip_low, clip_high, ratio, approx_kl, kl, h):
    """A row of `stats`, in token_loss_params.STATS order."""
    tl.store(stats_row + 0, loss)
    tl.store(stats_row + 1, clip_low)
    tl.store(stats_row + 2, clip_high)
    tl.store(stats_row + 3, ratio)
    tl.store(stats_row + 4, approx_kl)
    tl.store(stats_row + 5, kl)
    tl.store(stats_row + 6, h)


def policy_token_fwd(logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights, temperature, params,
                     softcap=0.0, *, wrap=plain):
    """(logp, entropy, lse_parts, grad_logp, grad_entropy, stats): fp32 (N,) each but
    lse_parts (N, 2) = [m, log s] and stats (N, 7).

    ``old_logp=None``: on-policy; ``ref_logp=None``: no reference (kl = 0); ``is_weights=None``: ω = 1.
    ``params``: a ``TokenLossParams``. ``wrap``: as in ``token_logprobs_fwd``.
    """
    check_logits(logits, targets)
    (n, seq_len, *strides), vocab = row_layout(logits), logits.shape[-1]
    dev = logits.device
    if mask.shape != (n,):
        raise ValueError(f"mask: expected shape ({n},), got {tuple(mask.shape)}")
    mask = mask.to(device=dev, dtype=torch.bool).contiguous()
    weight = row_vector(weight, n, dev, "weight")
    adv = row_vector(adv, n, dev, "adv")
    has_old, has_ref, has_is_weights = old_logp is not None, ref_logp is not None, is_weights is not None
    logp, entropy, grad_logp, grad_entropy = (
        torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4))
    lse_parts = torch.empty(n, 2, dtype=torch.float32, device=dev)
    stats = torch.empty(n, P.NUM_STATS, dtype=torch.float32, device=dev)
    # Never read when absent.
    old_logp = row_vector(old_logp, n, dev, "old_logp") if has_old else adv
    ref_logp = row_vector(ref_logp, n, dev, "ref_logp") if has_ref else adv
    is_weights = row_vector(is_weights, n, dev, "is_weights") if has_is_weights else adv
    if n == 0:
        return logp, entropy, lse_parts, grad_logp, grad_entropy, stats
    p = params
    # The loss has a KL term only with an estimator and β > 0 (else `kl` reports k3).
    kl = p.kl_estimator if p.kl_coef > 0 else P.KL_NONE
    block, warps = launch_config(vocab, logits.dtype)
    cap, has_cap = cap_args(softcap)
    targets, packed = targets.to(torch.int64).contiguous(), p.packed()
    with on_device(dev):
        for grid, first_batch in row_grids(n, seq_len):
            wrap(_policy_token_fwd_kernel)[grid](
                logits, targets, mask, weight, adv, old_logp, ref_logp, is_weights,
                logp, entropy, lse_parts, grad_logp, grad_entropy, stats,
                vocab, seq_len, first_batch, *strides, 1.0 / float(temperature), *cap, packed,
                OBJECTIVE=int(p.objective), KL=int(kl), HAS_OLD=has_old, HAS_REF=has_ref,
                HAS_IS_WEIGHTS=has_is_weights, BIAS_CORRECTION=bool(p.kl_bias_correction), NUM_STATS=P.NUM_STATS,
                HAS_CAP=has_cap, BLOCK_V=block, num_warps=warps,
            )
    return logp, entropy, lse_parts, grad_logp, grad_entropy, stats


def token_rows(logp, mask):
    """(N, device, mask as contiguous bool) of per-token fp32 values `logp (N,)` and their mask, checked."""
    if logp.dim() != 1 or logp.dtype != torch.float32:
        raise ValueError(f"logp: expected an fp32 tensor of shape (N,), got {logp.dtype} {tuple(logp.shape)}")
    n, dev = logp.shape[0], logp.device
    if dev.type != "cuda" and not INTERPRET:
        raise ValueError(f"logp: the triton backend needs a CUDA tensor, got one on {dev}")
    if mask.shape != (n,):
        raise ValueError(f"mask: expected shape ({n},), got {tuple(mask.shape)}")
    return n, dev, mask.to(device=dev, dtype=torch.bool).contiguous()


LOSS_BLOCK = 256  # tokens per program of `_policy_token_loss_kernel` (benchmarks/gpu_static.py reads it)


@triton.jit
def _policy_token_loss_kernel(
    logp_ptr, entropy_ptr, mask_ptr, weight_ptr, adv_ptr, old_logp_ptr, ref_logp_ptr, chosen_ptr, is_weights_ptr,
    grad_logp_ptr, grad_entropy_ptr, stats_ptr, n, loss_params,
    OBJECTIVE: tl.constexpr, KL: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_ADV: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_CHOSEN: tl.constexpr, HAS_IS_WEIGHTS: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr, NUM_STATS: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    valid = inside & (tl.load(mask_ptr + i, mask=inside, other=0) != 0)
    # As in the forward kernel: masked tokens enter as zeros; absent inputs are H = 0, A = 0.
    logp = tl.load(logp_ptr + i, mask=valid, other=0.0)
    h = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_ENTROPY:
        h = tl.load(entropy_ptr + i, mask=valid, other=0.0)
    adv = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_ADV:
        adv = tl.load(adv_ptr + i, mask=valid, other=0.0)
    old_logp = logp
    if HAS_OLD:
        old_logp = tl.load(old_logp_ptr + i, mask=valid, other=0.0)
    ref_logp = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_REF:
        ref_logp = tl.load(ref_logp_ptr + i, mask=valid, other=0.0)
    chosen = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_CHOSEN:
        chosen = tl.load(chosen_ptr + i, mask=valid, other=0.0)
    is_weight = tl.full([BLOCK], 1.0, dtype=tl.float32)
    if HAS_IS_WEIGHTS:
        is_weight = tl.load(is_weights_ptr + i, mask=valid, other=0.0)
    s, ds, clip_low, clip_high, ratio, approx_kl, kl = token_loss(
        logp, old_logp, ref_logp, adv, h, chosen, is_weight, loss_params, OBJECTIVE, KL, HAS_REF, BIAS_CORRECTION,
    )
    weight = tl.load(weight_ptr + i, mask=inside, other=0.0)
    tl.store(grad_logp_ptr + i, tl.where(valid, weight * ds, 0.0), mask=inside)
    tl.store(grad_entropy_ptr + i, tl.where(valid, -weight * loss_params[ENTROPY_COEF], 0.0), mask=inside)
    stats_row = stats_ptr + i * NUM_STATS  # columns in token_loss_params.STATS order
    tl.store(stats_row + 0, tl.where(valid, weight * s, 0.0), mask=inside)
    tl.store(stats_row + 1, tl.where(valid, clip_low, 0.0), mask=inside)
    tl.store(stats_row + 2, tl.where(valid, clip_high, 0.0), mask=inside)
    tl.store(stats_row + 3, tl.where(valid, ratio, 0.0), mask=inside)
    tl.store(stats_row + 4, tl.where(valid, approx_kl, 0.0), mask=inside)
    tl.store(stats_row + 5, tl.where(valid, kl, 0.0), mask=inside)
    tl.store(stats_row + 6, h, mask=inside)


def policy_token_loss(logp, entropy, mask, weight, adv, old_logp, ref_logp, params, chosen=None, is_weights=None, *,
                      wrap=plain):
    """(grad_logp, grad_entropy, stats) of the per-token loss at fp32 log-probs ``logp (N,)``:
    fp32 (N,), (N,) and (N, 7). ``entropy=None``: H = 0; ``adv=None``: A = 0 (only the KL and
    entropy terms); ``old_logp``, ``ref_logp`` as in ``policy_token_fwd``; ``chosen`` as
    `covariance_choice` gives it (None: no token chosen); ``is_weights`` ω (None: 1)."""
    n, dev, mask = token_rows(logp, mask)
    logp, weight = logp.contiguous(), row_vector(weight, n, dev, "weight")
    optional = {name: None if x is None else row_vector(x, n, dev, name)
                for name, x in (("entropy", entropy), ("adv", adv), ("old_logp", old_logp), ("ref_logp", ref_logp),
                                ("chosen", chosen), ("is_weights", is_weights))}
    grad_logp, grad_entropy = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
    stats = torch.empty(n, P.NUM_STATS, dtype=torch.float32, device=dev)
    if n == 0:
        return grad_logp, grad_entropy, stats
    p = params
    kl = p.kl_estimator if p.kl_coef > 0 else P.KL_NONE
    block = LOSS_BLOCK
    given = {k: logp if x is None else x for k, x in optional.items()}  # absent: never read
    with on_device(dev):
        wrap(_policy_token_loss_kernel)[(triton.cdiv(n, block),)](
            logp, given["entropy"], mask, weight, given["adv"], given["old_logp"], given["ref_logp"], given["chosen"],
            given["is_weights"],
            grad_logp, grad_entropy, stats, n, p.packed(),
            OBJECTIVE=int(p.objective), KL=int(kl), HAS_ENTROPY=entropy is not None, HAS_ADV=adv is not None,
            HAS_OLD=old_logp is not None, HAS_REF=ref_logp is not None, HAS_CHOSEN=chosen is not None,
            HAS_IS_WEIGHTS=is_weights is not None,
            BIAS_CORRECTION=bool(p.kl_bias_correction), NUM_STATS=P.NUM_STATS, BLOCK=block,
        )
    return grad_logp, grad_entropy, stats
