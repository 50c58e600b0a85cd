"""The memory plan of a run, per GPU (per process on a CPU): the fp32 weights, their gradients
and AdamW's two moments (8 bytes a parameter, 4 with optim.moments=bf16, whose few MB of
small tensors on a GPU keep fp32 moments, not counted) of each part of the
model as it is held there, FSDP2's gathered blocks or DDP's bf16 bucket copies, and an
estimate of the activations; printed at start. The parts: the experts (1/E on each rank of
an expert group with parallel.expert=E, else as the rest) and the rest (whole under DDP, 1/W
under FSDP2 over W ranks). With
parallel.reduce_dtype=bf16 DDP's comm hook casts each bucket to bf16 and the copies of all
buckets are alive at once at the end of the synced backward: 2 bytes a parameter DDP reduces
(measured on 2 H100s: MoRE-1792's peak 39.7 GiB against 36.2 in fp32, 3.56 GiB predicted).

A run whose weights, gradients and optimizer states alone exceed the device's memory never
fits and is refused before the model is built (instead of after minutes of set-up or an
allocation the operating system kills the process for). One that passes can still run out of
memory (activations, the allocator's slack, the CUDA context): the command then names the
settings to change.

The activation estimate counts what autograd keeps per token of a micro-batch, eager: per
block the fp32 residual stream at both RMSNorms (input and output, 16h bytes), attention's
projections' inputs, q, k, v and output (8h in the activation dtype), the MoE layer's input
(h), router (r + 4k) and experts (3ks), with expert parallelism the rows sent and received
(each token's row goes once to each rank holding one of its experts: at most min(k, E) rows
each way, 2 min(k, E) h); the head keeps the logits and the log-probabilities, and its
backward their gradients ((2a + 4)V; with train.fused_loss only each token's log-sum-exp,
4 bytes, and one chunk of at most 2^24 logits at a time, 2^27 on a GPU). Activation
checkpointing keeps each block's input (4h) and one block at a time. torch.compile fuses
some of these away: read the estimate as an upper bound. The validation forward of a
micro-batch holds its logits (aV a token) and the loss's fp32 chunk (eval/perplexity.py):
the plan takes the larger of the two (with the fused loss the evaluation's can be).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..accounting import expert_params
from ..checks import gib
from ..eval.perplexity import CE_CHUNK
from ..model import TransformerConfig
from ..nn.moe import MoEConfig
from ..report import table
from ..runtime import memory_bytes

STATE_BYTES = {"fp32": 16, "bf16": 12}    # weight + gradient + the two moments, per parameter


@dataclass(frozen=True)
class Part:
    name: str
    params: int                # of the whole model
    share: int                 # held as params / share on each rank
    how: str

    def bytes(self, moments: str, grads: str = "fp32") -> tuple[int, int, int]:
        """(weights, gradients, optimizer states) on one rank."""
        n = self.params // self.share
        return 4 * n, (2 if grads == "bf16" else 4) * n, (STATE_BYTES[moments] - 8) * n


@dataclass(frozen=True)
class MemoryPlan:
    parts: tuple[Part, ...]
    moments: str
    buffers: int               # FSDP2's gathered blocks (weights and gradients, two blocks)
                               # or DDP's bf16 bucket copies (buffers_row names which)
    activations: int           # the estimate above
    tokens: int                # per micro-batch and rank
    checkpointing: bool
    have: int
    where: str
    grads: str = "fp32"        # optim.grads: the gradients' dtype
    buffers_row: tuple[str, str] = ("FSDP2 gathered blocks", "2 blocks, fp32")  # table row

    def state_bytes(self) -> int:
        return sum(sum(p.bytes(self.moments, self.grads)) for p in self.parts)

    def total(self) -> int:
        return self.state_bytes() + self.buffers + self.activations

    def to_dict(self) -> dict:
        return {"state_bytes": self.state_bytes(), "buffers": self.buffers,
                "buffers_how": ": ".join(self.buffers_row) if self.buffers else "",
                "activations": self.activations, "total": self.total(), "have": self.have,
                "tokens": self.tokens, "moments": self.moments, "grads": self.grads,
                "parts": [{"name": p.name, "params": p.params, "share": p.share,
                           "how": p.how} for p in self.parts]}

    def table(self) -> str:
        rows = []
        for p in self.parts:
            w, g, o = p.bytes(self.moments, self.grads)
            rows.append([p.name, f"{p.params / 1e6:,.1f}M", p.how, gib(w), gib(g), gib(o),
                         gib(w + g + o)])
        if self.buffers:
            name, how = self.buffers_row
            rows.append([name, "", how, "", "", "", gib(self.buffers)])
        kept = "block inputs + one block" if self.checkpointing else "every block"
        rows.append(["activations (estimate)", "", f"{self.tokens:,} tokens, {kept}", "", "",
                     "", gib(self.activations)])
        rows.append(["total", "", "", "", "", "", f"{gib(self.total())} of {gib(self.have)}"])
        head = ["memory per rank", "params", "held as", "weights", f"grads ({self.grads})",
                f"AdamW ({self.moments})", "total"]
        return f"memory plan ({self.where}):\n" + table(rows, head)


def memory_plan(cfg, model_config: TransformerConfig, device: torch.device, *,
                world: int = 1, have: int | None = None) -> MemoryPlan:
    """The plan of run config `cfg` (a RunConfig) for `model_config` on `world` ranks of
    `device` (have: its memory, by default runtime.memory_bytes)."""
    E, m = cfg.parallel.expert, model_config.moe
    fsdp = cfg.parallel.data == "fsdp" and world > 1
    rest_how = f"1/{world} (FSDP2)" if fsdp else "whole (DDP)" if world > 1 else "whole"
    total = model_config.total_params()
    experts = (model_config.layers * expert_params(m.experts, m.hidden, m.width)
               if isinstance(m, MoEConfig) else 0)
    parts = [Part("the rest", total - experts, world if fsdp else 1, rest_how)]
    if experts:
        how = f"1/{E} (expert shards)" if E > 1 else rest_how
        parts.insert(0, Part("experts", experts, E if E > 1 else parts[0].share, how))
    block = (total - experts) // model_config.layers + (experts // model_config.layers
                                                        if E == 1 else 0)
    a = 2 if device.type == "cuda" and cfg.train.autocast else 4
    tokens = cfg.train.batch_size * cfg.model.seq_len
    where = f"{device}, {world} rank{'s' if world > 1 else ''}" + (
        f", parallel.expert={E} x data {world // E}" if E > 1 else "")
    buffers, row = (16 * block if fsdp else 0), MemoryPlan.buffers_row
    if not fsdp and world > 1 and cfg.parallel.reduce_dtype == "bf16":
        reduced = sum(p.params // p.share for p in parts if p.how == rest_how)
        buffers, row = 2 * reduced, ("DDP bf16 buckets", "every bucket's bf16 copy")
    step = tokens * activation_bytes(model_config, a, E, cfg.train.activation_checkpointing,
                                     fused_loss=cfg.train.fused_loss)
    acts = max(step, evaluation_bytes(model_config, a, tokens))
    return MemoryPlan(tuple(parts), cfg.optim.moments, buffers, acts, tokens,
                      cfg.train.activation_checkpointing,
                      memory_bytes(device) if have is None else have, where, cfg.optim.grads,
                      row)


def activation_bytes(c: TransformerConfig, a: int, expert: int,
                     checkpointing: bool, *, fused_loss: bool = False) -> int:
    """The module docstring's estimate per token; a: bytes of an activation (2 under bf16
    autocast, else 4); expert: E, the ranks sharing each layer's experts; fused_loss: the
    head and the loss in chunks (the chunk itself, a constant, left out)."""
    h, m = c.hidden, c.moe
    k, s = m.top_k, getattr(m, "width", 1)
    r = getattr(m, "rank", None) or 0
    block = 16 * h + 8 * a * h + a * h + 4 * r + 4 * k + 3 * a * k * s
    if expert > 1:
        block += 2 * a * min(k, expert) * h
    head = (4 if fused_loss else (2 * a + 4) * c.vocab) + 8 * h
    kept = c.layers * 4 * h + block if checkpointing else c.layers * block
    return kept + head


def evaluation_bytes(c: TransformerConfig, a: int, tokens: int) -> int:
    """A validation forward of `tokens` tokens: its logits in the activation dtype and the
    cross-entropy's chunk, an fp32 copy and its log-probabilities (eval/perplexity.py)."""
    return tokens * a * c.vocab + 8 * min(CE_CHUNK, tokens * c.vocab)


def check_fits(plan: MemoryPlan, params: int, device: torch.device, world: int, *,
               options: list[str] = ()) -> None:
    """ValueError when the weights, gradients and optimizer states of the plan alone exceed
    the device's memory; options: the settings that would shrink them, named in the error."""
    need = plan.state_bytes()
    if need <= plan.have:
        return
    where = f"each of the {world} ranks" if world > 1 else str(device)
    more = f", or {', '.join(options)}" if options else ""
    raise ValueError(f"the model has {params:,} parameters: their fp32 weights, gradients and "
                     f"AdamW states alone need {need / 2**30:,.1f} GiB on {where}, which has "
                     f"{plan.have / 2**30:,.1f} GiB; make it smaller (model.experts, "
                     f"model.width, model.hidden, model.layers){more}")


def shrink_options(cfg, device: torch.device, world: int) -> list[str]:
    """What would make the weights, gradients and optimizer states smaller per GPU."""
    if device.type != "cuda":
        return []
    out = []
    if cfg.parallel.data != "fsdp" or world == 1:
        out.append("shard it over several GPUs (torchrun, --set parallel.data=fsdp)")
    if cfg.parallel.expert == 1 and cfg.model.kind != "peer":
        out.append("split the experts over them (--set parallel.expert=N)")
    if cfg.optim.moments == "fp32":
        out.append("keep AdamW's moments in bf16 (--set optim.moments=bf16)")
    return out
