"""One phonebook run's training step on one device: the batch order, the model, AdamW and
the learning-rate schedule, stepped eagerly or replayed from one CUDA graph.

The step never reads a value back to the host. The batch is gathered on the device from the
phonebook held there; the learning rate is a device scalar the step computes from its own
step counter; a step whose loss is not finite skips the update (fused AdamW's found_inf) and
is remembered on the device; the training loss and each layer's routing counts (for H_norm)
are summed on the device. All of it is read back only when the trainer evaluates, so on a
GPU the whole step (batch, forward, backward, update, schedule) is captured once as a CUDA
graph and replayed: the phonebook models are so small that launching their kernels one by
one, not running them, is what an eager step spends its time on. The same step run without
capture is the eager reference (and the CPU path); the captured one replays the same kernels.

Legend: P phonebook entries, b batch rows, S = 16 tokens an entry, L layers, M experts.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..model import Transformer, TransformerConfig
from ..runtime import autocast_dtype
from . import task as pb
from ..training.optim import make_optimizer

WARMUP_STEPS = 2        # eager steps before a capture (Triton compilation, AdamW's state)
STEP_MODES = ("auto", "graph", "compiled", "eager")
CAPTURED = ("graph", "compiled")


COMPILE_FROM_STEPS = 5_000   # "auto" compiles a GPU run this long: 18 s of compiling at most
                             # (bench phonebook, H100) against 1.5 ms saved a step
# inductor's combo kernels (independent kernels of a graph, the per-weight casts among them,
# in one launch): MoE-32 3.237 -> 3.087 ms a step, 587 -> 503 kernels; MoRE-96 3.938 ->
# 3.787, 677 -> 587 (benchmarks/phonebook_inductor_ab.py, H100, 4936895)
COMPILE_OPTIONS = {"combo_kernels": True}


def check_mode(mode: str, device: torch.device, name: str = "step mode") -> None:
    """ValueError when mode cannot run on device (a CUDA graph needs a GPU); name: what the
    message calls the mode (the CLI's --step)."""
    if mode not in STEP_MODES:
        raise ValueError(f"{name} must be one of {STEP_MODES}, got {mode!r}")
    if mode in CAPTURED and device.type != "cuda":
        raise ValueError(f"{name} {mode} captures a CUDA graph: it needs a GPU, the run is on "
                         f"{device}; use eager or auto")


def auto_mode(device: torch.device, planned_steps: int) -> str:
    """eager on a CPU; on a GPU one CUDA graph a step, its blocks compiled first when the run
    is long enough to win back the compilation."""
    if device.type != "cuda":
        return "eager"
    return "compiled" if planned_steps >= COMPILE_FROM_STEPS else "graph"


class BatchOrder:
    """The order the entries are trained in: one permutation of the P entries after another
    (a fresh one each epoch, drawn by a CPU generator seeded by the run, so a run sees the
    same batches on any device), cut into batches of b = min(batch, P) rows. A batch that
    reaches the end of one permutation continues into the next, so every batch has b rows
    (a static shape) and every entry is seen once an epoch. The device holds two
    permutations back to back (order_2P) and the next batch's first row (start_t, which the
    step advances); the host mirrors start and, once it passes P, moves the second
    permutation forward and draws the next one into its place, asynchronously."""

    def __init__(self, size: int, batch: int, seed: int, device: torch.device):
        self.P, self.b = size, min(batch, size)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.order_2P = torch.cat([self._draw(), self._draw()]).to(device)
        self.start = 0
        self.start_t = torch.zeros((), dtype=torch.long, device=device)
        self.rows_b = torch.arange(self.b, device=device)
        self._pinned = []           # two host buffers for the next permutation (CUDA only)
        self._flip = 0

    def _draw(self) -> torch.Tensor:
        return torch.randperm(self.P, generator=self.gen)

    def indices(self) -> torch.Tensor:
        """(b,) entries of the next batch (device-side; capturable)."""
        return self.order_2P.index_select(0, self.start_t + self.rows_b)

    def advance_device(self) -> None:
        self.start_t += self.b

    def advance_host(self) -> None:
        """After a step: the host's mirror of start, and a new permutation at an epoch end."""
        self.start += self.b
        if self.start < self.P:
            return
        P = self.P
        self.order_2P[:P].copy_(self.order_2P[P:])
        self._upload(self._draw())
        self.start -= P
        self.start_t -= P

    def _upload(self, perm_P: torch.Tensor) -> None:
        dst = self.order_2P[self.P:]
        if dst.device.type != "cuda":
            dst.copy_(perm_P)
            return
        if not self._pinned:
            self._pinned = [[torch.empty(self.P, dtype=torch.long).pin_memory(), None]
                            for _ in range(2)]
        buf = self._pinned[self._flip]
        if buf[1] is not None:
            buf[1].synchronize()        # its copy of two epochs ago, done long since
        buf[0].copy_(perm_P)
        dst.copy_(buf[0], non_blocking=True)
        buf[1] = torch.cuda.Event()
        buf[1].record()
        self._flip ^= 1

    def state_dict(self) -> dict:
        return {"order": _to_cpu(self.order_2P), "start": self.start,
                "generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.order_2P.copy_(state["order"])
        self.start = int(state["start"])
        self.start_t.fill_(self.start)
        self.gen.set_state(state["generator"])


class PhonebookStep:
    """A run's model, optimizer and data order on `device`, stepped by run(n): replaying a
    captured CUDA graph (mode "graph"; "auto" on a GPU), the same with the blocks
    torch.compile'd before the capture ("compiled") or eagerly ("eager"; "auto" on a CPU).
    Work is queued on `stream` (a CUDA stream of its own lets several runs share a GPU).
    read() returns and restarts what the steps since the last read accumulated."""

    def __init__(self, model_cfg: TransformerConfig, cfg, lr: float, *, device: torch.device,
                 mode: str = "auto", stream: torch.cuda.Stream | None = None):
        check_mode(mode, device)
        self.cfg, self.device, self.base_lr = cfg, device, float(lr)
        self.mode = auto_mode(device, cfg.planned_steps()) if mode == "auto" else mode
        self.stream = stream
        self.amp = autocast_dtype(device)
        self.warmup = max(1, round(cfg.warmup_frac * cfg.planned_steps()))
        with self.on_stream():
            self._build(model_cfg)
        self.graph = None
        self.steps = 0                  # steps taken (host count)
        self.unread = 0                 # steps since the last read()

    def _build(self, model_cfg: TransformerConfig) -> None:
        cfg, dev = self.cfg, self.device
        book = pb.Phonebook(cfg.size, cfg.seed)
        tokens_PS = book.tokens()
        self.tokens_PS = tokens_PS.to(dev)
        self.eval_tokens = tokens_PS[book.eval_indices(cfg.eval_entries)].to(dev)
        self.order = BatchOrder(cfg.size, cfg.batch_size, cfg.seed, dev)
        torch.manual_seed(cfg.seed)
        self.model = Transformer(model_cfg).to(dev)
        if self.mode == "compiled":
            # a search's worker compiles every shape it trains (MoE and MoRE, each h, s, r):
            # more than dynamo's default 8 graphs of one code object
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       64)
            self.model.compile_blocks(options=COMPILE_OPTIONS)
        self.lr_t = torch.zeros((), device=dev)
        self.opt = make_optimizer(self.model, lr=self.base_lr, betas=cfg.betas,
                                  weight_decay=cfg.weight_decay, fused=True,
                                  capturable=dev.type == "cuda")
        for group in self.opt.param_groups:     # one device scalar: the schedule's rate
            group["lr"] = self.lr_t
        self.found_inf = torch.zeros((), device=dev)
        self.opt.found_inf = self.found_inf     # fused AdamW skips a step while it is 1
        self.step_t = torch.zeros((), dtype=torch.long, device=dev)
        self.first_bad = torch.zeros((), dtype=torch.long, device=dev)
        self.loss_sum = torch.zeros((), device=dev)
        self.counts_LM = torch.zeros(model_cfg.layers, model_cfg.moe.experts,
                                     dtype=torch.long, device=dev)

    def on_stream(self):
        return (torch.cuda.stream(self.stream) if self.stream is not None
                else contextlib.nullcontext())

    def _step(self) -> None:
        """One training step, entirely on the device (the body of the CUDA graph)."""
        batch_bS = self.tokens_PS.index_select(0, self.order.indices())
        inputs, targets = pb.inputs_and_targets(batch_bS, self.cfg.loss_on)
        ramp = ((self.step_t + 1).float() / self.warmup).clamp(max=1.0)
        self.lr_t.copy_(self.base_lr * ramp)          # constant after a linear warmup
        with torch.autocast(device_type=self.device.type, dtype=self.amp,
                            enabled=self.amp is not None, cache_enabled=False):
            out = self.model(inputs, targets)
        out.loss.backward()
        bad = ~torch.isfinite(out.loss.detach())
        self.found_inf.copy_(bad.float())
        self.opt.step()
        self.step_t += 1
        self.first_bad.copy_(torch.where((self.first_bad == 0) & bad, self.step_t,
                                         self.first_bad))
        self.loss_sum += out.lm_loss.detach().float()
        self.counts_LM += torch.stack(out.expert_counts)
        self.order.advance_device()

    def run(self, n: int, stop: Callable[[], bool] | None = None) -> int:
        """Queue n steps (no host synchronisation); returns how many. stop() is asked after
        each step where steps run as they are called (the CPU: a stop request need not wait
        for the whole interval), and ends the run early when it says so."""
        done = 0
        check = stop is not None and self.device.type != "cuda"
        with self.on_stream():
            if self.mode in CAPTURED and self.graph is None:
                self._capture()
            for _ in range(n):
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.opt.zero_grad(set_to_none=True)
                    self._step()
                self.order.advance_host()
                done += 1
                if check and stop():
                    break
        self.steps += done
        self.unread += done
        return done

    def _capture(self) -> None:
        """Warm up eagerly on a side stream (Triton compiles, AdamW makes its state), put
        every tensor the warm-up changed back as it was, then capture one step."""
        saved = self._snapshot()
        here = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.opt.zero_grad(set_to_none=True)
                self._step()
        here.wait_stream(side)
        self._restore(saved)
        self.opt.zero_grad(set_to_none=True)    # the capture's backward owns the gradients
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self._step()
        here.wait_stream(side)
        self.graph = graph

    def _device_tensors(self) -> list[torch.Tensor]:
        return [self.step_t, self.first_bad, self.loss_sum, self.lr_t, self.order.start_t,
                self.counts_LM]

    @torch.no_grad()
    def _snapshot(self) -> dict:
        return {"params": [p.detach().clone() for p in self.model.parameters()],
                "state": {p: {k: v.clone() for k, v in s.items()}
                          for p, s in self.opt.state.items()},
                "buffers": [t.clone() for t in self._device_tensors()]}

    @torch.no_grad()
    def _restore(self, saved: dict) -> None:
        for p, v in zip(self.model.parameters(), saved["params"]):
            p.copy_(v)
        for p, state in self.opt.state.items():
            before = saved["state"].get(p)
            for key, t in state.items():
                t.copy_(before[key]) if before is not None else t.zero_()
        for t, v in zip(self._device_tensors(), saved["buffers"]):
            t.copy_(v)

    def read(self) -> dict:
        """Mean training loss, per-layer routing counts and the first non-finite step (0 if
        none) of the steps since the last read, restarting the sums (syncs this stream)."""
        with self.on_stream():
            loss_sum, first_bad = torch.stack([self.loss_sum,
                                               self.first_bad.float()]).tolist()
            counts_LM = _to_cpu(self.counts_LM)
            self.loss_sum.zero_()
            self.counts_LM.zero_()
        n, self.unread = self.unread, 0
        return {"loss": loss_sum / max(n, 1), "counts": counts_LM, "first_bad": int(first_bad)}

    def state_dict(self) -> dict:
        """Everything an exact resume needs, on the CPU."""
        with self.on_stream():
            opt = self.opt.state_dict()
            for group in opt["param_groups"]:
                group["lr"] = self.base_lr
            return {"model": _to_cpu(self.model.state_dict()), "optimizer": _to_cpu(opt),
                    "order": self.order.state_dict(), "steps": self.steps,
                    "unread": self.unread, "buffers": _to_cpu(self._device_tensors())}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Before the first run(): a capture afterwards starts from this state."""
        with self.on_stream():
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            for group in self.opt.param_groups:
                group["lr"] = self.lr_t
            self.order.load_state_dict(state["order"])
            for t, v in zip(self._device_tensors(), state["buffers"]):
                t.copy_(v)
        self.steps = int(state["steps"])
        self.unread = int(state.get("unread", 0))     # steps in the loss sums (buffers)
        self.graph = None


def _to_cpu(obj):
    """A copy on the CPU of every tensor in obj (a copy also of those already there)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
