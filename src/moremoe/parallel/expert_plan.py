"""Expert parallelism for the whole model (``parallel.expert`` = E): the W ranks of a torchrun
launch form a 2-D DeviceMesh, data (D = W/E) × expert (E), the expert dimension the inner one
so that an expert group is E consecutive ranks (one node's GPUs). Each block's MoE layer
becomes this rank's ExpertParallelMoE (parallel/expert.py) over its expert group, holding
M/E experts; everything else (attention, norms, embeddings, head, routers) is replicated over
all W ranks (DDP) or sharded over them (FSDP2), on a process group of its own.

Tokens: "local" (the paper's (b)). Each rank keeps its own micro-batch, as under DDP, and the
all-to-alls take (token, slot) rows to their experts' ranks and back; "replicated" would make
every rank of a group run attention and the router on the group's whole batch (E times the
work) for one all-reduce instead of two all-to-alls.

One optimizer step equals one process on the global batch: the batch sampler gives micro-step
j of rank r the chunk j·W + r, so an expert group's E micro-batches are E consecutive chunks,
one micro-batch of one process at batch_size × E (and grad_accum × D). Each rank's loss is its
rows' LM loss plus the balancing loss of its group's micro-batch (counts and psum summed over
the group); the objective J is the mean over the W ranks. Then
 - a replicated parameter's gradient on a rank is its share of W·∇J, averaged over the W
   ranks by DDP or FSDP2 (their own communicator, so that their buckets never interleave
   with the layers' all-to-alls on one);
 - an expert shard holds after the backward the whole gradient of its group's summed loss S_g
   (the reverse all-to-all brings every rank's share), so ∂J/∂W = Σ_g ∂S_g/∂W / W: a sum over
   the D ranks that hold the same shard (the data dimension), divided by W
   (``reduce_gradients``; ExpertParallelMoE.sync_gradients' "expert shards / E" with the
   data-parallel mean on top);
 - the norm for clipping counts every element once (``total_norm``): replicated
   gradients on one rank, FSDP2's and the expert shards summed over their owners; the
   trainer's update reads the gradients times the clip coefficient (training/optim.py).

Checkpoints stay whole (the single-process model's names and shapes): ``gather_whole`` puts
each expert tensor, weights and AdamW moments, gathered over the expert group, into rank 0's
state dicts, and ``local_optim_state`` takes a rank's rows of a whole optimizer state, so a run
resumes on any E and any number of ranks (the weights load into the whole model before it is
sharded).

Legend: W ranks, E expert ranks per group, D = W/E data groups, M experts, L layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_stack
from .ddp import LAUNCH, DistInfo
from .expert import shard_moe_layer


def check_layout(expert: int, *, experts: int, kind: str, world: int) -> None:
    """ValueError unless E = `expert` can split the model and the ranks: E divides M and the
    number of ranks, E > 1 needs a torchrun launch, and PEER layers are not split."""
    if expert == 1:
        return
    if kind == "peer":
        raise ValueError(f"parallel.expert={expert}: PEER layers (model.kind=peer) are not "
                         f"split over ranks; use parallel.expert=1 with parallel.data=fsdp")
    if experts % expert:
        raise ValueError(f"parallel.expert={expert} must divide model.experts={experts} (each "
                         f"rank holds M/E experts); choose a divisor of {experts}")
    if world == 1:
        raise ValueError(f"parallel.expert={expert} splits the experts over {expert} ranks but "
                         f"this is one process; {LAUNCH} (N a multiple of {expert}), or set "
                         f"parallel.expert=1")
    if world % expert:
        raise ValueError(f"parallel.expert={expert} must divide the number of ranks, {world} "
                         f"(torchrun --nproc_per_node); launch a multiple of {expert} or choose "
                         f"a divisor of {world}")


class ExpertPlan:
    """The mesh and process groups of one run with E > 1 (a collective: every rank builds
    it), and what the trainer does to the expert shards once ``apply`` has made them."""

    def __init__(self, info: DistInfo, expert: int):
        from torch.distributed.device_mesh import init_device_mesh
        self.info, self.expert, self.data = info, expert, info.world // expert
        self.mesh = init_device_mesh(info.device.type, (self.data, expert),
                                     mesh_dim_names=("data", "expert"))
        self.expert_group = self.mesh.get_group("expert")
        self.data_group = self.mesh.get_group("data")
        # DeviceMesh hands out WORLD for a dimension that spans every rank: the DDP / FSDP2 of
        # the rest gets a communicator that no expert group uses
        self.rest_group = dist.new_group(list(range(info.world)))
        self.names: list[str] = []          # the expert shards, single-process names
        self.rows: dict[str, tuple[int, int]] = {}
        self.params: list[nn.Parameter] = []

    def apply(self, model: nn.Module) -> None:
        """Replace each block's MoE layer by this rank's ExpertParallelMoE (tokens="local")
        holding its experts' rows of it, on the layer's device."""
        for i, block in enumerate(model.blocks):
            layer = block.moe
            with torch.device(next(layer.parameters()).device):
                block.moe = shard_moe_layer(layer, self.expert_group, tokens="local")
            for name in sorted(block.moe.sharded_names()):
                self.names.append(f"blocks.{i}.moe.{name}")
                self.rows[self.names[-1]] = (block.moe.lo, block.moe.hi)
        named = dict(model.named_parameters())
        self.params = [named[n] for n in self.names]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """After the last micro-step: each expert shard's gradient summed over the data
        dimension and divided by W (the module docstring's convention)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.data > 1:
                dist.all_reduce(p.grad, group=self.data_group)
            p.grad.div_(self.info.world)

    @torch.no_grad()
    def total_norm(self, params) -> torch.Tensor:
        """The whole model's gradient 2-norm, the same on every rank, each element counted
        once: replicated gradients on one rank, FSDP2's and the expert shards summed over
        their owners."""
        own = {id(p) for p in self.params}
        replicated, sharded, experts = [], [], []
        for p in params:
            if p.grad is None:
                continue
            if id(p) in own:
                experts.append(p.grad)
            elif hasattr(p.grad, "to_local"):                   # an FSDP2 shard
                sharded.append(p.grad.to_local())
            else:
                replicated.append(p.grad)
        dev = self.info.device
        # the D data groups hold copies of the same expert shards: each counts 1/D
        total = _sum_sq(sharded, dev) + _sum_sq(experts, dev) / self.data
        dist.all_reduce(total)
        return (total + _sum_sq(replicated, dev)).sqrt()

    @torch.no_grad()
    def gather_whole(self, model: nn.Module, opt: torch.optim.Optimizer,
                     weights: dict | None, optim: dict | None) -> None:
        """Put the whole expert tensors (weights and optimizer states) into rank 0's state
        dicts in place of its shards (every rank calls it; the first data group gathers)."""
        if self.mesh.get_local_rank("data") != 0:
            return
        named = dict(model.named_parameters())
        for name in self.names:
            p = named[name]
            self._put(weights, name, p)
            for key, t in opt.state.get(p, {}).items():
                if t.dim():                  # the step counter is the same on every rank
                    self._put(optim["state"][name] if optim else None, key, t)

    def _put(self, into: dict | None, key: str, t: torch.Tensor) -> None:
        whole = all_gather_stack(t.detach(), self.expert_group).flatten(0, 1)
        if self.info.main:
            into[key] = whole.cpu()

    def local_optim_state(self, state: dict, model: nn.Module,
                          opt: torch.optim.Optimizer) -> dict:
        """A whole optimizer state (by parameter name, or torch's own by position as older
        checkpoints hold it) with the expert entries cut to this rank's rows."""
        if all(isinstance(k, int) for k in state["state"]):
            state = _by_name(state, model, opt)
        out = {**state, "state": dict(state["state"])}
        for name, (lo, hi) in self.rows.items():
            if name in out["state"]:
                out["state"][name] = {k: v[lo:hi] if v.dim() else v
                                      for k, v in out["state"][name].items()}
        return out


def _sum_sq(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Σ ||g||² in fp32 (one fused norm per tensor, no squared copy of a gradient)."""
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(grads)).float().square().sum()


def _by_name(state: dict, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """torch's positional optimizer state keyed by parameter name instead: position i is the
    i-th parameter of the optimizer's groups, the order the saving run built them in."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    ids = [i for g in state["param_groups"] for i in g["params"]]
    to_name = dict(zip(ids, order))
    return {"state": {to_name[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [to_name[i] for i in g["params"]]}
                             for g in state["param_groups"]]}
