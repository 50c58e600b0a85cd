"""Data parallelism over torchrun: process group from the environment, wrapping, metric
reductions.

``torchrun --nproc_per_node R`` sets RANK, LOCAL_RANK and WORLD_SIZE; without them the run is
a single process and every function here is a no-op. NCCL on CUDA (one GPU per local rank),
gloo on CPU. NCCL's own environment (NCCL_NVLS_ENABLE and the rest) is left as the user set it.
"""
from __future__ import annotations

import inspect

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
    """Join the torchrun process group when launched by torchrun, else a single process.
    Launch variables that are not torchrun's (set by hand, or left over in a shell) are a
    ValueError that names them."""
    if "RANK" not in os.environ or _env_int("WORLD_SIZE", 1) == 1:
        return DistInfo(0, 1, 0, resolve_device(device))
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"environment variable RANK={rank} must be in [0, WORLD_SIZE={world})"
                         f"; {LAUNCH}")
    dev = resolve_device(device)
    if dev.type == "cuda":
        if not 0 <= local < torch.cuda.device_count():
            raise ValueError(f"environment variable LOCAL_RANK={local}: this machine has "
                             f"{torch.cuda.device_count()} CUDA GPU(s); {LAUNCH}")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                    device_id=dev if dev.type == "cuda" else None)
        except ValueError as err:     # e.g. MASTER_ADDR missing: not a torchrun launch
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are set but the process "
                             f"group cannot start ({err}); {LAUNCH}") from None
    return DistInfo(rank, world, local, dev)


LAUNCH = ("launch several processes with torchrun --nproc_per_node N, or unset RANK and "
          "WORLD_SIZE for one process")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be an integer; "
                         f"{LAUNCH}") from None


REDUCE_DTYPES = ("fp32", "bf16")


def wrap(model: torch.nn.Module, info: DistInfo, *, ignore: list[str] = (),
         group=None, bucket_mb: float = 25.0, reduce_dtype: str = "fp32",
         keep_grads: bool = False) -> torch.nn.Module:
    """DistributedDataParallel over `group` (None: WORLD; the model itself when single),
    leaving out the parameters named in `ignore` (expert shards, which differ by rank), with
    buckets of bucket_mb MB (torch's default 25) all-reduced in reduce_dtype: "fp32", or
    "bf16" (bf16_all_reduce: half the bytes on the wire for bf16's 8-bit mantissa in the
    average). The all-reduces start as buckets fill during the backward of the last
    micro-step (the others run under no_sync). keep_grads (CUDA graphs, whose gradients
    stay allocated): every gradient is a view of its bucket from the start, not a tensor of
    its own until the first all-reduce copies it in (a second copy of the gradients)."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [info.device.index] if info.device.type == "cuda" else None
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    if keep_grads:           # DDP's constructor copies them into its buckets, keeps views
        skip = set(ignore)
        for name, p in model.named_parameters():
            if p.requires_grad and p.grad is None and name not in skip:
                p.grad = torch.zeros_like(p)
    # no buffer the forward depends on changes (rotary tables are fixed), so none is sent
    # at each forward (torch >= 2.13 names it forward_sync_buffers; its init sync only sends
    # rank 0's rotary tables, equal everywhere); the gradients end as views of the buckets
    # (nothing copied back after the all-reduce)
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in
               inspect.signature(DDP.__init__).parameters else "broadcast_buffers")
    wrapped = DDP(model, device_ids=ids, gradient_as_bucket_view=True, process_group=group,
                  bucket_cap_mb=bucket_mb, **{no_sync: False})
    if reduce_dtype == "bf16":
        wrapped.register_comm_hook(group, bf16_all_reduce)
    return wrapped


def bf16_all_reduce(group, bucket):     # no annotations: DDP checks them, this file's are strings
    """DDP comm hook (a dist.GradBucket -> a Future of its tensor): the bucket's mean over
    the ranks, summed in bf16. Two passes over the fp32 bucket (the cast, and the write back
    that divides by the ranks) where torch's bf16_compress_hook makes three (it divides the
    bf16 copy first, against fp16's overflow, which bf16's fp32 range does not need); and it
    runs on gloo too, which that hook refuses (it checks for NCCL), so the CPU tests reduce
    as the GPUs do."""
    group = group if group is not None else dist.group.WORLD
    buffer_G = bucket.buffer()
    ranks = group.size()
    summed = dist.all_reduce(buffer_G.to(torch.bfloat16), group=group, async_op=True)

    def write_back(fut):
        torch.div(fut.value()[0], ranks, out=buffer_G)
        return buffer_G

    return summed.get_future().then(write_back)


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
