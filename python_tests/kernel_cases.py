"""Case builders, fp64 references and error bounds of the kernel-contract tests
(test_kernel_contract.py: `token_logprobs_fwd` / `token_logprobs_bwd` of every backend). Those of the
per-token loss ops are in token_loss_cases.py."""
from typing import NamedTuple, Optional

import functools
import zlib

import torch

from rlkernels import reference

# V: 1 and 7 are all tail (smaller than one 16-lane step); 1000 is not a multiple of the step;
# 4099 (prime) spans three 2048-element blocks with a partial last one; 151936 = Qwen's vocabulary.
SHAPES = [(5, 1), (9, 7), (37, 1000), (13, 4099), (3, 151936)]
# CUDA: 1, 7 (all head/tail, no 16-byte pack); 1000; 2048 / 2049 (last warp-per-row size, first
# block-per-row one); 4099 (odd: every other row starts misaligned); 32768 / 32769 (256 → 512
# threads); 151936 (Qwen's vocabulary).
CUDA_SHAPES = [(5, 1), (9, 7), (37, 1000), (19, 2048), (11, 2049), (13, 4099), (5, 32768), (4, 32769), (3, 151936)]
# Triton: V = 1 (a one-token vocabulary), 7 (one partial tile), 1000 (two interpreter tiles, partial
# last), 4099 (just above the largest single GPU tile, 4096; 9 interpreter tiles). The interpreter
# is slow: three rows each.
TRITON_SHAPES = [(3, 1), (3, 7), (3, 1000), (3, 4099)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# logp / entropy / lse_parts are fp32 for every logits dtype and computed in fp32 from the same values
# as the reference, so they meet the fp32 bound (1e-5 relative) for bf16/fp16 inputs too.
TOL_OUT = (1e-5, 1e-5)
# The bounds the Triton kernels are held to (docs/design.md §9): relative error on log-probs and on
# the gradient before its rounding to the logits' dtype, vs the reference on the same values.
TOL_REL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3}
# One unit in the last place, relative: the rounding of a gradient stored in this dtype.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# Significand bits and smallest subnormal of the reduced-precision gradient dtypes.
_BITS = {torch.bfloat16: (8, 2.0**-133), torch.float16: (11, 2.0**-24)}


def _inputs(n, vocab, dtype, scale=3.0, *, generator=None):
    logits = (torch.randn(n, vocab, dtype=torch.float64, generator=generator) * scale).to(dtype)
    return logits, torch.randint(0, vocab, (n,), generator=generator)


class Ref(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    lse_parts: torch.Tensor  # (N, 2): the raw row max m and log Σ e^{(x − m)/τ}
    grad: Optional[torch.Tensor]
    grad_scale: Optional[torch.Tensor]  # size of the terms that the gradient sums, see _close_grad


def _reference(logits, targets, temperature, grad_logp=None, grad_entropy=None):
    """fp64 reference on the same (upcast) logit values; the gradient by autograd."""
    x = logits.detach().double().requires_grad_()
    logp, entropy = reference.token_logprobs(x, targets, temperature)
    m_raw = x.detach().amax(-1)
    lse_parts = torch.stack((m_raw, ((x.detach() - m_raw[:, None]) / temperature).exp_().sum(-1).log()), 1)
    z, m = x.detach() / temperature, m_raw / temperature
    if grad_logp is None:
        return Ref(logp.detach(), entropy.detach(), lse_parts, None, None)
    g = grad_logp.double()
    h = torch.zeros_like(g) if grad_entropy is None else grad_entropy.double()
    (grad,) = torch.autograd.grad((logp * g + entropy * h).sum(), x)
    # (1/τ)[g (1[v=y] − p) − h p (log p + H)] is a sum of terms that cancel for some v; an fp32
    # result can only be relatively exact with respect to the size of those terms. log p itself is
    # (z − m)·(1/τ) − log s rounded in fp32: exact only relative to (|z| + |m|)/τ (≫ |log p|
    # where p ≈ 1, unless τ = 1), and H sums p·log p. (In place where it can be: at V = 152k each
    # new fp64 tensor costs more in page faults than its arithmetic.)
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    # g·(1[v=y] + p)
    scale = p.clone().scatter_add_(1, targets[:, None], torch.ones_like(g)[:, None]).mul_(g.abs()[:, None])
    if grad_entropy is not None:  # else h = 0 adds exactly 0
        # |log p| + |z| + |m| where p > 0, else 0; then h·p·(that + Σ p·that)
        log_p_size = log_p.abs_().add_(z.abs_()).add_(m.abs()[:, None]).masked_fill_(~(p > 0), 0.0)
        entropy_size = (p * log_p_size).sum(-1, keepdim=True)
        scale.add_((h.abs()[:, None] * p).mul_(log_p_size.add_(entropy_size)))
    return Ref(logp.detach(), entropy.detach(), lse_parts, grad, scale.div_(temperature))


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


class Case(NamedTuple):
    logits: torch.Tensor
    targets: torch.Tensor
    grad_logp: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]
    ref: Ref


@functools.lru_cache(maxsize=None)
def case_inputs(shape, dtype, temperature):
    """(logits, targets, grad_logp, grad_entropy) of a contract case: logits N(0, 3²) rounded to
    `dtype`, targets with both ends of a row among them (0 in the first row, V − 1 in the last), and
    incoming gradients N(0, 1). Drawn from a generator seeded by the case, so every backend, and
    the forward and the backward test of a case, get the same inputs. Shared: do not modify them."""
    n, vocab = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, DTYPE_IDS[dtype], temperature)).encode()))
    logits, targets = _inputs(n, vocab, dtype, generator=gen)
    targets[0], targets[-1] = 0, vocab - 1
    return logits, targets, torch.randn(n, generator=gen), torch.randn(n, generator=gen)


@functools.lru_cache(maxsize=None)
def contract_case(shape, dtype, temperature, grad_logp=False, grad_entropy=False):
    """The inputs of `case_inputs` (the incoming gradients only where asked for: None otherwise) and
    their fp64 reference, computed once per case, not once per backend (at V = 152k it takes most
    of a test's time). Shared: do not modify them."""
    logits, targets, g, h = case_inputs(shape, dtype, temperature)
    g, h = (g if grad_logp else None), (h if grad_entropy else None)
    return Case(logits, targets, g, h, _reference(logits, targets, temperature, g, h))


def misaligned(logits):
    """The same values in a contiguous tensor whose first element is not 16-byte aligned."""
    flat = torch.empty(logits.numel() + 1, dtype=logits.dtype, device=logits.device)[1:]
    return flat.view(logits.shape).copy_(logits)


def grid_logits(n, vocab, device="cpu"):
    """Logits on a 1/64 grid in [−8, 8): z + 100 is exact in fp32, so only a kernel can differ."""
    return (torch.randint(-512, 512, (n, vocab)).float() / 64).to(device)


def minus_inf_case(vocab, dtype, lead):
    """(logits, targets, masked) of 4 rows: masked vocabulary entries are −inf, targets never.
    Row 0: about half of the entries; row 1: the first `lead` entries (more than one block or tile,
    so the running max stays −inf for a while; the target after them) and about half of the rest;
    row 2: every entry except the target (a valid row: logp = H = 0, a zero gradient); row 3: only
    the last 40 entries (the partial last tile), target 5."""
    logits, targets = _inputs(4, vocab, dtype)
    masked = torch.rand(4, vocab) < 0.5
    masked[1, :lead] = True
    targets[1] = lead + 100
    masked[2] = True
    masked[3] = False
    masked[3, -40:] = True
    targets[3] = 5
    masked[torch.arange(4), targets] = False
    return logits.masked_fill(masked, float("-inf")), targets, masked


# Rows of nan_rows_case: log_softmax's NaN in logp and H, and a NaN gradient; the rest are valid.
NAN_ROWS, VALID_ROWS = [1, 3, 4, 5], [0, 2]


def nan_rows_case(vocab, dtype, n=6):
    """(logits, targets): row 1 holds a NaN past the first block, row 3 a +inf, row 4 is −inf but
    for one NaN (which must not be lost among the −inf), row 5 all −inf; the valid rows: row 0 with
    about half of its entries −inf, row 2 −inf but for its target."""
    logits, targets = _inputs(n, vocab, dtype)
    masked = torch.rand(vocab) < 0.5
    masked[targets[0]] = False
    logits[0, masked] = float("-inf")
    logits[1, vocab - 100] = float("nan")
    logits[2] = float("-inf")
    logits[2, targets[2]] = 1.0
    logits[3, 7] = float("inf")
    logits[4] = float("-inf")
    logits[4, 5] = float("nan")
    logits[5] = float("-inf")
    return logits, targets


class BadArgs(NamedTuple):
    """Valid arguments on `device`: 4 rows × V = 10 fp32 logits, targets, the backward's row inputs
    (lse_parts (4, 2), entropy (4,), grad_logp (4,))."""
    logits: torch.Tensor
    targets: torch.Tensor
    lse_parts: torch.Tensor
    entropy: torch.Tensor
    grad_logp: torch.Tensor
    device: str


# An argument that breaks the contract, refused (by the backends that check it: test_kernel_contract
# says which) with an error naming it. id: (the argument named, "fwd" or "bwd", the call's arguments
# before need_entropy (fwd) or after them the temperature 1.0 (bwd)).
BAD_INPUTS = {
    "logits-int64": ("logits", "fwd", lambda a: (a.logits.long(), a.targets, 1.0)),
    "logits-4d": ("logits", "fwd", lambda a: (a.logits[None, None], a.targets, 1.0)),  # (N, V) or (B, T, V) only
    "logits-transposed": ("logits", "fwd", lambda a: (a.logits.t(), torch.zeros(10, dtype=torch.long, device=a.device),
                                                      1.0)),
    "logits-fp64": ("logits", "fwd", lambda a: (a.logits.double(), a.targets, 1.0)),
    "targets-float": ("targets", "fwd", lambda a: (a.logits, a.targets.float(), 1.0)),
    "targets-short": ("targets", "fwd", lambda a: (a.logits, a.targets[:3], 1.0)),
    "targets-out-of-range": ("targets", "fwd", lambda a: (a.logits, a.targets + 10, 1.0)),
    "targets-on-cpu": ("targets", "fwd", lambda a: (a.logits, a.targets.cpu(), 1.0)),
    "temperature-zero": ("temperature", "fwd", lambda a: (a.logits, a.targets, 0.0)),
    "lse_parts-short": ("lse_parts", "bwd", lambda a: (a.logits, a.targets, a.lse_parts[:3], a.entropy, a.grad_logp,
                                                       None)),
    "lse_parts-logsumexp": ("lse_parts", "bwd", lambda a: (a.logits, a.targets, a.lse_parts.sum(1), a.entropy,
                                                           a.grad_logp, None)),  # a logsumexp (N,) is not the pair
    "grad_logp-short": ("grad_logp", "bwd", lambda a: (a.logits, a.targets, a.lse_parts, a.entropy, a.grad_logp[:2],
                                                       None)),
    "grad_entropy-short": ("grad_entropy", "bwd", lambda a: (a.logits, a.targets, a.lse_parts, a.entropy, a.grad_logp,
                                                             a.grad_logp[:1])),
    "entropy-empty": ("entropy", "bwd", lambda a: (a.logits, a.targets, a.lse_parts, a.entropy[:0], a.grad_logp,
                                                   a.grad_logp)),
    "logits-half-transposed": ("logits", "bwd", lambda a: (a.logits.half().t(), a.targets, a.lse_parts, a.entropy,
                                                           a.grad_logp, None)),
}


def bad_out_case(case, device):
    """(logits, out): fp32 logits (4, 100) at the start of a larger storage, and an `out` for their
    backward that is wrong in one way, `case`."""
    storage = torch.empty(4 * 100 + 50, device=device)
    logits = storage[:400].view(4, 100).copy_(_inputs(4, 100, torch.float32)[0])
    out = {
        "bf16": lambda: torch.empty(4, 100, dtype=torch.bfloat16, device=device),  # dtype
        "fp16": lambda: torch.empty(4, 100, dtype=torch.float16, device=device),
        "shape": lambda: torch.empty(4, 99, device=device),
        "stride": lambda: torch.empty(100, 4, device=device).t(),  # stride over V
        "overlap": lambda: storage[50:].view(4, 100),  # not the logits, yet overlapping them
    }[case]()
    return logits, out


BAD_OUT = ["bf16", "fp16", "shape", "stride", "overlap"]


def assert_close_rel(actual, expected, tol):
    """Relative error ≤ tol, measured against max(|expected|, 1) for log-domain values."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def assert_grad_close(actual, expected, tol):
    """Elementwise relative error ≤ tol, with entries far below the largest one (p_v/τ for a
    tail token) held to tol times the largest."""
    atol = tol * expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=atol)


def assert_rounded(grad, grad32):
    """``grad`` is ``grad32`` rounded to grad's dtype, within one ulp (the Triton interpreter
    truncates fp32 → bf16 where CUDA rounds to nearest even)."""
    expected = grad32.to(grad.dtype).double()
    torch.testing.assert_close(grad.double(), expected, rtol=ULP[grad.dtype], atol=2.0**-24)


def bwd_fp32(kernels, logits, targets, lse_parts, entropy, g, h, temperature):
    """A backward's gradient before its rounding to the logits' dtype (written into fp32: Triton's
    `out` takes any float dtype)."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, temperature, out=out)


class ExactBounds:
    """The bounds of the compiled kernels and the torch backend: logp, entropy and lse_parts within
    TOL_OUT of the reference for every logits dtype (`_close`), the gradient in the logits' dtype
    within fp32's error of the exactly rounded reference (`_close_grad`)."""

    @staticmethod
    def outputs(actual, expected, dtype):
        _close(actual.cpu(), expected)

    @staticmethod
    def grads(kernels, logits, targets, lse_parts, entropy, g, h, temperature, ref):
        """The backward's gradient(s) checked against `ref`; returns them (on the logits' device)."""
        grad = kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, temperature)
        assert grad.dtype == logits.dtype and grad.shape == logits.shape and grad.device == logits.device
        _close_grad(grad.cpu(), ref)
        return [grad]


class RelativeBounds:
    """Triton's bounds (docs/design.md §9): outputs within TOL_REL[dtype], relative, of the
    reference; the gradient written into fp32 (before its rounding) within TOL_REL[dtype] of it
    (`assert_grad_close`), and the gradient in the logits' dtype within one ulp of that fp32 one."""

    @staticmethod
    def outputs(actual, expected, dtype):
        assert_close_rel(actual.cpu(), expected, TOL_REL[dtype])

    @staticmethod
    def grads(kernels, logits, targets, lse_parts, entropy, g, h, temperature, ref):
        grad32 = bwd_fp32(kernels, logits, targets, lse_parts, entropy, g, h, temperature)
        assert_grad_close(grad32.cpu(), ref.grad, TOL_REL[logits.dtype])
        grad = kernels.token_logprobs_bwd(logits, targets, lse_parts, entropy, g, h, temperature)
        assert grad.dtype == logits.dtype and grad.shape == logits.shape and grad.device == logits.device
        assert_rounded(grad, grad32)
        return [grad32, grad]
