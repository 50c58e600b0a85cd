"""``moremoe bench ep``: the paper's expert-parallel table (Appendix F.3), run with one
process per GPU (``torchrun --nproc_per_node E -m moremoe.cli bench ep``): one layer at
h = 512, s = 64, k = 4, r = 64, bf16, N = 262,144 tokens (the global batch), M in {2,048,
8,192, 16,384}, with per-phase columns as the paper's: router, experts with their local
dispatch, communication, total.

Variants: moe_torch (MoE with the plain-torch router, logits materialised and torch.topk:
the paper's baseline), moe_fused (our fused standard router), more (MoRE, the fused
low-rank router), more_sharded (MoRE with its router sharded over the ranks; flow a only),
more_one_chunk (MoRE with its communication in one piece, not overlapped with the experts:
what the overlap gains; forward, flows a and b).
Flows (parallel/expert.py): a (tokens replicated), b (tokens local, N/E a rank), one_gpu
(the whole single-process layer on one GPU, in the same run: every rank alone, rank 0's
row kept). Passes: forward (bf16 weights, eval mode, no autograd: the point of the issue's
one-GPU 4.79 ms and its targets) and forward+backward (training mode, the Switch balancing
loss included as in the paper's runs, fp32 master weights under bf16 autocast, y and the
aux loss backpropagated).

Every row carries the link's rates measured at the start of the run (bench/link.py: a peer
copy, NCCL send/recv and all-to-all of 128 MiB a rank and peer, GB/s a direction), the
ceiling (b)'s exchange is judged against.
Phases, each timed alone with the same calls on every rank (harness.time_fixed_ms: device
events, median after warm-up), so that the ranks' collectives pair up:
  router   the router on the rank's tokens (all N in a, N/E in b), psum included in
           training; the sharded router with its all-gather and merge (``merge``: those
           alone)
  experts  the rank's experts: a, the restricted kernels on the routed batch; b, the
           kernels on the experts' input (the rows kept, then those received)
  comm     the exchange on the layer's tensors: a, the all-reduce of y (backward: of dx and
           the gates' gradient); b, dispatch + combine: the row plan (the count exchange,
           the one host sync), the rows gathered (the kept ones straight into the experts'
           input) and sent, ids and gates with them, the results back and each token's
           rows summed (backward: the gradients' way)
  total    the layer as a trainer calls it; its communication overlaps the experts
           (chunks), so total may be below router + experts + comm
A point that does not fit on some rank is an "oom" row on every rank (agreed after each
part: the parts without collectives run alone first, so a rank out of memory leaves no
other waiting in a collective).
Legend: N tokens, h hidden, s expert width, M experts, k active, r rank, E ranks.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from ..checks import RankError
from ..nn.moe import MoEConfig, MoELayer
from ..parallel.collectives import all_reduce_many, auto_chunks
from ..parallel.exchange import RowExchange, plan_rows
from ..parallel.expert import ExpertParallelMoE
from ..runtime import environment
from .harness import bf16_on, ceilings, free, time_fixed_ms
from .link import link_rates

VARIANTS = ("moe_torch", "moe_fused", "more", "more_sharded", "more_one_chunk")
FLOWS = ("a", "b", "one_gpu")
PHASES = ("forward", "forward+backward")


@dataclass(frozen=True)
class EPSetup:
    h: int = 512
    s: int = 64
    k: int = 4
    r: int = 64
    N: int = 262144
    experts: tuple = (2048, 8192, 16384)
    chunks: int | None = None   # of the overlap (None: the layer's choice)
    warmup: int = 3
    reps: int = 10
    link_bytes: int = 128 << 20  # a rank's rows to another in (b) at M = 8,192, E = 2


QUICK = EPSetup(h=16, s=16, k=2, r=4, N=8, experts=(4,), chunks=2, warmup=0, reps=1,
                link_bytes=1 << 12)


def config(setup: EPSetup, variant: str, M: int) -> MoEConfig:
    router = "reference" if variant == "moe_torch" else "triton"
    if variant.startswith("more"):
        return MoEConfig.more(M, setup.k, setup.h, setup.s, setup.r, router_impl=router,
                              experts_impl="triton")
    return MoEConfig.moe(M, setup.k, setup.h, setup.s, router_impl=router,
                         experts_impl="triton")


def _build(cfg, flow: str, variant: str, phase: str, device, chunks: int):
    """The forward's layer in eval mode with bf16 weights; forward + backward's in training
    mode with fp32 (master) weights (no collective: measure broadcasts rank 0's replicated
    parameters after the ranks agree that it fits)."""
    train = phase != "forward"
    with torch.device(device) if train else bf16_on(device):
        if flow == "one_gpu":
            return MoELayer(cfg).train(train)
        return ExpertParallelMoE(cfg, tokens="replicated" if flow == "a" else "local",
                                 shard_router=variant == "more_sharded",
                                 chunks=chunks).train(train)


def _leaf(t, grad: bool):
    return t.detach().clone().requires_grad_(grad)


def _backward(outs, grads):
    torch.autograd.backward([o for o in outs if o is not None and o.requires_grad],
                            [g for o, g in zip(outs, grads) if o is not None and o.requires_grad])


class Phases:
    """The timed calls of one layer (a flow and a variant) on its inputs: router, experts,
    comm, total, and the sharded router's merge; each builds what it needs once."""

    def __init__(self, layer, flow: str, x, phase: str, device):
        self.layer, self.flow, self.x, self.device = layer, flow, x, device
        self.train = phase != "forward"
        self.cast = (torch.autocast(device.type, dtype=torch.bfloat16) if self.train
                     else nullcontext())
        self.router = layer.router
        with torch.no_grad(), self.cast:
            self.routed = self.router(x) if not hasattr(layer, "route") else layer.route(x)[0]
        g = torch.Generator(device=device).manual_seed(7)
        self.dy = torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16)
        self.dgates = torch.randn(self.routed.gates.shape, device=device, generator=g)

    def _run(self, fn):
        def call():
            self.layer.zero_grad(set_to_none=True)
            with self.cast, torch.set_grad_enabled(self.train):
                return fn()
        return call

    def route(self):
        def fn():
            routed = self.router(_leaf(self.x, self.train))    # psum included in training
            if self.train:
                _backward([routed.gates, routed.psum],
                          [self.dgates, torch.ones_like(routed.psum)])
        return self._run(fn)

    def merge(self):
        """The sharded router's all-gather and merge alone, on its local lists."""
        from ..ops.router_shard import shard_select, shard_topk
        r = self.router
        with torch.no_grad(), self.cast:
            if self.train:
                a, w, exact = r.scored(self.x)
                lists = shard_topk(a, w, r.local_k, lowrank=r.lowrank, impl=r.impl,
                                   exact=exact)
            else:
                lists = shard_select(self.x, *r.select_args(), r.local_k, impl=r.impl)
                lists = (*lists[:2], None, lists[2])        # no lse in inference
        return self._run(lambda: r.merge(*lists))

    def experts(self):
        if self.flow == "b":
            return self._experts_local()
        idx = self.routed.topk_idx
        run = (self.layer.run_experts if self.flow == "a" else
               lambda x, g, i: self.layer.experts(x, g, i, check_ids=False))

        def fn():
            x, gates = _leaf(self.x, self.train), _leaf(self.routed.gates, self.train)
            y = run(x, gates, idx)
            if self.train:
                _backward([y], [self.dy])
        return self._run(fn)

    def _captured_local(self):
        """One exchange's experts' input (rows, gates, ids) and their outputs."""
        if getattr(self, "captured", None) is None:
            self.captured = self._capture_local()
        return self.captured

    def _capture_local(self):
        ep, routed = self.layer, self.routed
        with torch.no_grad(), self.cast:
            plan = plan_rows(routed.topk_idx, ep.hi - ep.lo, ep.chunks, ep.group)
            ex = RowExchange(plan, ep.group)
            got = ex.dispatch(self.x.to(torch.bfloat16), routed.gates, routed.topk_idx)
            for c in range(len(plan.chunk_bounds) - 1):
                ex.arrived(c)
            y_in = ep.run_experts(*got)
            b = plan.chunk_bounds
            for c in range(len(b) - 1):
                ex.send_back(c, y_in[b[c]:b[c + 1]])
            ex.returned(y_in)
        return got, y_in

    def _experts_local(self):
        (x_in, gates_in, ids_in), _ = self._captured_local()

        def fn():
            x, g = _leaf(x_in, self.train), _leaf(gates_in, self.train)
            y_in = self.layer.run_experts(x, g, ids_in)
            if self.train:
                _backward([y_in], [torch.ones_like(y_in)])
        return self._run(fn)

    def comm(self):
        if self.flow == "one_gpu":
            return None
        ep = self.layer
        if self.flow == "a":
            y = torch.zeros(self.x.shape, device=self.device, dtype=torch.bfloat16)
            grads = [torch.zeros_like(y), torch.zeros_like(self.routed.gates)]

            def fn():
                dist.all_reduce(y, group=ep.group)
                if self.train:
                    all_reduce_many(grads, ep.group)
            return fn
        _, y_in = self._captured_local()
        x = self.x.to(torch.bfloat16)

        def fn():
            p = plan_rows(self.routed.topk_idx, ep.hi - ep.lo, ep.chunks, ep.group)
            ex = RowExchange(p, ep.group)
            got = ex.dispatch(_leaf(x, self.train), _leaf(self.routed.gates, self.train),
                              self.routed.topk_idx)
            b = p.chunk_bounds
            for c in range(len(b) - 1):
                ex.arrived(c)
            y = _leaf(y_in, self.train)
            for c in range(len(b) - 1):
                ex.send_back(c, y[b[c]:b[c + 1]])
            back = ex.returned(y)
            if self.train:
                _backward([back, got[0], got[1]], [self.dy, torch.ones_like(got[0]),
                                                   torch.ones_like(got[1])])
        return self._run(fn)

    def total(self):
        def fn():
            x = _leaf(self.x, self.train)
            out = self.layer(x)
            if self.train:
                _backward([out.y, out.aux_loss], [self.dy, torch.ones_like(out.aux_loss)])
        return self._run(fn)


def wire_bytes(layer, flow: str, routed, x) -> int | None:
    """Bytes this rank sends per forward: a, the all-reduce of y (a ring sends 2 (E-1)/E
    of it); b, its rows (and their ids and gates) to the other ranks and their results
    back."""
    if flow == "one_gpu":
        return 0
    E, item = layer.shards, 2
    if flow == "a":
        return int(2 * (E - 1) / E * x.shape[0] * x.shape[1] * item)
    dest = routed.topk_idx.long() // (layer.hi - layer.lo)
    mask = torch.zeros(x.shape[0], E, dtype=torch.bool, device=x.device).scatter_(1, dest,
                                                                                 True)
    mask[:, layer.shard] = False
    rows = int(mask.sum())
    return rows * (2 * x.shape[1] * item + 2 * routed.topk_idx.shape[1] * 4)


# the phases whose calls hold collectives: a rank out of memory inside one cannot agree with
# the others, which wait in the collective it never reached
COLLECTIVE = ("merge", "comm", "total")


@contextmanager
def no_recovery(what: str):
    """Where collectives run: out of memory is a one-line error that stops this rank (under
    torchrun the others are stopped with it; elsewhere their collective fails), not an
    agreement the other ranks cannot reach."""
    try:
        yield
    except torch.OutOfMemoryError:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RankError(f"rank {rank} ran out of GPU memory in {what}, which holds "
                        f"collectives the other ranks wait in, so the run stops here; the "
                        f"rows measured before it are kept in --out") from None


def _agree(ok: bool, device) -> bool:
    """True when ok on every rank (one all-reduce of a flag)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _probe(fn, device) -> bool:
    """Run fn once (its warm-up, compiling the kernels) unless it runs out of memory; whether
    it fit on every rank. fn must hold no collective (a rank out of memory would leave the
    others waiting in it). On the CPU (a code-path check) nothing is run."""
    if device.type != "cuda":
        return True
    try:
        fn()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    free(device)
    return _agree(ok, device)


def inputs(setup: EPSetup, flow: str, device, rank: int, world: int):
    """x: the global batch (a, one_gpu: the same on every rank) or this rank's N/E rows."""
    seed, n = (1, setup.N) if flow != "b" else (2 + rank, setup.N // world)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, setup.h, device=device, generator=g).to(torch.bfloat16)


def _attempt(make, device):
    """make() where it holds no collective: its value, or None on every rank when it ran out
    of memory on any (agreed before any rank goes on to a collective)."""
    try:
        value, ok = make(), True
    except torch.OutOfMemoryError:
        value, ok = None, False
    if _agree(ok, device):
        return value
    del value
    free(device)
    return None


def measure(setup, cfg, flow, variant, phase, device, base) -> dict:
    """One row: each phase timed alone, then the layer. Out of memory where no collective
    runs is agreed over the ranks (an "oom" row); inside a collective it stops the run
    (no_recovery)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    row = {**base, "flow": flow, "variant": variant, "phase": phase, "M": cfg.experts,
           "r": cfg.rank, "N": setup.N, "E": world, "oom": False}
    where = f"({flow}) {variant} M={cfg.experts} {phase}"
    sharded = flow == "a" and variant == "more_sharded"
    chunks = 1 if variant == "more_one_chunk" else setup.chunks
    built = _attempt(lambda: (_build(cfg, flow, variant, phase, device, chunks),
                              inputs(setup, flow, device, rank, world)), device)
    if built is None:
        return {**row, "oom": True, "ms": None}
    layer, x = built
    if flow != "one_gpu":
        with no_recovery(f"{where}: the replicated weights' broadcast"):
            layer.broadcast_replicated()
    make = partial(Phases, layer, flow, x, phase, device)
    if sharded:                 # its routing gathers the shards' lists
        with no_recovery(f"{where}: the sharded routing"):
            ph = make()
    else:
        ph = _attempt(make, device)
    if ph is None:
        return {**row, "oom": True, "ms": None}
    row["chunks"] = None if flow == "one_gpu" else (
        chunks or auto_chunks(setup.N, cfg.top_k, cfg.experts))
    row["wire_bytes"] = wire_bytes(layer, flow, ph.routed, x)
    with no_recovery(f"{where}: the exchange") if flow == "b" else nullcontext():
        local = {"router": ph.route(), "experts": ph.experts()} if not sharded else \
            {"experts": ph.experts()}   # flow b's experts time the rows of one exchange
    if not all(_probe(fn, device) for fn in local.values()):
        del ph
        free(device)
        return {**row, "oom": True, "ms": None}
    timed = dict(local)
    with no_recovery(f"{where}: setting up its timed phases"):
        if sharded:
            timed["router"], timed["merge"] = ph.route(), ph.merge()
        timed["comm"], timed["total"] = ph.comm(), ph.total()
    for name, fn in timed.items():
        if fn is None:
            row[f"{name}_ms"] = 0.0
            continue
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        held = flow != "one_gpu" and (name in COLLECTIVE or sharded and name == "router")
        try:        # the layer holds the router's and the experts' memory at once
            with no_recovery(f"{where}: its {name} phase") if held else nullcontext():
                row[f"{name}_ms"] = time_fixed_ms(fn, device=device, warmup=setup.warmup,
                                                  reps=setup.reps)
        except torch.OutOfMemoryError:
            row[f"{name}_ms"] = None
        if not _agree(row[f"{name}_ms"] is not None, device):
            row.update(oom=True, total_ms=None)
            break
    row["ms"] = row.pop("total_ms", None)
    del ph, layer
    free(device)
    return row


def plan_points(setup: EPSetup):
    """(flow, variant, M, phase) in the order measured: each phase, M, flow, variant."""
    for phase in PHASES:
        for M in setup.experts:
            for flow in FLOWS:
                for variant in VARIANTS:
                    if (variant == "more_sharded" and flow != "a") or (
                            variant == "more_one_chunk" and (flow == "one_gpu"
                                                             or phase != "forward")):
                        continue
                    yield flow, variant, M, phase


def run_ep(device, *, quick: bool = False, progress=None):
    """Rows of every point (plan_points) on every rank; rank 0's are the ones to keep."""
    setup = QUICK if quick else EPSetup()
    env, ceil = environment(device), ceilings(device)
    link = link_rates(device, setup.link_bytes, warmup=setup.warmup, reps=setup.reps)
    base = {"bench": "ep", "h": setup.h, "s": setup.s, "k": setup.k, **env,
            **{f"ceiling_{k}": v for k, v in ceil.items()}, **link}
    points = list(plan_points(setup))
    for i, (flow, variant, M, phase) in enumerate(points, 1):
        row = measure(setup, config(setup, variant, M), flow, variant, phase, device, base)
        progress and progress(i, len(points), row)
        yield row
