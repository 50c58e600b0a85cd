"""The runtime floor every part of moremoe stands on: the version, the device to run on, the
autocast dtype, progress bars and the tags a result carries (device, versions, commit,
date). It imports nothing of moremoe."""
from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
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


def autocast_dtype(device: torch.device):
    """bf16 autocast on GPU; full precision on CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


class _NoBar:
    def update(self, n=1): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


def progress_bar(total: int, *, desc: str, enabled: bool = True):
    """A tqdm bar on stderr when it is a terminal (none in logs and CI), or a silent stand-in."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def commit_id() -> str:
    """The source's git commit ($MOREMOE_COMMIT when set, e.g. on a machine without git)."""
    if os.environ.get("MOREMOE_COMMIT"):
        return os.environ["MOREMOE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
