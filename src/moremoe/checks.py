"""Argument checks shared by modules, ops and kernel launchers.

Every error names the argument, the value it got and what was expected.
"""
from __future__ import annotations

import math

import torch

from .runtime import in_graph, memory_bytes


class UserError(Exception):
    """A failure the user can act on that is not a bad argument value (a diverged run, data
    that does not fit the model): the command line prints it as one line."""


class RankError(UserError):
    """A UserError of one rank alone (the others meet another error, or none): printed by
    whichever rank meets it, where a UserError under torchrun is printed by rank 0 only."""


def check_int(name: str, value, *, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        expected = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def check_number(name: str, value, *, low: float = 0.0, low_open: bool = True) -> float:
    """A real, finite number above low (or at least low with low_open=False): TypeError or
    ValueError naming the argument, its value and what was expected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and (value > low if low_open else value >= low)):
        raise ValueError(f"{name} must be a finite number {'>' if low_open else '>='} {low:g}, "
                         f"got {value}")
    return float(value)


def check_fits(need: int, what: str, change: str, device: torch.device | None = None) -> None:
    """UserError, before any allocation, when need bytes exceed what the device (the CPU's
    RAM by default) has at all: what needs it and what to change, in one line."""
    device = torch.device("cpu") if device is None else device
    have = memory_bytes(device)
    if need > have:
        where = "this machine" if device.type == "cpu" else f"the GPU ({device})"
        raise UserError(f"{what} needs at least {gib(need)} of memory and {where} has "
                        f"{gib(have)}; {change}")


def gib(n: float) -> str:
    """Bytes in GiB, readable at any size (0.25 GiB, 256 GiB, 3.6e+09 GiB)."""
    v = n / 2 ** 30
    return f"{v:,.2f} GiB" if v < 10 else f"{v:,.0f} GiB" if v < 1e7 else f"{v:.2g} GiB"


def check_top_k(k, experts: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"top_k must be an int, got {type(k).__name__} {k!r}")
    if not 1 <= k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {k}")
    return k


def check_tensor(name: str, t, *, ndim: int | None = None, floating: bool = False,
                 integer: bool = False, last: int | None = None, last_name: str = "",
                 shape: tuple | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if last is not None and (t.dim() == 0 or t.shape[-1] != last):
        got = t.shape[-1] if t.dim() else "a scalar"
        raise ValueError(f"{name} has last dimension {got}, expected {last_name or last} = {last}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


INDEX_DTYPES = (torch.int32, torch.int64)


def check_expert_ids(topk_idx: torch.Tensor, experts: int, *, values: bool = True) -> None:
    """topk_idx must be int32 or int64 and (values=True) hold expert ids in [0, experts).
    Checking the values reads two numbers back from the device (a host sync): callers
    whose ids come from a router, in range by construction, pass values=False. Inside
    torch.compile or a CUDA-graph capture the values are not checked (a graph cannot branch
    on them)."""
    if topk_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"topk_idx must be an int32 or int64 tensor of expert ids, got "
                        f"{topk_idx.dtype}")
    if values and topk_idx.numel() and not in_graph():
        lo, hi = (int(v) for v in torch.aminmax(topk_idx))
        if lo < 0 or hi >= experts:
            raise ValueError(f"topk_idx holds expert ids from {lo} to {hi}; they must be in "
                             f"[0, {experts}) for M={experts} experts")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name} is on {dev} but {first_name} is on {first}; "
                             f"move them to one device")
    return first
