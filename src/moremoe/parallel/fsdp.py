"""FSDP2 over the data ranks, and the whole-model state that checkpoints hold.

``wrap`` applies ``torch.distributed.fsdp.fully_shard`` to each transformer block and then to
the model (embedding, final norm and head with the root): every parameter, gradient and
AdamW state is sharded over the ranks (dim 0), gathered for a block's forward and backward
and freed after. A paper model's fp32 weights, gradients and AdamW states (16 bytes a
parameter: 127 GB for MoRE-8192) so take 1/R of that per GPU plus one block gathered.

Checkpoints stay whole whatever the layout: ``model_state`` and ``optim_state`` gather the
full state dicts (parameter names as keys, CPU tensors, through
torch.distributed.checkpoint.state_dict), so a run saved on R ranks, with DDP or FSDP2,
resumes on any number of ranks and loads with ``load_model`` like any other.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from . import ddp
from .ddp import DistInfo

DATA_MODES = ("ddp", "fsdp")


def wrap(model: torch.nn.Module, info: DistInfo, *, ignore: list[torch.nn.Parameter] = (),
         group=None) -> torch.nn.Module:
    """Shard model in place over all ranks (one mesh dimension: `group`'s, None for WORLD),
    but for the parameters in `ignore` (expert shards: FSDP2 leaves them as they are);
    returns it."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = (init_device_mesh(info.device.type, (info.world,)) if group is None
            else DeviceMesh.from_group(group, info.device.type))
    ignored = set(ignore)
    kw = {"ignored_params": ignored} if ignored else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor as it is)."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (a plain tensor as it is): e.g. the gradient
    norm clip_grad_norm_ returns over sharded gradients."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def all_finite(model: torch.nn.Module, info: DistInfo, *, sharded: bool = False) -> bool:
    """Whether every parameter is finite, on every rank (each checks its shards; sharded:
    the model holds shards of its own that FSDP2 does not manage, expert shards)."""
    flags = torch.stack([torch.isfinite(local(p)).all() for p in model.parameters()])
    bad = (~flags).any().float().reshape(1)
    if sharded or is_sharded(model):
        ddp.all_reduce(bad, info, "max")
    return bad.item() == 0


def model_state(model: torch.nn.Module) -> dict:
    """The whole state dict on the CPU (every rank calls it; with FSDP2 only rank 0 gets the
    tensors, the others an empty dict)."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def optim_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state keyed by parameter name (every rank calls it)."""
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def load_optim_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a state saved by optim_state (by name; or torch's own, by position, as older
    checkpoints hold it) into opt, sharding it where the model is sharded."""
    if all(isinstance(k, int) for k in state["state"]):
        opt.load_state_dict(state)
        return
    sharded = is_sharded(model)
    set_optimizer_state_dict(model, opt, state,
                             options=StateDictOptions(full_state_dict=sharded))


def no_sync(model: torch.nn.Module, info: DistInfo, last: bool):
    """Context for an accumulation micro-step: gradients reduced over ranks only on the last."""
    if not info.enabled or last:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):          # FSDP2
        return _fsdp_no_sync(model)
    return model.no_sync()                                     # DDP


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
