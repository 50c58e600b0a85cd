"""The least memory a run needs, checked before the model is built: fp32 weights, their
gradients and AdamW's two moments, 16 bytes a parameter on each rank (a rank's share under
FSDP2). Activations, the allocator's slack and the CUDA context come on top, so a run that
passes can still run out of memory (the command then names the settings to lower); one that
fails this check never fits, and is refused at once instead of after minutes of set-up or
an allocation the operating system kills the process for.
"""
from __future__ import annotations

import torch

from ..runtime import memory_bytes

BYTES_PER_PARAM = 16        # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def check_model_fits(params: int, dev: torch.device, *, world: int = 1, sharded: bool = False,
                     have: int | None = None) -> None:
    """ValueError when the weights, gradients and optimizer states of `params` parameters
    alone exceed the memory of dev (have: that memory, by default runtime.memory_bytes)."""
    have = memory_bytes(dev) if have is None else have
    share = world if sharded else 1
    need = BYTES_PER_PARAM * params // share
    if need <= have:
        return
    where = f"each of the {world} ranks" if share > 1 else str(dev)
    more = "" if sharded or dev.type != "cuda" else \
        ", or shard it over several GPUs (torchrun, --set parallel.data=fsdp)"
    raise ValueError(f"the model has {params:,} parameters: their fp32 weights, gradients and "
                     f"AdamW states alone need {need / 2**30:,.1f} GiB on {where}, which has "
                     f"{have / 2**30:,.1f} GiB; make it smaller (model.experts, model.width, "
                     f"model.hidden, model.layers){more}")
