"""The expert banks' in-place gradients under DDP: all-reduced by the trainer, overlapped with
the rest of the last micro-step's backward.

A bank that accumulates its weight gradients in place (nn/experts.py) has no gradient
through autograd, so DDP, whose reducer waits for each parameter's AccumulateGrad, cannot
reduce it: its weights are left out of DDP's buckets (plan.parallelize(ignore=)) and this
class all-reduces their buffers. The moment a layer's bank is final is known from its
router: the router's weights get their gradient from the gates', which the experts'
backward produces after its weight-gradient kernels are queued, so a post-accumulate hook
on the router's first weight launches the bank's all-reduces (asynchronous, on the process
group's stream, after the work already queued on the compute stream) while the backward
goes on to the earlier layers, as DDP's buckets do. The hook acts only in the last
micro-step (``arm``); ``finish`` launches any bank whose hook did not fire (a layer whose
router does not train), waits, and divides by the ranks: the gradients are then those of
one process over the global batch, as DDP's. With no banks (one process, expert
parallelism, FSDP2) it does nothing."""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..nn.moe import MoELayer
from ..parallel.ddp import DistInfo
from .optim import in_place_bank_names


def in_place_plan(model: torch.nn.Module, info: DistInfo, optim, data: str,
                  experts) -> tuple[bool, tuple]:
    """(whether the fused expert banks add their gradients into .grad in the backward, the
    weight names DDP must leave out for BankSync). In place (docs/design.md, "The step's
    parameter-proportional work") wherever FSDP2 does not shard them, with
    optim.expert_grads "in_place", or "auto" with fp32 gradients; under DDP (several ranks,
    no expert plan `experts`) their weights stay out of DDP's buckets and BankSync
    all-reduces their gradients, overlapped with the last micro-step's backward."""
    sharded = info.world > 1 and data == "fsdp" and experts is None
    in_place = not sharded and (optim.expert_grads == "in_place"
                                or optim.expert_grads == "auto" and optim.grads == "fp32")
    sync = in_place and info.world > 1 and experts is None
    return in_place, tuple(in_place_bank_names(model)) if sync else ()


class BankSync:
    def __init__(self, model: torch.nn.Module, banks: list, info: DistInfo):
        self.banks, self.info = banks, info
        self.armed, self.works = False, {}
        for layer in model.modules():
            if isinstance(layer, MoELayer) and any(layer.experts is b for b in banks):
                anchor = next((p for p in layer.router.parameters() if p.requires_grad), None)
                if anchor is not None:
                    anchor.register_post_accumulate_grad_hook(partial(self._ready,
                                                                      layer.experts))

    def arm(self, last: bool) -> None:
        """Whether the coming backward is the last micro-step's (the one that syncs)."""
        self.armed = last

    def _ready(self, bank, _param) -> None:
        if self.armed:
            self._launch(bank)

    def _launch(self, bank) -> None:
        if id(bank) not in self.works:
            self.works[id(bank)] = [dist.all_reduce(w.grad, async_op=True)
                                    for w in bank.weights()]

    def finish(self) -> None:
        """After the last micro-step's backward: every bank's all-reduce launched (those
        whose hook did not fire now), waited for, and divided by the number of ranks."""
        for bank in self.banks:
            self._launch(bank)
        for works in self.works.values():
            for work in works:
                work.wait()
        grads = [w.grad for b in self.banks for w in b.weights()]
        if grads:
            torch._foreach_div_(grads, float(self.info.world))
        self.works, self.armed = {}, False
