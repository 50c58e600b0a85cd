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


def compile_mode(mode: str, device: torch.device, world: int, *, data: str = "ddp") -> str:
    """train.compile_mode as torch.compile takes it. "auto" is CUDA graphs (reduce-overhead)
    for one process on a GPU, where the paper pair's step measured GPU-bound with them
    (benchmarks/NOTES.md); "default" on a CPU and with several ranks. Under DDP the graphs
    are built (train.compile_mode=reduce-overhead) but not yet the default: their GPU test
    (tests/training/test_ddp_gpu.py) passed on 2 H100s for compile_scope=blocks, not yet
    for the presets' model scope. FSDP2 and expert parallelism share the
    model's state, whose collectives run inside the blocks' forward and backward on buffers
    that move between calls, which a graph's replay cannot follow: a CUDA-graph mode named
    under FSDP2 on several ranks is a ValueError."""
    if mode in CUDA_GRAPH_MODES and world > 1 and data == "fsdp":
        raise ValueError(f"train.compile_mode={mode} (CUDA graphs) does not work with "
                         f"parallel.data=fsdp (FSDP2 gathers each block's weights into new "
                         f"memory every call); use train.compile_mode=auto or default, or "
                         f"parallel.data=ddp")
    if mode != "auto":
        return mode
    return "reduce-overhead" if device.type == "cuda" and world == 1 else "default"


# torch.compile under DDP (dynamo's DDPOptimizer) starts its graph pieces at DDP's first
# bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB) and refuses smaller buckets
COMPILED_DDP_MIN_BUCKET_MB = 1.0


def check_bucket(bucket_mb: float, *, compiled: bool, world: int, data: str = "ddp") -> None:
    """A DDP bucket under torch.compile's first one is a ValueError naming the bound (dynamo
    would stop with an assertion at the first forward)."""
    if compiled and world > 1 and data == "ddp" and bucket_mb < COMPILED_DDP_MIN_BUCKET_MB:
        raise ValueError(f"parallel.bucket_mb={bucket_mb:g} is under torch.compile's first "
                         f"DDP bucket ({COMPILED_DDP_MIN_BUCKET_MB:g} MB, where its graphs "
                         f"split); use parallel.bucket_mb >= {COMPILED_DDP_MIN_BUCKET_MB:g} "
                         f"or train.compile=false")


def parallelize(model: torch.nn.Module, info: DistInfo, *, data: str = "ddp",
                compile_scope: str | None = None, mode: str = "default",
                experts: ExpertPlan | None = None, checkpointing: bool = False,
                bucket_mb: float = 25.0, reduce_dtype: str = "fp32",
                ignore: tuple = ()) -> torch.nn.Module:
    """model (its parameters sharded in place under data="fsdp" with several ranks, its MoE
    layers replaced by expert shards with `experts`) -> the module to call for training:
    DDP-wrapped, and compiled as a whole with compile_scope="model" ("blocks": each block
    compiled in place; None: eager). With expert parallelism the MoE layers run eagerly
    (either scope compiles each block's norms and attention), and DDP / FSDP2 leave the
    expert shards to the plan; checkpointing: activation checkpointing of every block;
    bucket_mb and reduce_dtype: DDP's gradient buckets and the dtype they are all-reduced in;
    ignore: parameter names DDP leaves out (the expert banks that accumulate their gradients
    in place: the trainer all-reduces those itself, training/bank_sync.py).

    Under DDP torch.compile splits each compiled graph where DDP's buckets end (dynamo's
    DDPOptimizer, on by default): the compiled backward then runs as one piece per bucket
    and the reducer's all-reduce of a bucket, eager and outside any CUDA graph, overlaps the
    next piece, as in eager DDP. Each piece is a graph of its own under reduce-overhead;
    the gradients they add into are DDP's buckets (gradient_as_bucket_view), allocated
    once and zeroed in place, so no replay writes over them (docs/design.md): under a graph
    mode on a GPU the trainer keeps them allocated, and DDP holds them as views of its
    buckets from the start."""
    if checkpointing:      # full recompute under expert parallelism: every collective again
        model.checkpoint_blocks(full=experts is not None)
    ignore, group = list(ignore), None
    graphs = compile_scope is not None and mode in CUDA_GRAPH_MODES and info.device.type == "cuda"
    if experts is not None:
        experts.apply(model)
        ignore, group = [*ignore, *experts.names], experts.rest_group
        if compile_scope is not None:
            model.compile_blocks(mode, moe=False)
            compile_scope = None
    if compile_scope == "blocks":
        model.compile_blocks(mode)
    if data == "fsdp" and info.enabled:
        fsdp.wrap(model, info, ignore=experts.params if experts else (), group=group)
        train_module = model
    else:
        train_module = ddp.wrap(model, info, ignore=ignore, group=group, bucket_mb=bucket_mb,
                                reduce_dtype=reduce_dtype, keep_grads=graphs)
    if compile_scope == "model":
        train_module = torch.compile(train_module, mode=mode)
    return train_module
