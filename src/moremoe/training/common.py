"""Pieces every training loop shares: device choice, autocast, the optimiser, progress bars."""
from __future__ import annotations

import sys

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" picks the GPU when one is present, else the CPU."""
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


def make_optimizer(model: torch.nn.Module, *, lr: float, betas=(0.9, 0.95),
                   weight_decay: float = 0.01, eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and stacked expert weights, none on norm scales."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)


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
