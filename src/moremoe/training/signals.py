"""How a run stops: by signal (the first SIGINT/SIGTERM asks for a clean stop at the end of
the step, a second one interrupts) and with which exit status."""
from __future__ import annotations

import contextlib
import signal
import time

# How one process ends, as the summary's "stopped" and its exit status: a finished schedule
# exits 0; a budget stop (checkpointed, --resume continues) 75 (EX_TEMPFAIL); a signal
# 128 + its number after checkpointing; errors (bad input, a non-finite step) 2.
EXIT_CODES = {"max_steps": 0, "stop_step": 75, "max_minutes": 75,
              "SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}

# A signal this soon after the first is the same request delivered twice: a scheduler that
# signals every process of a job (Slurm's scancel) reaches the ranks both directly and
# through torchrun, which forwards what it gets to each rank.
REPEAT_S = 1.0


def exit_status(reason: str, world: int) -> int:
    """The exit status of a run that stopped for `reason` on `world` ranks. Under torchrun
    (world > 1) every rank exits 0 after a stop it checkpointed and summarised, and the
    summary's "stopped" alone says why: torchrun counts a rank that exits non-zero as a
    failed job and kills the ranks still writing."""
    if reason in EXIT_CODES:
        return 0 if world > 1 else EXIT_CODES[reason]
    return 2


class StopSignals:
    """First SIGINT/SIGTERM asks for a clean stop at the end of the step (requested holds
    its number); another one more than REPEAT_S later interrupts at once (the handlers are
    restored on exit)."""

    def __init__(self, clock=time.monotonic):
        self.requested, self._old, self._clock, self._first = 0, {}, clock, None

    def __enter__(self):
        with contextlib.suppress(ValueError):           # not the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        now = self._clock()
        if self.requested:
            if now - self._first > REPEAT_S:
                raise KeyboardInterrupt
            return
        self.requested, self._first = int(signum), now

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
