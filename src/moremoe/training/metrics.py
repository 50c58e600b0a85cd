"""Run logging and throughput: the JSONL log (plus optional TensorBoard), step timing that
leaves out warm-up steps, evaluations and checkpoints, and MFU against a peak rate."""
from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from ..report import dumps
from ..runtime import duration

# Dense bf16 tensor-core peaks (TFLOP/s per GPU), matched against the CUDA device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0}


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """The given peak, else the known peak of this GPU, else None (no MFU; e.g. on CPU)."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _event(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class RunLog:
    """One JSON object per event in RUN/log.jsonl (flushed), optional TensorBoard scalars.

    Only the main rank writes; the others hold a RunLog that does nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool):
        self.path, self.enabled, self.tb = Path(run_dir) / "log.jsonl", enabled, None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError as err:
                warnings.warn(f"TensorBoard logging skipped ({err}); pip install tensorboard")
        self._f = open(self.path, "a")

    def truncate_after(self, step: int) -> None:
        """Drop events past `step` (the steps a killed run did after its last checkpoint) and a
        line the kill cut short; step -1 drops every event (a fresh start)."""
        if not self.enabled:
            return
        self._f.close()
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        kept = [ln for ln in lines if (ev := _event(ln)) is not None and ev.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(self.path)
        self._f = open(self.path, "a")

    def write(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        row = {"event": event, "time": round(time.time(), 3), **fields}
        self._f.write(dumps(row) + "\n")        # strict JSON: a NaN is null
        self._f.flush()
        if self.tb is not None and "step" in fields:
            for key, v in fields.items():
                if isinstance(v, (int, float)) and key != "step" and v == v:
                    self.tb.add_scalar(f"{event}/{key}", v, fields["step"])
                elif key == "hnorm" and isinstance(v, list):
                    for i, h in enumerate(v):
                        self.tb.add_scalar(f"{event}/hnorm_layer{i}", h, fields["step"])

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self.tb is not None:
                self.tb.close()


class StepClock:
    """Wall time of optimizer steps, leaving out each process's first `warmup` steps and any
    time spent in `paused()` blocks (evaluation, checkpoints). Times are taken after a device
    synchronisation, so per-window and overall means are of finished GPU work."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup = device, warmup
        self.steps = 0                            # steps run by this process
        sync(device)
        self.start = self.timed_from = self.window_from = time.perf_counter()
        self.paused_all = self.paused_timed = self.paused_window = 0.0
        self.window_steps = 0

    def stepped(self) -> None:
        self.steps += 1
        self.window_steps += 1
        if self.steps == self.warmup:
            sync(self.device)
            self.timed_from, self.paused_timed = time.perf_counter(), 0.0

    def paused(self):
        clock = self

        class _Pause:
            def __enter__(self):
                sync(clock.device)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                sync(clock.device)
                dt = time.perf_counter() - self.t
                clock.paused_all += dt
                clock.paused_timed += dt
                clock.paused_window += dt
        return _Pause()

    def window(self) -> tuple[int, float]:
        """(steps, seconds) since the last call (the caller has synchronised)."""
        now = time.perf_counter()
        out = (self.window_steps, max(now - self.window_from - self.paused_window, 1e-9))
        self.window_from, self.paused_window, self.window_steps = now, 0.0, 0
        return out

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def mean_step_seconds(self) -> float | None:
        """Mean over the steps after warm-up (all steps when there were no more than that)."""
        sync(self.device)
        warm = self.steps > self.warmup
        timed = self.steps - self.warmup if warm else self.steps
        since = self.timed_from if warm else self.start
        paused = self.paused_timed if warm else self.paused_all
        if timed < 1:
            return None
        return max(time.perf_counter() - since - paused, 1e-9) / timed


class StepProfiler:
    """torch.profiler over `steps` optimizer steps starting after the first `start` steps of
    this process; on the last one it writes the operators and kernels by device time (or CPU
    time without a GPU) to `path`, inside `pause()` (a StepClock's, to keep that out of the
    step times). steps = 0: does nothing."""

    def __init__(self, path: Path, device: torch.device, start: int, steps: int, *,
                 pause=contextlib.nullcontext):
        self.path, self.device, self.start, self.steps = Path(path), device, start, steps
        self.pause = pause
        self.done, self.prof = 0, None

    def stepped(self, steps_run: int) -> None:
        if not self.steps or self.path is None:
            return
        if self.prof is None and steps_run == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        elif self.prof is not None:
            self.done += 1
            if self.done == self.steps:
                self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        with self.pause():
            sync(self.device)
            self.prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self._tables())
        self.prof, self.path = None, None

    def _tables(self) -> str:
        """By device time (the kernels) and by host time (what launches them), with the
        totals: a step whose host time exceeds its device time is bound by the host."""
        avg = self.prof.key_averages()
        keys = ["self_cpu_time_total"]
        if self.device.type == "cuda":
            keys.insert(0, "self_cuda_time_total")
        return "".join(f"{self.done} steps after {self.start}, sorted by {key}\n"
                       f"{avg.table(sort_by=key, row_limit=40)}\n" for key in keys)


def echo_line(step: int, total: int, m: dict, *, first: bool = False) -> str:
    """The log line of a training window; the first step of a process has one of its own
    (a run shows it is alive before the first log_every steps, compilation included)."""
    if m["loss"] is None:
        parts = [f"step {step}/{total}", "every step of the window skipped (non-finite)"]
    else:
        parts = [f"step {step}/{total}", f"loss {m['loss']:.4f} (lm {m['lm_loss']:.4f} "
                 f"aux {m['aux_loss']:.4f})", f"lr {m['lr']:.2e}",
                 f"gnorm {m['grad_norm']:.3f}"]
    parts += [f"{m['tokens_per_s']:,.0f} tok/s", f"{m['step_ms']:.1f} ms/step"]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if m.get("skipped"):
        parts.append(f"{m['skipped']} skipped")
    if first:
        parts.append("first step (compilation and warm-up included)")
    elif step < total:
        parts.append(f"~{duration((total - step) * m['step_ms'] / 1000)} left")
    return " | ".join(parts)


def printer(stream=None):
    stream = stream or sys.stdout

    def emit(text: str) -> None:
        print(text, file=stream, flush=True)
    return emit


class ExpertCoverage:
    """Which experts have received a token since step 0, per layer: the metric of the router
    learning-rate ablation (the share of experts that the routers ever use). One bool per
    expert, OR-ed each step on the device (no host sync), united over ranks when read, and
    kept in checkpoints so that a resumed run reports what the uninterrupted one would."""

    def __init__(self):
        self.seen: list[torch.Tensor] | None = None

    def update(self, counts: list[torch.Tensor]) -> None:
        if not counts:
            return
        if self.seen is None:
            self.seen = [torch.zeros(c.shape, dtype=torch.bool, device=c.device) for c in counts]
        for seen, c in zip(self.seen, counts):
            seen |= c > 0

    def united(self, reduce) -> list[torch.Tensor]:
        """The union over ranks (reduce: an in-place max over ranks), also kept here."""
        if self.seen is None:
            return []
        self.seen = [reduce(seen.to(torch.int32)) > 0 for seen in self.seen]
        return self.seen

    def fractions(self, reduce) -> list[float]:
        return [float(s.float().mean()) for s in self.united(reduce)]

    def state(self, reduce) -> list[torch.Tensor]:
        return [s.cpu() for s in self.united(reduce)]

    def load(self, state: list[torch.Tensor] | None, device) -> None:
        self.seen = [s.to(device) for s in state] if state else None
