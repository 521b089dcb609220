"""`token_logprobs`: per-token log-probs and entropy as `torch.library` ops (docs/design.md §2, §5).

The compiled backends (cpu, cuda) run the extension's own op, `rlkernels_C::token_logprobs_fwd`,
with its fake and autograd registered on it (`_c_ops`). The triton and torch backends get one
forward and one backward Python op, `rlkernels::token_logprobs_fwd_<backend>` and
`..._bwd_<backend>`, with fake implementations (so `torch.compile(fullgraph=True)` traces through
them) and the same autograd formula. The Triton backend's ops are `triton_op`s whose kernels are
launched through `wrap_triton`, so the compiler sees the kernels themselves rather than an opaque
call.
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _backend
from .._checks import FLOAT_DTYPES, check_softcap, check_tensor
from ..kernels._extension import python_errors
from ..kernels.softcap import with_softcap
from . import _c_ops
from ._logits_grad import logits_grad
from ._precomputed_grad import refuse_create_graph
from ._rows import check_logits_args, logits_rows, run_blocks

_OPS = {}
_DEFINE_LOCK = threading.Lock()


def _define(name: str):
    """Define (once, under a lock: two threads' first calls must not both register) the
    forward/backward ops of backend `name`: for cpu and cuda the compiled extension's own op
    (`_c_ops`, shared by both), for triton and torch a Python op pair."""
    with _DEFINE_LOCK:
        if name not in _OPS:
            if name in ("cpu", "cuda"):
                _OPS["cpu"] = _OPS["cuda"] = _OPS.get("cpu") or _c_ops.register()
            else:
                _OPS[name] = _register(name)
        return _OPS[name]


def define_available() -> Tuple[str, ...]:
    """Define the ops of every backend available here (`import rlkernels` does, docs/design.md §5), so that
    `torch.ops.rlkernels_C.*` and `torch.ops.rlkernels.token_logprobs_{fwd,bwd}_<backend>` exist before any
    call: a graph exported or compiled in another process finds them. Returns the backends defined."""
    names = tuple(n for n in _backend.BACKENDS if _backend.available(n))
    for name in names:
        _define(name)
    return names


def _register(name: str):
    if name == "triton":
        register, launch = torch.library.triton_op, {"wrap": torch.library.wrap_triton}
    else:
        register, launch = torch.library.custom_op, {}

    @register(f"rlkernels::token_logprobs_fwd_{name}", mutates_args=())
    def fwd(logits: Tensor, targets: Tensor, temperature: float, softcap: float,
            need_entropy: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return _backend.kernels(name).token_logprobs_fwd(logits, targets, temperature, need_entropy, softcap=softcap,
                                                         **launch)

    # For triton this replaces triton_op's fake (the body traced), which the interpreter cannot run.
    fwd.register_fake(_c_ops.logprobs_fwd_fake)

    @register(f"rlkernels::token_logprobs_bwd_{name}", mutates_args=())
    def bwd(
        logits: Tensor, targets: Tensor, lse_parts: Tensor, entropy: Tensor, grad_logp: Tensor,
        grad_entropy: Optional[Tensor], temperature: float, softcap: float,
    ) -> Tensor:
        return _backend.kernels(name).token_logprobs_bwd(logits, targets, lse_parts, entropy, grad_logp, grad_entropy,
                                                         temperature, softcap=softcap, **launch)

    bwd.register_fake(_c_ops.logprobs_bwd_fake)
    _c_ops.register_logprobs_autograd(fwd, bwd)
    return fwd


@torch.compiler.assume_constant_result
def _resolve(backend: Optional[str], device: torch.device) -> str:
    """The backend to run, its ops defined. Under torch.compile this runs once at trace time
    and its result is a constant: the first import of a backend cannot be traced."""
    name = _backend.resolve(backend, device)
    _define(name)
    return name


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    return_entropy: bool = False,
    backend: Optional[str] = None,
):
    """Log-probabilities of `targets` under softmax(logits / temperature), and the entropy.

    logits `(..., V)` fp32/bf16/fp16, targets `(...)` integers in `[0, V)`, already aligned
    (the caller shifts). `softcap` c > 0: the logits are the head's output before a final-logit
    cap, and the softmax is of c·tanh(logits/c) / temperature (Gemma 2 and 3). Returns fp32 log-probs shaped like `targets`, or `(logp, entropy)` when
    `return_entropy` is set. Differentiable w.r.t. `logits` through both outputs; the logits
    are read once forward and once backward, and nothing of size V is kept per token.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    name = _resolve(backend, logits.device)
    temperature = check_logits_args(logits, targets, temperature, name)
    softcap = check_softcap(softcap)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy: expected a bool, got {type(return_entropy).__name__}")
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    # The cpu kernel checks the target values: a ValueError, not a RuntimeError (traced: raised as the graph runs).
    op = _OPS[name] if torch.compiler.is_compiling() else python_errors(_OPS[name])
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if torch.compiler.is_compiling() or (needs_grad and logits.is_contiguous() and logits._base is None):
        # one op over the rows, with its registered autograd (under torch.compile: one op keeps the graph simple)
        logp, entropy, _ = op(logits.reshape(-1, logits.shape[-1]).contiguous(), flat_targets, temperature, softcap,
                              return_entropy)
    elif not needs_grad:  # old / reference log-probs: a slice is read where it lies, one launch
        logp, entropy, _ = run_blocks(op, logits_rows(logits).blocks, [flat_targets], temperature, softcap,
                                      return_entropy)
    else:  # a view with autograd: read in place, the gradient written once into the parent's shape
        rows = logits_rows(logits, to_parent=True)
        logp, entropy = _ViewLogprobs.apply(*rows.inputs(), rows, flat_targets, temperature, return_entropy,
                                            with_softcap(_backend.kernels(name), softcap))
    logp = logp.view(targets.shape)
    return (logp, entropy.view(targets.shape)) if return_entropy else logp


class _ViewLogprobs(torch.autograd.Function):
    """token_logprobs of the rows of a view (`_rows.LogitsRows`), differentiable w.r.t. `grad_input`:
    the parent of a box view gets its gradient from one pass of the backward kernel, without autograd's
    zero-filled parent-sized copy of a view-shaped gradient (docs/design.md §4)."""

    @staticmethod
    def forward(ctx, logits, parent, probe, rows, targets, temperature, need_entropy, kernels):
        logp, entropy, lse_parts = run_blocks(kernels.token_logprobs_fwd, rows.blocks, [targets], temperature,
                                              need_entropy)
        ctx.save_for_backward(logits, parent, lse_parts, entropy)  # saved: a later in-place change is refused
        ctx.rows, ctx.targets, ctx.temperature, ctx.need_entropy, ctx.kernels = (
            rows, targets, temperature, need_entropy, kernels)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_create_graph("token_logprobs")
        _, _, lse_parts, entropy = ctx.saved_tensors
        g = torch.zeros_like(lse_parts[:, 0]) if grad_logp is None else grad_logp.contiguous()
        h = grad_entropy.contiguous() if ctx.need_entropy and grad_entropy is not None else None
        target = ctx.rows.in_backward()
        grad = logits_grad(target, ctx.kernels, ctx.targets, lse_parts, entropy, g, h, ctx.temperature)
        return (*ctx.rows.returned(target, grad), None, None, None, None, None)
