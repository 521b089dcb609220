"""`fused_policy_loss`: from logits to the policy loss in one read of the logits forward and
one read + one write backward, or (token-level losses on the cpu) one read and one write in all.

Token-level losses (`ratio="token"`: PPO, GRPO, DAPO, Dr. GRPO, CISPO, ...): the backend's
`policy_token_fwd` kernel reads each row once and, in the same program, evaluates the token's
loss, its derivatives w.r.t. log-prob and entropy and the token's statistics; a few ops reduce
those to the loss and the metrics. Other ratios couple the tokens of a row or group: the forward
kernel gives log-probs and entropy, then the loss and its derivatives come from the backend's
`policy_token_loss` (`_sequence_step`) or, for the rest, from `losses/` (the spec) and its
autograd on `(B, T)` tensors. Either way the backward is one kernel over the logits from the
per-token derivatives times the incoming gradient (an `(N,)` product, no N × V pass), written
into a new buffer or, with `inplace=True`, into the logits themselves: 3 passes over the logits.

Two passes where the backend has `policy_token_fwd_grad` (cpu by default; cuda on sm_90 and triton when asked) and the
forward kernel evaluates the loss: that kernel also writes ∂logits, for the incoming gradient `grad_scale`, from the
same read of each row; the backward hands it over, scaled once only when the incoming gradient differs
(docs/design.md §2).

Under `torch.compile` (and without autograd) the value is the composition
`policy_loss(token_logprobs(...))`, which traces through the registered ops.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_softcap
from .._dtypes import acc_dtype
from ..kernels.softcap import with_softcap
from ..losses import LossOutput, PolicyLossConfig
from ..losses.spec import LossInputs, takes_loss_args
from ._logits_grad import deferred_logits_grad, grad_buffers, written_logits_grad
from ._loss_step import TokenForward, composed, run_step
from ._plan import Step, plan, warn_general_path
from ._returned_grads import differentiable
from ._rows import check_logits_args, logits_rows, run_blocks
from .token_logprobs import _define as define_ops, token_logprobs

# {backend: the shortest row (V) from which the two-pass row is the default}: where it was measured faster (cpu:
# 1.6-2.0x from V = 32 up; at V = 16 slower in two runs of three: too short a row to amortise its set-up;
# benchmarks/RESULTS.md). cuda (sm_90) and triton (the split row) have the kernel but take it only when asked until a
# device run shows it exact and faster (design.md §7).
TWO_PASS_BY_DEFAULT = {"cpu": 32}


@takes_loss_args
def fused_policy_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Optional[Tensor],
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    inplace: bool = False,
    two_pass: Optional[bool] = None,
    grad_scale: float = 1.0,
    backend: Optional[str] = None,
    **loss_args,
) -> LossOutput:
    """`policy_loss(token_logprobs(logits, targets), ...)` in one call, without its N × V temporaries.

    logits `(B, T, V)`, targets `(B, T)`; the other arguments are those of `policy_loss`. The
    entropy is always computed (the `entropy` metric, and the bonus when `entropy_coef != 0`).
    `softcap` c: the logits are the head's output before a final-logit cap c·tanh(z/c) (as
    `token_logprobs`). `inplace=True`: ∂logits is written over the logits (the caller gives them up) by the
    backward, on every backend; the logits keep their values until then. Only `two_pass=True, inplace=True`
    writes it by the forward: the logits hold ∂logits when the call returns (their version counter is bumped,
    so autograd refuses any node that saved them).

    `two_pass`: whether the forward writes ∂logits from its own read of each row (2 passes over the logits
    instead of 3). None: on the cpu backend from V = 32 up (`TWO_PASS_BY_DEFAULT`) where the config's loss is
    token-level (docs/design.md §4), for fp32 and fp64 logits and without `inplace`; True: required (cuda: sm_90 or
    later; triton: the split row) (ValueError where it cannot); False: never. Its gradient assumes the incoming gradient `grad_scale` (1 for
    `loss.backward()`; 1/k for `(loss / k).backward()`, gradient accumulation): then the backward moves nothing
    of size N × V. Another incoming gradient c costs one pass scaling the written gradient by c / grad_scale:
    for fp32 and fp64 logits within a rounding of that dtype; for bf16 only where c / grad_scale is a power
    of two (exact), for fp16 only where c equals grad_scale (a gradient written at another scale has lost
    its small entries), else the backward raises: a 16-bit gradient rounded twice would not be the
    three-pass one. `grad_scale`: a number of magnitude in [2^-64, 2^64] (fp64 logits: [2^-512, 2^512]),
    where σ·∂logits keeps the dtype's precision; a magnitude outside is refused.

    Memory: on the two-pass path the N × V gradient is allocated and written by the call itself. A forward
    with grad enabled and no backward (an evaluation or a logged loss outside `torch.no_grad()`) pays that
    write and its memory until the graph is freed, and a large allocation between forward and backward adds
    to it (docs/design.md §2, benchmarks/RESULTS.md); run such forwards under `torch.no_grad()` or pass
    `two_pass=False`. On the two-pass path a second backward through the same graph raises.
    """
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected a bool, got {type(inplace).__name__}")
    if two_pass is not None and not isinstance(two_pass, bool):
        raise TypeError(f"two_pass: expected None or a bool, got {type(two_pass).__name__}")
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(f"logits: expected a tensor of shape (B, T, V), got {_describe(logits)}")
    _check_grad_scale(grad_scale, logits.dtype)

    def logprobs():
        return token_logprobs(logits, targets, temperature=temperature, softcap=softcap, return_entropy=True,
                              backend=backend)

    if torch.compiler.is_compiling():  # the custom ops trace; the deferred backward does not
        return composed(logprobs, advantages, mask, config, loss_args)
    name = _backend.resolve(backend, logits.device)
    if name in ("cpu", "cuda"):  # the extension's fake implementations, for fake tensors (benchmarks.traffic)
        define_ops(name)
    temperature = check_logits_args(logits, targets, temperature, name)
    kernels = with_softcap(_backend.kernels(name), check_softcap(softcap))
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    decided = plan(config, kernels)
    warn_general_path(decided, name)
    # Without a gradient the fused kernel still pays: its statistics are the loss and the metrics,
    # one launch where the composition makes ~60 (on a GPU the forward was host-bound).
    if not needs_grad and decided.step is not Step.FORWARD:
        return composed(logprobs, advantages, mask, config, loss_args)
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace: the gradient can only overwrite contiguous logits (got a strided view)")
    inputs = LossInputs.build(config, shape=tuple(targets.shape), dtype=acc_dtype(logits), device=logits.device,
                              mask=mask, advantages=advantages, what="logits (B, T, V)", **loss_args)
    rows = logits_rows(logits, to_parent=needs_grad and not inplace)  # a (B, T, V) slice is read where it lies, not copied
    written = _WrittenBy(rows, float(grad_scale), inplace) if _two_pass(
        two_pass, decided.step, kernels, needs_grad, logits.dtype, name, logits.shape[-1], inplace) else None
    logits_pass = _OneTensor(kernels, rows.blocks, targets.reshape(-1).to(torch.int64), temperature, written)
    out, logp, entropy = run_step(logits_pass, decided.step, inputs, config)
    loss = out.loss
    if written is not None:
        if inplace:  # the logits now hold ∂logits: autograd refuses any node that saved them
            torch.autograd.graph.increment_version(rows.grad_input)
        loss = written_logits_grad(loss, rows, written.grad, written.scale, kernels)
    elif needs_grad:
        loss = deferred_logits_grad(loss, rows, logits_pass.targets, logits_pass.per_row, temperature, kernels, inplace)
    overwritten = written is not None and inplace

    def logprobs_again(z):  # only when a gradient reaches the returned ℓ or H (`_returned_grads`)
        if overwritten:
            raise RuntimeError("fused_policy_loss: out.logp and out.entropy have no gradient after two_pass=True, "
                               "inplace=True: the logits were overwritten by the call; pass inplace=False")
        return token_logprobs(z, targets, temperature=temperature, softcap=softcap, return_entropy=True,
                              backend=backend)

    logp, entropy = differentiable(logp.view(targets.shape), entropy.view(targets.shape), (logits,), logprobs_again)
    return LossOutput(loss, out.metrics, logp, entropy)


def _check_grad_scale(grad_scale, dtype: torch.dtype) -> None:
    """σ within 2^±64 (fp64: 2^±512): σ·∂logits then stays a normal number of the accumulation dtype for
    gradient entries down to 2^-62 (2^-510), so a later rescale by c / σ restores them."""
    bound = 512 if dtype == torch.float64 else 64
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not (
            math.isfinite(grad_scale) and 2.0 ** -bound <= abs(grad_scale) <= 2.0 ** bound):
        raise ValueError(f"grad_scale: expected a number of magnitude in [2^-{bound}, 2^{bound}] for {dtype} logits, "
                         f"got {grad_scale!r}")


def _two_pass(requested: Optional[bool], step: Step, kernels, needs_grad: bool, dtype: torch.dtype,
              backend: str, vocab: int, inplace: bool) -> bool:
    """Whether the forward writes ∂logits (`two_pass` of `fused_policy_loss`); raises where it was required and
    cannot. By default only on the backends of TWO_PASS_BY_DEFAULT, at rows that long or longer, for fp32 and fp64
    logits (16-bit ones: an incoming gradient other than the declared one, a loss scale or an undeclared 1/k, would
    round the written gradient twice or flush its small entries; `_logits_grad._Written`), and not with `inplace`,
    whose logits the default overwrites only in the backward."""
    if not needs_grad or requested is False:
        return False
    if requested is None and (dtype not in (torch.float32, torch.float64) or inplace
                              or vocab < TWO_PASS_BY_DEFAULT.get(backend, float("inf"))):
        return False
    why = kernels.supports("policy_token_fwd_grad")
    if why is None and step is not Step.FORWARD:
        why = f"the config's loss needs every row's log-prob first (the {step.value} step, docs/design.md §4)"
    if why is not None and requested:
        raise ValueError(f"two_pass: {why}")
    return why is None


class _WrittenBy:
    """Where the two-pass forward writes ∂logits (`_logits_grad.grad_buffers`) for the incoming gradient `scale`;
    `grad` once written."""

    def __init__(self, rows, scale: float, inplace: bool):
        self.rows, self.scale = rows, scale
        self.grad, self.outs = grad_buffers(rows, inplace)


class _OneTensor:
    """The pass over one logits tensor, one launch per kernel (`_loss_step.LogitsPass`; per block only for a
    view whose dims do not collapse into two strides, `_rows.logits_rows`). Its gradient is deferred to
    the backward, one kernel pass over the logits from `per_row` = (lse_parts, H, ∂loss/∂ℓ, ∂loss/∂H or None),
    or, with `written`, written by `fused` itself (the two-pass row)."""

    def __init__(self, kernels, blocks, targets: Tensor, temperature: float, written: Optional[_WrittenBy] = None):
        self.kernels, self.blocks, self.targets, self.temperature = kernels, blocks, targets, temperature
        self.written = written
        self.lse_parts = self.entropy = self.per_row = None

    def fused(self, forward: TokenForward):
        if self.written is not None:
            return self._fused_two_pass(forward)
        logp, entropy, lse_parts, grad_logp, grad_entropy, stats = run_blocks(
            self.kernels.policy_token_fwd, self.blocks, [self.targets, *forward.per_row], self.temperature,
            forward.params)
        self.per_row = (lse_parts, entropy, grad_logp, forward.entropy_grad(grad_entropy))
        return logp, entropy, stats

    def _fused_two_pass(self, forward: TokenForward):
        """(ℓ, H, statistics), and ∂logits written into `self.written` (one launch per block)."""
        w = self.written
        entropy_grad = forward.bonus_grad if forward.need_entropy_grad else None
        parts = []
        for (s, e, block), out in zip(self.blocks, w.outs):
            parts.append(self.kernels.policy_token_fwd_grad(
                block, self.targets[s:e], *(None if x is None else x[s:e] for x in forward.per_row),
                None if entropy_grad is None else entropy_grad[s:e], self.temperature, forward.params, w.scale,
                out=out))
        if w.grad is None:  # the kernel allocated it (one contiguous block)
            w.grad = parts[0][3].view(w.rows.grad_input.shape)
        if len(parts) == 1:
            return parts[0][:3]
        return tuple(torch.cat(outputs) for outputs in zip(*(p[:3] for p in parts)))

    def logprobs(self):
        logp, self.entropy, self.lse_parts = run_blocks(self.kernels.token_logprobs_fwd, self.blocks, [self.targets],
                                                        self.temperature, True)
        return logp, self.entropy

    def backward(self, grad_logp, grad_entropy):
        self.per_row = (self.lse_parts, self.entropy, grad_logp, grad_entropy)


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
