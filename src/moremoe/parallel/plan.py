"""Applying parallelism and compilation to the single-device model, from outside and in
one order (torchtitan's parallelize): activation checkpointing, expert shards
(parallel/expert_plan.py), compile (each block, or later the whole model), shard (FSDP2) or
replicate (DDP) over the ranks; returns the module the trainer calls.
"""
from __future__ import annotations

import torch

from . import ddp, fsdp
from .ddp import DistInfo
from .expert_plan import ExpertPlan

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
                compile_scope: str | None = None, mode: str = "default",
                experts: ExpertPlan | None = None,
                checkpointing: bool = False) -> torch.nn.Module:
    """model (its parameters sharded in place under data="fsdp" with several ranks, its MoE
    layers replaced by expert shards with `experts`) -> the module to call for training:
    DDP-wrapped, and compiled as a whole with compile_scope="model" ("blocks": each block
    compiled in place; None: eager). With expert parallelism the MoE layers run eagerly
    (either scope compiles each block's norms and attention), and DDP / FSDP2 leave the
    expert shards to the plan; checkpointing: activation checkpointing of every block."""
    if checkpointing:      # full recompute under expert parallelism: every collective again
        model.checkpoint_blocks(full=experts is not None)
    ignore, group = [], None
    if experts is not None:
        experts.apply(model)
        ignore, group = experts.names, experts.rest_group
        if compile_scope is not None:
            model.compile_blocks(mode, moe=False)
            compile_scope = None
    if compile_scope == "blocks":
        model.compile_blocks(mode)
    if data == "fsdp" and info.enabled:
        fsdp.wrap(model, info, ignore=experts.params if experts else (), group=group)
        train_module = model
    else:
        train_module = ddp.wrap(model, info, ignore=ignore, group=group)
    if compile_scope == "model":
        train_module = torch.compile(train_module, mode=mode)
    return train_module
