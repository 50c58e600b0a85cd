"""The least memory a run needs, checked before the model is built: fp32 weights, their
gradients and AdamW's two moments, 16 bytes a parameter on each rank (a rank's share under
FSDP2). Activations, the allocator's slack and the CUDA context come on top, so a run that
passes can still run out of memory (the command then names the settings to lower); one that
fails this check never fits, and is refused at once instead of after minutes of set-up or
an allocation the operating system kills the process for.
"""
from __future__ import annotations

import os

import torch

BYTES_PER_PARAM = 16        # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def device_memory(dev: torch.device) -> int | None:
    """Bytes of memory of a device: the GPU's total, or the machine's physical memory for
    the CPU; None when unknown."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):     # not POSIX
        return None


def check_fits(params: int, dev: torch.device, *, world: int = 1, sharded: bool = False,
               have: int | None = None) -> None:
    """ValueError when the weights, gradients and optimizer states of `params` parameters
    alone exceed the memory of dev (have: that memory, by default device_memory(dev))."""
    have = device_memory(dev) if have is None else have
    share = world if sharded else 1
    need = BYTES_PER_PARAM * params // share
    if have is None or need <= have:
        return
    where = f"each of the {world} ranks" if share > 1 else str(dev)
    more = "" if sharded or dev.type != "cuda" else \
        ", or shard it over several GPUs (torchrun, --set parallel.data=fsdp)"
    raise ValueError(f"the model has {params:,} parameters: their fp32 weights, gradients and "
                     f"AdamW states alone need {need / 2**30:,.1f} GiB on {where}, which has "
                     f"{have / 2**30:,.1f} GiB; make it smaller (model.experts, model.width, "
                     f"model.hidden, model.layers){more}")
