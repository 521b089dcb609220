"""Case builders and fp64 references shared by the kernel-contract tests of every backend
(test_cpu_kernels.py, test_cuda_kernels.py): inputs, the reference values and gradient, and the
error bounds they are held to."""
from typing import NamedTuple, Optional

import math

import torch

from rlkernels import reference

# V: 1 and 7 are all tail (smaller than one 16-lane step); 1000 is not a multiple of the step;
# 4099 (prime) spans three 2048-element blocks with a partial last one; 151936 = Qwen's vocabulary.
SHAPES = [(5, 1), (9, 7), (37, 1000), (13, 4099), (3, 151936)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# logp / entropy / lse_parts are fp32 for every logits dtype and computed in fp32 from the same values
# as the reference, so they meet the fp32 bound (1e-5 relative) for bf16/fp16 inputs too.
TOL_OUT = (1e-5, 1e-5)
# Significand bits and smallest subnormal of the reduced-precision gradient dtypes.
_BITS = {torch.bfloat16: (8, 2.0**-133), torch.float16: (11, 2.0**-24)}


def _inputs(n, vocab, dtype, scale=3.0):
    logits = (torch.randn(n, vocab, dtype=torch.float64) * scale).to(dtype)
    return logits, torch.randint(0, vocab, (n,))


class Ref(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    lse_parts: torch.Tensor  # (N, 2): the row max m and log Σ e^{x − m}
    grad: Optional[torch.Tensor]
    grad_scale: Optional[torch.Tensor]  # size of the terms that the gradient sums, see _close_grad


def _reference(logits, targets, temperature, grad_logp=None, grad_entropy=None):
    """fp64 reference on the same (upcast) logit values; the gradient by autograd."""
    x = logits.detach().double().requires_grad_()
    logp, entropy = reference.token_logprobs(x, targets, temperature)
    z = x.detach() / temperature
    m = z.amax(-1)
    lse_parts = torch.stack((m, (z - m[:, None]).exp().sum(-1).log()), 1)
    if grad_logp is None:
        return Ref(logp.detach(), entropy.detach(), lse_parts, None, None)
    g = grad_logp.double()
    h = torch.zeros_like(g) if grad_entropy is None else grad_entropy.double()
    (grad,) = torch.autograd.grad((logp * g + entropy * h).sum(), x)
    # (1/τ)[g (1[v=y] − p) − h p (log p + H)] is a sum of terms that cancel for some v; an fp32
    # result can only be relatively exact with respect to the size of those terms. log p itself is
    # (x − m) − log s with x = z·(1/τ) rounded to fp32: exact only relative to |z/τ| + |m| (≫ |log p|
    # where p ≈ 1, unless τ = 1), and H sums p·log p.
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    onehot = torch.zeros_like(p).scatter_(1, targets[:, None], 1.0)
    log_p_size = torch.where(p > 0, log_p.abs() + z.abs() + m.abs()[:, None], torch.zeros_like(p))
    entropy_size = (p * log_p_size).sum(-1, keepdim=True)
    scale = (g.abs()[:, None] * (onehot + p) + h.abs()[:, None] * p * (log_p_size + entropy_size)) / temperature
    return Ref(logp.detach(), entropy.detach(), lse_parts, grad, scale)


def _close(actual, expected, tol=TOL_OUT):
    rtol, atol = tol
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol * max(1.0, expected.abs().max().item()))


def _close_grad(actual, ref):
    """fp32: error ≤ 1e-5 × the size of the terms summed (ref.grad_scale; ≈ |grad| where nothing
    cancels). bf16/fp16: the rounding of the output itself (up to 2^-8 relative for bf16) exceeds
    2e-3 (docs/design.md §9), so check that the kernel adds only fp32-sized error: (a) every element
    is within one unit in the last place of the exactly rounded reference (plus the fp32 bound),
    and (b) few elements differ from it at all: an fp32 result rounds the other way only when it
    lies within its error of a rounding boundary (measured: under 0.1% of the elements; the
    allowance of 4 covers tiny tensors)."""
    fp32_bound = 1e-5 * ref.grad_scale
    if actual.dtype == torch.float32:
        err = (actual.double() - ref.grad).abs()
        assert (err <= fp32_bound).all(), f"max error / bound {(err / fp32_bound).nan_to_num(float('inf')).max():.3g}"
        return
    bits, tiny = _BITS[actual.dtype]
    rounded = ref.grad.to(actual.dtype).double()
    ulp = torch.ldexp(torch.ones_like(rounded), torch.frexp(rounded).exponent - bits).clamp_min(tiny)
    diff = (actual.double() - rounded).abs()
    off = diff > ulp + fp32_bound
    assert not off.any(), f"{int(off.sum())} elements more than 1 ulp from the rounded reference"
    flipped = int((diff > 0).sum())
    assert flipped <= 4 + 0.01 * diff.numel(), f"{flipped} of {diff.numel()} elements differ from the rounded reference"


def check_backward_matches_autograd(kernels, shape, dtype, with_entropy_grad, device):
    """`kernels`' backward on `device` against the fp64 autograd gradient (test_cuda_kernels uses it too)."""
    temperature = 0.8
    logits, targets = _inputs(*shape, dtype)
    g = torch.randn(shape[0])
    h = torch.randn(shape[0]) if with_entropy_grad else None
    z, y = logits.to(device), targets.to(device)
    _, entropy, lse_parts = kernels.token_logprobs_fwd(z, y, temperature, with_entropy_grad)
    grad = kernels.token_logprobs_bwd(z, y, lse_parts, entropy, g.to(device), None if h is None else h.to(device),
                                      temperature)
    assert grad.dtype == dtype and grad.shape == logits.shape and grad.device.type == device
    _close_grad(grad.cpu(), _reference(logits, targets, temperature, g, h))


# Bad scalars of the token loss (TokenLossParams fields), each refused with an error naming it, by
# policy_token_fwd and policy_token_loss alike (the checks of csrc/include/rlkernels/token_loss_args.h).
BAD_LOSS_SCALARS = [
    ("objective", dict(objective=7)),
    ("kl_estimator", dict(kl_estimator=4)),
    ("clip_low", dict(clip_low=math.nan)),
    ("clip_low", dict(clip_low=-0.1)),
    ("clip_high", dict(clip_high=math.nan)),
    ("clip_high", dict(clip_high=-1.0)),
    ("delta", dict(delta=math.nan)),
    ("delta", dict(delta=1.0)),
    ("dual_clip", dict(dual_clip=math.nan)),
    ("kl_coef", dict(kl_coef=math.nan)),
    ("kl_coef", dict(kl_coef=math.inf)),
    ("kl_coef", dict(kl_coef=-0.1)),
    ("kl_clamp", dict(kl_clamp=math.nan)),
    ("kl_clamp", dict(kl_clamp=0.0)),
    ("entropy_coef", dict(entropy_coef=math.nan)),
    ("log_ratio_clamp", dict(log_ratio_clamp=math.nan)),
    ("log_ratio_clamp", dict(log_ratio_clamp=0.0)),
    ("sapo_tau_pos", dict(sapo_tau_pos=0.0)),
    ("sapo_tau_neg", dict(sapo_tau_neg=math.nan)),
    ("ratio_cap", dict(ratio_cap=0.0)),
    ("dro_beta", dict(dro_beta=-0.1)),
    ("dro_beta", dict(dro_beta=math.inf)),
]
