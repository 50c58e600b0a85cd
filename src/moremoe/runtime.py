"""The runtime floor every part of moremoe stands on: the version, the device to run on, the
autocast dtype, progress bars and the tags a result carries (device, versions, commit,
date). It imports nothing of moremoe."""
from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

__version__ = "0.1.0"
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" picks the GPU when one is present, else the CPU; ValueError names a device
    this machine does not have."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got "
                         f"{device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but this machine has no CUDA GPU "
                         f"(torch {torch.__version__}); use cpu or auto")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} "
                         f"CUDA GPU(s)")
    return dev


def in_graph() -> bool:
    """True while torch.compile traces or a CUDA graph is being captured: code on this path
    must take no host sync (.item(), .tolist(), a copy to the host), no shape that depends
    on tensor values and no Python branch on them."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def autocast_dtype(device: torch.device):
    """bf16 autocast on GPU; full precision on CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


class _NoBar:
    def update(self, n=1): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


# Progress lines in logs (stderr not a terminal), as HF Trainer and Lightning print them: a
# line when a bar first moves, then at most one per PROGRESS_FRACTION of the work and never
# sooner than PROGRESS_SECONDS after the last (whichever comes later), and one when it closes.
PROGRESS_SECONDS = 10.0
PROGRESS_FRACTION = 0.05
PROGRESS_SECONDS_NO_TOTAL = 30.0      # work of unknown size: by time alone


def duration(seconds: float) -> str:
    """0.4s, 12s, 1m12s, 2h03m."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_text(done: int, total: int | None, seconds: float) -> str:
    """'1m12s elapsed, ~2m03s left' at `done` of `total` units after `seconds`."""
    text = f"{duration(seconds)} elapsed"
    if total and 0 < done < total:
        text += f", ~{duration(seconds * (total - done) / done)} left"
    return text


class ProgressLines:
    """A progress bar for logs: plain lines on stderr (looked up at each write), e.g.
    `MoRE-96: 37% (370/1,000) 1m12s elapsed, ~2m03s left [loss=0.412]`. `initial` units
    (work found done, e.g. on a resume) are shown but left out of the rate."""

    def __init__(self, total: int | None, *, desc: str, initial: int = 0,
                 clock=time.monotonic):
        self.total, self.desc, self.clock = total or None, desc, clock
        self.n = self.start_n = self.last_n = initial
        self.t0 = self.last_t = clock()
        self.postfix, self.printed, self.closed = "", False, False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n > self.start_n and (not self.printed or self._due(now)):
            self._write(now, done=False)

    def _due(self, now: float) -> bool:
        wait = now - self.last_t
        if self.total is None:
            return wait >= PROGRESS_SECONDS_NO_TOTAL
        return (wait >= PROGRESS_SECONDS
                and self.n - self.last_n >= PROGRESS_FRACTION * self.total)

    def set_postfix(self, **kw) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def close(self) -> None:
        """The last line (the work that ended, with its time), unless nothing moved."""
        if not self.closed and self.n > self.start_n and (self.n != self.last_n
                                                         or not self.printed):
            self._write(self.clock(), done=True)
        self.closed = True

    def _write(self, now: float, *, done: bool) -> None:
        units = self.n - self.start_n
        done = done or (self.total is not None and self.n >= self.total)
        if self.total is None:
            line = f"{self.desc}: {self.n:,} so far, {duration(now - self.t0)} elapsed"
        else:
            left = None if done else self.total - self.start_n
            line = (f"{self.desc}: {100 * self.n // self.total}% ({self.n:,}/{self.total:,}) "
                    + eta_text(units, left, now - self.t0))
        line += ", done" if done else ""
        print(line + (f" [{self.postfix}]" if self.postfix else ""), file=sys.stderr,
              flush=True)
        self.printed, self.last_n, self.last_t = True, self.n, now


def progress_bar(total: int | None, *, desc: str, enabled: bool = True, initial: int = 0):
    """Progress on stderr: a tqdm bar on a terminal, plain lines in a log or CI
    (ProgressLines), nothing when not enabled (--no-progress). Never on stdout, which
    carries the report (strict JSON under --json)."""
    if not enabled:
        return _NoBar()
    if not sys.stderr.isatty():
        return ProgressLines(total, desc=desc, initial=initial)
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, initial=initial, file=sys.stderr, dynamic_ncols=True,
                leave=False)


def progress_note(text: str, *, enabled: bool = True) -> None:
    """One line of progress that is not a bar (what a long job is about to do), on stderr."""
    if enabled:
        print(text, file=sys.stderr, flush=True)


def commit_id() -> str:
    """The source's git commit ($MOREMOE_COMMIT when set, e.g. on a machine without git),
    with "+modified" when the tracked source differs from it (a copied working tree whose
    git metadata is older than its files: the commit alone would name other code)."""
    if os.environ.get("MOREMOE_COMMIT"):
        return os.environ["MOREMOE_COMMIT"]
    here = Path(__file__).resolve().parent

    def git(*args) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=here).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    try:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", str(here))
    except (OSError, subprocess.CalledProcessError):
        changed = ""
    return commit + ("+modified" if changed else "")


def environment(device: torch.device) -> dict:
    """The tags of a result: device name, torch and triton versions, commit, UTC date."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_version, "commit": commit_id(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def memory_bytes(device: torch.device) -> int:
    """The most memory work on device can have: the GPU's, or the machine's RAM (less when a
    cgroup limits this process, as in a container)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total
