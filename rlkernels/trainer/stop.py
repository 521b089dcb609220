"""Ctrl-C and SIGTERM (what batch schedulers send), from the start of a run to its end: the run goes on to the
next point where a checkpoint resumes it exactly (the end of an RL step; before RL, the end of the warm-up and
of the evaluation before RL), saves one and stops. A second signal interrupts at once (KeyboardInterrupt). A stopped run exits 128 + the signal's number (130 for
Ctrl-C, 143 for SIGTERM), as a process killed by it would, so that a scheduler can tell it from a finished one."""
from __future__ import annotations

import signal


def exit_code(signal_name: str) -> int:
    """The exit status of a run stopped by `signal_name` (a StopRequest's `signal`)."""
    return 128 + signal.Signals[signal_name].value


class StopRequest:
    """A context that turns SIGINT and SIGTERM into `requested`; `until` names, for the message, what the run
    finishes before it saves."""

    def __init__(self, log):
        self.requested = False
        self.signal = None  # the first signal's name: SIGINT (Ctrl-C) or SIGTERM
        self.until = "the set-up before RL"
        self._log = log
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be restored
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.signal = signal.Signals(signum).name
        self._log(f"\n{name}: finishing {self.until}, then saving a checkpoint ({name} again to abort)")
