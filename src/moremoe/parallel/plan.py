"""Applying parallelism and compilation to the single-device model, from outside and in
one order (torchtitan's parallelize): compile (each block, or later the whole model), shard
(FSDP2) or replicate (DDP) over the ranks; returns the module the trainer calls.
"""
from __future__ import annotations

import torch

from . import ddp, fsdp
from .ddp import DistInfo

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_mode(mode: str, device: torch.device, world: int) -> str:
    """train.compile_mode as torch.compile takes it: "auto" is CUDA graphs (reduce-overhead)
    for one process on a GPU, where the paper pair's step measured GPU-bound with them
    (benchmarks/NOTES.md), and "default" with several ranks (not measured with graphs) or on
    a CPU."""
    if mode != "auto":
        return mode
    return "reduce-overhead" if device.type == "cuda" and world == 1 else "default"


def parallelize(model: torch.nn.Module, info: DistInfo, *, data: str = "ddp",
                compile_scope: str | None = None, mode: str = "default") -> torch.nn.Module:
    """model (its parameters sharded in place under data="fsdp" with several ranks) -> the
    module to call for training: DDP-wrapped, and compiled as a whole with
    compile_scope="model" ("blocks": each block compiled in place; None: eager)."""
    if compile_scope == "blocks":
        model.compile_blocks(mode)
    if data == "fsdp" and info.enabled:
        fsdp.wrap(model, info)
        train_module = model
    else:
        train_module = ddp.wrap(model, info)
    if compile_scope == "model":
        train_module = torch.compile(train_module, mode=mode)
    return train_module
