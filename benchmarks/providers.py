"""Who is benchmarked: every implementation of the ops in workloads.py, behind one interface.

`build(case, inputs)` returns `step(*leaves) -> 0-d tensor` (the loss, or the sum of the
log-probs), with `leaves` = `inputs.leaves()`. Providers:
  eager               TRL's pattern: `selective_log_softmax` (fp32: gather minus a per-row
                      logsumexp; half precision: a per-row log_softmax) and its chunked entropy,
                      then the GRPO loss written plainly in PyTorch; logits = hidden @ weight.T
  compile             `torch.compile` of eager (default, dynamic-after-recompile shapes)
  liger               Liger-Kernel: `LigerFusedLinearGRPOLoss` (hidden states, any device) and
                      its Triton `triton_grpo_loss` (logits, CUDA)
  rlkernels-<backend> every rlkernels backend that runs on the device (but the torch
                      backend on CUDA): token_logprobs, fused_policy_loss, fused_linear_policy_loss
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .workloads import OPS, Case, Inputs, make_inputs

CLIP, KL_COEF = 0.2, 0.04  # presets.grpo()
ENTROPY_CHUNK_ROWS = 128   # TRL's entropy_from_logits works through the rows in chunks


# ---- eager PyTorch, TRL's pattern ----------------------------------------------------------

def selective_log_softmax(logits, targets):
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, targets[..., None]).squeeze(-1)
        # one row at a time: the (T, V) exp of logsumexp is the only V-sized temporary
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack([torch.log_softmax(row, dim=-1).gather(-1, t[:, None]).squeeze(-1)
                        for row, t in zip(logits, targets)])


@torch.no_grad()
def entropy(logits):
    """Entropy of every position, as a metric (no gradient), a chunk of rows at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for chunk in flat.split(ENTROPY_CHUNK_ROWS):
        chunk = chunk.float()
        p = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (p * chunk).sum(-1))
    return torch.cat(out).view(logits.shape[:-1])


def grpo_loss(logp, inputs: Inputs):
    """The GRPO loss written plainly: clipped surrogate + β·k3, per-row token mean, batch mean."""
    logp = logp.float()
    adv = inputs.advantages[:, None]
    ratio = torch.exp(logp - inputs.old_logp)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    delta = inputs.ref_logp - logp
    per_token = per_token + KL_COEF * (torch.exp(delta) - delta - 1)
    mask = inputs.mask.float()
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _eager(op):
    if op == "grpo_sliced":
        grpo = _eager("grpo")
        return lambda logits, inputs: grpo(logits[:, :-1], inputs)

    def from_logits(logits, inputs):
        logp = selective_log_softmax(logits, inputs.targets)
        if op == "token_logprobs":
            return logp.float().sum()
        entropy(logits)  # TRL computes it for its metrics
        return grpo_loss(logp, inputs)

    if op != "grpo_linear":
        return from_logits
    return lambda hidden, weight, inputs: from_logits(hidden @ weight.t(), inputs)


@functools.lru_cache(maxsize=None)
def _compiled(op):
    """One compiled function per op, reused across sizes (recompiled once, then dynamic)."""
    return torch.compile(_eager(op))


# ---- providers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Provider:
    name: str
    ops: Tuple[str, ...]
    build: Callable[[Case, Inputs], Callable]
    unavailable: Callable[[torch.device, str], Optional[str]] = lambda device, op: None  # reason, or None
    extra_position: bool = False  # takes (B, T + 1, V) logits


def _build_eager(case, inputs):
    fn = _eager(case.op)
    return lambda *leaves: fn(*leaves, inputs)


def _build_compile(case, inputs):
    fn = _compiled(case.op)
    return lambda *leaves: fn(*leaves, inputs)


def _rlkernels(backend):
    def build(case, inputs):
        import rlkernels
        from rlkernels import presets

        config = presets.grpo()
        kw = dict(old_logp=inputs.old_logp, ref_logp=inputs.ref_logp, backend=backend)
        if case.op == "token_logprobs":
            return lambda logits: rlkernels.token_logprobs(logits, inputs.targets, backend=backend).sum()
        if case.op in ("grpo", "grpo_sliced"):
            cut = slice(None, -1) if case.op == "grpo_sliced" else slice(None)
            return lambda logits: rlkernels.fused_policy_loss(logits[:, cut], inputs.targets, inputs.advantages,
                                                              inputs.mask, config, **kw).loss
        return lambda hidden, weight: rlkernels.fused_linear_policy_loss(
            hidden, weight, inputs.targets, inputs.advantages, inputs.mask, config, **kw).loss

    def unavailable(device, op):
        import rlkernels

        info = rlkernels.backend_info()[backend]
        if not info["available"]:
            return info["reason"]
        if backend == "triton" and device.type != "cuda":
            return "the Triton interpreter is for tests, not timing"
        if backend == "cuda" and device.type != "cuda" or backend == "cpu" and device.type != "cpu":
            return f"runs on {backend} tensors only"
        if backend == "torch" and device.type == "cuda":  # the reference composition: no contender there
            return "the reference backend (PyTorch ops, 63–495 ms per call on an H200): not timed on CUDA"
        return None
    return Provider(f"rlkernels-{backend}", OPS, build, unavailable)


def _liger_unavailable(device, op):
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed (pip install liger-kernel)"
    if op in ("grpo", "grpo_sliced") and device.type != "cuda":
        return "Liger's Triton GRPO loss runs on CUDA only"
    return None


def _build_liger(case, inputs):
    mask, T = inputs.mask, inputs.targets.shape[1]
    if case.op in ("grpo", "grpo_sliced"):  # Liger takes the (B, T + 1, V) logits either way
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def step(logits):
            per_token = triton_grpo_loss(logits, inputs.old_logp, inputs.ref_logp, inputs.targets, inputs.advantages,
                                         mask, temperature=1.0, beta=KL_COEF, eps_low=CLIP, eps_high=CLIP,
                                         inplace=True, loss_type="grpo")[0]
            m = mask.float()
            return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
        return step
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=KL_COEF, epsilon_low=CLIP, epsilon_high=CLIP, loss_type="grpo",
                                       max_completion_length=T)
    return lambda hidden, weight: loss_fn(hidden, weight, inputs.targets, mask.long(), inputs.advantages,
                                          ref_per_token_logps=inputs.ref_logp, old_per_token_logps=inputs.old_logp)[0]


def all_providers():
    from rlkernels._backend import BACKENDS

    return [Provider("eager", OPS, _build_eager),
            Provider("compile", OPS, _build_compile),
            Provider("liger", ("grpo", "grpo_sliced", "grpo_linear"), _build_liger, _liger_unavailable, extra_position=True),
            *[_rlkernels(b) for b in BACKENDS]]


def runnable(op: str, device: torch.device, names=None):
    """[(provider, reason-it-cannot-run or None)] for `op` on `device`, in report order."""
    out = []
    for p in all_providers():
        if op not in p.ops or (names and p.name not in names):
            continue
        out.append((p, p.unavailable(device, op)))
    return out


def prepare(case: Case, provider: Provider, device):
    """(step, leaves, inputs): `step()` runs the op once (and its backward in fwd+bwd mode)."""
    inputs = make_inputs(case, device, extra_position=provider.extra_position and case.op in ("grpo", "grpo_sliced"))
    backward = case.mode == "fwd+bwd"
    leaves = [x.requires_grad_(backward) for x in inputs.leaves()]
    fn = provider.build(case, inputs)

    def step():
        out = fn(*leaves)
        if backward:
            out.backward()
        return out
    return step, leaves, inputs


def check_agrees_with_eager(case: Case, provider: Provider, device) -> None:
    """Raise unless `provider` computes what eager computes on the same inputs (forward value, and
    in fwd+bwd mode the gradients): a benchmark must time the right thing. Use fp32: in half
    precision the providers differ by their rounding (TRL's pattern rounds log-probs to bf16)."""
    step, leaves, inputs = prepare(case, provider, device)
    got = step().detach().double()
    grads = [x.grad for x in leaves]
    T = inputs.targets.shape[1]
    ref_leaves = [x.detach()[:, :T].contiguous().requires_grad_(x.requires_grad) if provider.extra_position
                  and case.op == "grpo" else x.detach().requires_grad_(x.requires_grad) for x in leaves]
    ref = _eager(case.op)(*ref_leaves, inputs)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, ref.detach().double(), **tol, msg=lambda m: f"{provider.name} {case}: {m}")
    if case.mode == "fwd+bwd":
        ref.backward()
        for g, x in zip(grads, ref_leaves):
            g = g[:, :T] if g.shape != x.grad.shape else g
            torch.testing.assert_close(g.double(), x.grad.double(), **tol,
                                       msg=lambda m: f"{provider.name} {case} gradient: {m}")
