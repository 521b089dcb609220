"""The loss head's share of an update step, logged as `time/loss_head_s`, `time/update_s` and
`time/loss_head_share` (their means over the step's optimizer steps, and the ratio of those means).

What is timed, per optimizer step:
  * the update: from the update's forward to the end of `optimizer.step()` (forward, backward, the
    value loss, gradient clipping and the step itself, with their collectives under torchrun);
  * the loss head: its forward (the `loss_head` call: the lm_head matmul and the fused op, or the op
    alone on the hidden-state path), plus its backward, from the moment autograd starts the node that
    made the loss to the moment the gradient of the head's input, the trunk's hidden states, is
    complete. Autograd runs the ready node created last first, so the value loss's and the critic's
    backward (made after the head) run before that interval and the trunk's (which needs that
    gradient) after it: the interval holds the head's backward only.
On the CPU these are wall times (perf_counter). On CUDA they are CUDA events recorded on the current
stream, with no synchronisation inside the timed region; they are read once the step's last event
has completed (one wait after `optimizer.step()`).
"""
from __future__ import annotations

import time

import torch


class LossHeadTimer:
    """Marks around one optimizer step: `begin_step`, then `loss_head` in the update's forward, then `end_step`."""

    def __init__(self):
        self.cuda, self.marks = False, {}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _mark(self, name: str) -> None:
        self.marks[name] = self._now()

    def _seconds(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def begin_step(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks = {}
        self._mark("step")

    def loss_head(self, run, hidden: torch.Tensor):
        """`run(x)`, the loss head on `x`, an alias of `hidden` whose gradient only the head forms: its forward is
        timed now, and its backward by hooks on the loss's node (start) and on `x` (end)."""
        x = hidden.view_as(hidden)
        self._mark("forward")
        out = run(x)
        self._mark("forward_end")
        if out.loss.grad_fn is not None and x.requires_grad:
            out.loss.grad_fn.register_prehook(lambda grad_outputs: self._mark("backward"))
            x.register_hook(lambda grad: self._mark("backward_end"))
        return out

    def end_step(self) -> dict:
        """The step's {`time/loss_head_s`, `time/update_s`} (the step ends now)."""
        self._mark("end")
        head = self._seconds("forward", "forward_end")
        if "backward_end" in self.marks:
            head += self._seconds("backward", "backward_end")
        return {"time/loss_head_s": head, "time/update_s": self._seconds("step", "end")}
