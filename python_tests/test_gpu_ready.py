"""What a GPU run needs beyond the kernels' values: a capturable step, and fp16 logits under a loss scale.

* CUDA graphs: one `fused_policy_loss` forward + backward captured and replayed on new inputs equals eager
  (no host sync, no host-side allocation that capture refuses). GPU only (`benchmarks/gpu_check.sh`).
* fp16 logits: a gradient entry is about p_v·|∂loss/∂logp|, far below fp16's smallest normal (6e-5) for
  most of a 150k vocabulary, so an unscaled fp16 gradient flushes to zero, as in any fp16 training. The loss
  scale of `torch.amp.GradScaler` reaches the kernels as the incoming gradient and multiplies the per-token
  derivatives in fp32 before the one rounding to fp16: the scaled gradient is the fp32 one times the scale,
  to fp16's rounding.
"""
import pytest
import torch

import rlkernels
from rlkernels import presets

CPU_BACKENDS = [b for b in ("cpu", "torch") if rlkernels.backend_info()[b]["available"]]


def _inputs(B=4, T=16, V=3000, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T + 1, V, generator=g) * 3
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    adv = torch.randn(B, generator=g)
    old = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None])[..., 0] + 0.1 * torch.randn(B, T, generator=g)
    return [t.to(device) for t in (logits, targets, mask, adv, old)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp16_gradient_under_a_loss_scale(backend):
    logits, targets, mask, adv, old = _inputs()
    logits = logits.half().float()  # the same values in both dtypes
    scale = 2.0 ** 12  # a scale GradScaler reaches here (it backs off from 2^16 while gradients overflow)
    grads = {}
    for dtype, s in ((torch.float32, 1.0), (torch.float16, scale), (torch.float16, 1.0)):
        parent = logits.to(dtype).clone().requires_grad_(True)
        out = rlkernels.fused_policy_loss(parent[:, :-1], targets, adv, mask, presets.grpo(), old_logp=old,
                                          ref_logp=old, backend=backend)
        (out.loss * s).backward()
        grads[dtype, s] = parent.grad.float()
    exact = grads[torch.float32, 1.0] * scale
    # every entry to fp16's rounding (2^-11 relative) of the scaled value, where that is a normal fp16
    normal = exact.abs() > 2.0 ** -14
    torch.testing.assert_close(grads[torch.float16, scale][normal], exact[normal], rtol=2.0 ** -10, atol=0)
    # unscaled, many entries of even this 3000-token vocabulary flush to zero: why fp16 needs the scale
    nonzero = grads[torch.float32, 1.0] != 0
    lost = (grads[torch.float16, 1.0] == 0) & nonzero
    assert lost.sum() > 0.3 * nonzero.sum()  # 54% at this size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("preset", ["grpo", "gspo"])
def test_cuda_graph_capture_of_a_loss_step(backend, preset):
    if not rlkernels.backend_info()[backend]["available"]:
        pytest.skip(rlkernels.backend_info()[backend]["reason"])
    config = presets.get(preset)
    static = _inputs(device="cuda")
    parent = static[0].to(torch.bfloat16).requires_grad_(True)

    def step():
        out = rlkernels.fused_policy_loss(parent[:, :-1], *static[1:4], config, old_logp=static[4],
                                          ref_logp=static[4], backend=backend)
        out.loss.backward()
        return out.loss

    side = torch.cuda.Stream()  # warm-up on a side stream, as capture requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            parent.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    parent.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()

    fresh = _inputs(device="cuda", seed=1)
    with torch.no_grad():
        parent.copy_(fresh[0].to(torch.bfloat16))
        for s, f in zip(static[1:], fresh[1:]):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()

    eager = fresh[0].to(torch.bfloat16).requires_grad_(True)
    out = rlkernels.fused_policy_loss(eager[:, :-1], *fresh[1:4], config, old_logp=fresh[4], ref_logp=fresh[4],
                                      backend=backend)
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss)
    torch.testing.assert_close(parent.grad, eager.grad)
