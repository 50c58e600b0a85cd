"""Stopping a run by signal: the first SIGINT/SIGTERM asks for a clean stop at the end of
the step (the trainer checkpoints and exits 128 + its number); a second one interrupts."""
from __future__ import annotations

import contextlib
import signal


class StopSignals:
    """First SIGINT/SIGTERM asks for a clean stop at the end of the step (requested holds
    its number); a second one interrupts at once (the handlers are restored on exit)."""

    def __init__(self):
        self.requested, self._old = 0, {}

    def __enter__(self):
        with contextlib.suppress(ValueError):           # not the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = int(signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
