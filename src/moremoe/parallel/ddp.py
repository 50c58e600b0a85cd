"""Data parallelism over torchrun: process group from the environment, wrapping, metric
reductions.

``torchrun --nproc_per_node R`` sets RANK, LOCAL_RANK and WORLD_SIZE; without them the run is
a single process and every function here is a no-op. NCCL on CUDA (one GPU per local rank),
gloo on CPU. NCCL's own environment (NCCL_NVLS_ENABLE and the rest) is left as the user set it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import resolve_device


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init(device: str = "auto") -> DistInfo:
    """Join the torchrun process group when launched by torchrun, else a single process."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistInfo(0, 1, 0, resolve_device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, world, local, dev)


def wrap(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """DistributedDataParallel over the process group (the model itself when single)."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [info.device.index] if info.device.type == "cuda" else None
    # no buffer the forward depends on changes (rotary tables are fixed), so none is sent
    return DDP(model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    model = getattr(model, "module", model)          # DDP
    return getattr(model, "_orig_mod", model)        # torch.compile


def all_reduce(t: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """In-place sum/max/mean over ranks (a no-op on one process)."""
    if info.enabled:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.SUM}
        dist.all_reduce(t, op=ops[op])
        if op == "mean":
            t /= info.world
    return t


def gather_objects(obj, info: DistInfo) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def destroy(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
