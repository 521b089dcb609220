"""Triton ``covariance_choice`` (kernels/__init__.py): Clip-Cov's and KL-Cov's tokens of a call in one launch.

The choice couples every token (batch means, then the k smallest keys), so one program makes it:
a pass for the means (summed in fp64, as the spec), four radix passes of 8 bits that find the k-th
smallest 32-bit key among the eligible tokens (a 256-bin histogram each), and a last pass that
writes the choice, ties at that key taken in position order (a running prefix count). 6·N reads of
a few bytes per token: ~N/170k ms on one SM of an H100-class GPU, against ~30 launches for the
same choice in PyTorch.
"""

import torch
import triton
import triton.language as tl

from .. import token_loss_params as P
from .launch import on_device, plain, row_vector
from .policy_token import token_rows
from .token_loss import clamp

CHOOSE_KL_COV = tl.constexpr(P.CHOOSE_KL_COV)
CHOICE_BLOCK, CHOICE_WARPS = 1024, 8  # tokens per step of the one program, its warps (benchmarks/gpu_static.py reads them)


@triton.jit
def ordered_key(x):
    """fp32 → an int64 key in [0, 2^32) that sorts as torch.sort sorts floats: −0 = +0, NaN above +inf."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True).to(tl.int64)
    key = tl.where(u >= 2147483648, 4294967295 - u, u + 2147483648)
    return tl.where(x != x, 4290772992, key)  # the key of the NaN 0x7fc00000


@triton.jit
def _candidate(i, n, logp_ptr, adv_ptr, old_ptr, mask_ptr, draws_ptr, mean_adv, mean_logp,
               cov_lb, cov_ub, clip_low, clip_high, log_ratio_clamp, CHOICE: tl.constexpr, HAS_OLD: tl.constexpr):
    """(eligible, key) of tokens i, as rlkernels/covariance_choice.h's `candidate`."""
    inside = i < n
    valid = inside & (tl.load(mask_ptr + i, mask=inside, other=0) != 0)
    logp = tl.load(logp_ptr + i, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + i, mask=valid, other=0.0)
    cov = (adv - mean_adv) * (logp - mean_logp)
    if CHOICE == CHOOSE_KL_COV:
        return valid, 4294967295 - ordered_key(cov)  # the largest covariance first
    else:
        old = logp
        if HAS_OLD:
            old = tl.load(old_ptr + i, mask=valid, other=0.0)
        w = tl.exp(clamp(logp - old, -log_ratio_clamp, log_ratio_clamp))
        clipped = -adv * clamp(w, 1.0 - clip_low, 1.0 + clip_high) > -adv * w
        eligible = valid & ~clipped & (cov > cov_lb) & (cov < cov_ub)
        return eligible, ordered_key(tl.load(draws_ptr + i, mask=valid, other=0.0))


@triton.jit
def _covariance_choice_kernel(
    logp_ptr, adv_ptr, old_ptr, mask_ptr, draws_ptr, out_ptr, n,
    cov_lb, cov_ub, clip_low, clip_high, log_ratio_clamp, scale,
    FRACTION: tl.constexpr, CHOICE: tl.constexpr, HAS_OLD: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK).to(tl.int64)
    sum_adv = tl.zeros([BLOCK], dtype=tl.float64)
    sum_logp = tl.zeros([BLOCK], dtype=tl.float64)
    count = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        i = start + offs
        valid = (i < n) & (tl.load(mask_ptr + i, mask=i < n, other=0) != 0)
        sum_adv += tl.load(adv_ptr + i, mask=valid, other=0.0).to(tl.float64)
        sum_logp += tl.load(logp_ptr + i, mask=valid, other=0.0).to(tl.float64)
        count += valid.to(tl.int64)
    total = tl.sum(count, axis=0)
    divisor = tl.maximum(total, 1).to(tl.float64)
    mean_adv = (tl.sum(sum_adv, axis=0) / divisor).to(tl.float32)
    mean_logp = (tl.sum(sum_logp, axis=0) / divisor).to(tl.float32)
    # k = max(⌊N·fraction⌋, 1) in float64, as the spec: a float argument would be fp32, and the floor of a product
    # near an integer (10 × 0.3) changes with the fraction's last bits; a constexpr in tl.full keeps all 53.
    k = tl.maximum(tl.floor(total.to(tl.float64) * tl.full([], FRACTION, tl.float64)), 1.0).to(tl.int64)

    # The k-th smallest key t, 8 bits a pass; `need`: how many of the tokens with key t are taken.
    prefix = tl.zeros([], dtype=tl.int64)
    need = k
    eligible_count = tl.zeros([], dtype=tl.int64)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            eligible, key = _candidate(start + offs, n, logp_ptr, adv_ptr, old_ptr, mask_ptr, draws_ptr, mean_adv,
                                       mean_logp, cov_lb, cov_ub, clip_low, clip_high, log_ratio_clamp, CHOICE,
                                       HAS_OLD)
            match = eligible & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        if p == 0:
            eligible_count = tl.sum(hist, axis=0).to(tl.int64)
        below = tl.cumsum(hist, axis=0).to(tl.int64) < need  # the bins before the one that holds the k-th key
        prefix = prefix | (tl.sum(below.to(tl.int64), axis=0) << shift)
        need = need - tl.sum(tl.where(below, hist, 0), axis=0).to(tl.int64)
    take_all = eligible_count <= k

    taken = tl.zeros([], dtype=tl.int64)  # tokens with key t already taken, in position order
    for start in range(0, n, BLOCK):
        i = start + offs
        eligible, key = _candidate(i, n, logp_ptr, adv_ptr, old_ptr, mask_ptr, draws_ptr, mean_adv, mean_logp,
                                   cov_lb, cov_ub, clip_low, clip_high, log_ratio_clamp, CHOICE, HAS_OLD)
        tie = eligible & (key == prefix)
        rank = taken + tl.cumsum(tie.to(tl.int64), axis=0) - tie.to(tl.int64)
        take = eligible & (take_all | (key < prefix) | (tie & (rank < need)))
        taken += tl.sum(tie.to(tl.int64), axis=0)
        tl.store(out_ptr + i, tl.where(take, scale, 0.0), mask=i < n)


def covariance_choice(logp, adv, old_logp, mask, draws, params, *, wrap=plain):
    """Clip-Cov's (with fp32 uniform ``draws``) or KL-Cov's chosen tokens: fp32 (N,), ``params.scale`` on each, 0
    elsewhere. ``params``: a ``CovarianceChoiceParams``."""
    n, dev, mask = token_rows(logp, mask)
    p = params
    kl_cov = p.objective == P.CHOOSE_KL_COV
    if (draws is None) != kl_cov:
        raise ValueError("draws: expected uniform draws for clip_cov and none for kl_cov")
    if not 0 < p.fraction <= 1:
        raise ValueError(f"fraction: expected a value in (0, 1], got {p.fraction}")
    logp, adv = logp.contiguous(), row_vector(adv, n, dev, "adv")
    old, draws = (None if x is None else row_vector(x, n, dev, name)
                  for name, x in (("old_logp", old_logp), ("draws", draws)))
    out = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    with on_device(dev):
        wrap(_covariance_choice_kernel)[(1,)](
            logp, adv, logp if old is None else old, mask, logp if draws is None else draws,  # absent: never read
            out, n,
            float(p.cov_lb), float(p.cov_ub), float(p.clip_low), float(p.clip_high), float(p.log_ratio_clamp),
            float(p.scale), FRACTION=float(p.fraction), CHOICE=int(p.objective), HAS_OLD=old is not None,
            BLOCK=CHOICE_BLOCK, num_warps=CHOICE_WARPS,
        )
    return out
