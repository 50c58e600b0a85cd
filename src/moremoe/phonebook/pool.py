"""Running many phonebook trainings at once: several on each GPU, over every GPU asked for,
with checkpoints and a journal so that a search longer than a session continues where it
stopped.

One GPU is shared by runs on CUDA streams of their own in one process (DevicePool): each
run's steps are replays of its own CUDA graph, and graphs on different streams overlap on
the device, filling the gaps that one small model's kernels leave (separate processes only
time-slice the GPU). Several GPUs get one worker process each (Workers). The Executor drives
the plans of search.py: it hands their tasks to free slots, journals every
finished run (OUT/trials.jsonl, one record a line) and answers a task it has already
journaled at once, so a resumed search replays its plans without training them again. A
running task is checkpointed every `checkpoint_minutes` and when the command is asked to
stop (a signal, --stop-after), into OUT/trial_checkpoints/<key>.pt, and continues from
there (the journal and the checkpoints as files: journal.py).
"""
from __future__ import annotations

import io
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..report import write_atomic
from ..runtime import progress_bar, progress_note
from .trainer import PhonebookTrainer
from .journal import (CHECKPOINTS, JOURNAL, append_journal, check_checkpoints,
                      load_checkpoint, read_journal, unusable)
from .search import Task


@dataclass
class Event:
    kind: str                   # "progress", "tick", "done", "stopped" or "error"
    key: str
    steps: int = 0
    total: int = 0
    exact_match: float = 0.0
    record: dict | None = None
    message: str = ""
    loss: float = float("nan")
    epoch: float = 0.0


class DevicePool:
    """Up to `slots` runs at once on one device, each on its own CUDA stream. poll() moves
    every run on by one evaluation interval: it waits for a run's queued steps, evaluates
    it and queues its next interval while the other runs' steps keep the GPU busy."""

    def __init__(self, device: str, slots: int, checkpoint_dir: Path | None,
                 checkpoint_minutes: float = 5.0):
        self.device, self.slots = device, slots
        self.checkpoint_dir, self.every = checkpoint_dir, 60 * checkpoint_minutes
        self.active: dict[str, tuple[Task, PhonebookTrainer, list]] = {}
        self.fresh: set[str] = set()        # added, its first interval not yet queued
        # a signal or --stop-after: a CPU interval ends after the step it is asked during
        self.stop_requested = lambda: False
        # where steps run as they are called (a CPU), each one's "tick" Event goes here as
        # it ends, so progress moves inside an interval; None: not reported
        self.on_tick = None

    def free(self) -> int:
        return self.slots - len(self.active)

    def add(self, task: Task) -> Event:
        state = None
        path = self._path(task.key)
        if path is not None and path.exists():
            state = load_checkpoint(path)
        cfg = replace(task.train, device=self.device)
        stream = torch.cuda.Stream(cfg.device) if cfg.device.startswith("cuda") else None
        try:
            trainer = PhonebookTrainer(task.model, cfg, cfg.lr, name=task.name,
                                       calibration=task.calibration, stream=stream,
                                       state=state)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            if state is None:
                raise
            raise unusable(path, err) from None
        at = trainer.step.steps
        self.active[task.key] = (task, trainer, [time.monotonic()])
        self.fresh.add(task.key)        # its first interval: at the next poll, so that its
        return Event("progress", task.key, at, trainer.total,          # progress shows
                     message=f"resumed at step {at:,}" if state else "")

    def poll(self) -> list[Event]:
        events = []
        if self.stop_requested():   # stop() checkpoints the runs: none is evaluated at a
            return events           # step an interval was cut short at
        for key in list(self.active):
            task, trainer, saved = self.active[key]
            if key in self.fresh:
                self.fresh.discard(key)
                trainer.advance(self._ticking(key, trainer))
                continue
            done = trainer.settle()
            if done:
                del self.active[key]
                self._drop(key)
                events.append(Event("done", key, trainer.step.steps, trainer.total,
                                    trainer.run.exact_match, trainer.run.to_dict(),
                                    loss=trainer.run.history[-1]["loss"]))
                continue
            if self.checkpoint_dir is not None and time.monotonic() - saved[0] > self.every:
                self._save(key, trainer)
                saved[0] = time.monotonic()
            trainer.advance(self._ticking(key, trainer))
            last = trainer.run.history[-1]
            events.append(Event("progress", key, trainer.step.steps, trainer.total,
                                last["exact_match"], loss=last["loss"]))
        return events

    def _ticking(self, key: str, trainer: PhonebookTrainer):
        """The stop() an interval asks after each step where steps run as they are called:
        it reports the step (on_tick) and passes the stop request on."""
        if self.on_tick is None:
            return self.stop_requested
        start, done = trainer.step.steps, [0]

        def stop() -> bool:
            done[0] += 1
            self.on_tick(Event("tick", key, start + done[0], trainer.total))
            return self.stop_requested()
        return stop

    def stop(self) -> list[Event]:
        """Checkpoint every run and drop it: at its evaluation, or where a stop request cut
        a CPU interval short (not evaluated there, so that the resumed run evaluates and
        stops at the same steps as an uninterrupted one)."""
        events = []
        for key, (task, trainer, _) in list(self.active.items()):
            steps = trainer.step.steps
            if key in self.fresh:
                # added and never advanced: nothing to evaluate, and nothing to save (the
                # checkpoint it resumed from, if any, is where it was)
                last = trainer.run.history[-1] if trainer.run.history else {}
                events.append(Event("stopped", key, steps, trainer.total,
                                    last.get("exact_match", 0.0),
                                    loss=last.get("loss", float("nan")),
                                    epoch=last.get("epoch", 0.0)))
                continue
            if steps % trainer.cfg.eval_every == 0 or steps >= trainer.total:
                trainer.settle()            # the queued steps land before the save
            if trainer.done:
                events.append(Event("done", key, trainer.step.steps, trainer.total,
                                    trainer.run.exact_match, trainer.run.to_dict()))
                self._drop(key)
            else:
                self._save(key, trainer)
                last = trainer.run.history[-1] if trainer.run.history else {}
                events.append(Event("stopped", key, trainer.step.steps, trainer.total,
                                    last.get("exact_match", 0.0),
                                    loss=last.get("loss", float("nan")),
                                    epoch=last.get("epoch", 0.0)))
        self.active.clear()
        self.fresh.clear()
        return events

    def _path(self, key: str) -> Path | None:
        return None if self.checkpoint_dir is None else self.checkpoint_dir / f"{key}.pt"

    def _save(self, key: str, trainer: PhonebookTrainer) -> None:
        buf = io.BytesIO()
        torch.save(trainer.state_dict(), buf)
        write_atomic(self._path(key), buf.getvalue())

    def _drop(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            path.unlink(missing_ok=True)


def _worker(slot: int, device: str, slots: int, checkpoint_dir, minutes: float, inbox,
            outbox) -> None:
    """Worker process `slot`: a DevicePool on `device`, fed tasks through inbox ("stop"
    checkpoints its runs and ends it); every event goes to outbox with the slot."""
    from ..checks import UserError
    for sig in (signal.SIGINT, signal.SIGTERM):     # the parent decides when to stop
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    pool = DevicePool(device, slots, Path(checkpoint_dir) if checkpoint_dir else None, minutes)
    pool.on_tick = lambda ev: outbox.put((slot, ev))
    try:
        while True:
            if os.getppid() != parent:              # the parent died without a word
                return
            try:
                msg = inbox.get(timeout=5 if not pool.active else 0.001)
            except queue.Empty:
                msg = None
            if msg == "stop":
                for ev in pool.stop():
                    outbox.put((slot, ev))
                outbox.put((slot, Event("stopped", "")))
                return
            if msg is not None:
                outbox.put((slot, pool.add(msg)))
                continue
            for ev in pool.poll():
                outbox.put((slot, ev))
    except (UserError, ValueError) as err:     # the run's sizes or settings: the user's
        outbox.put((slot, Event("error", "", message=str(err), record={"user": True})))
    except Exception as err:        # a bug: reported by the parent with the traceback
        outbox.put((slot, Event("error", "", message=f"{device}: {type(err).__name__}: "
                                f"{err}\n{traceback.format_exc()}")))


class Workers:
    """One worker process per device, `slots` runs each; the same free / add / poll / stop
    as a DevicePool, for the Executor."""

    def __init__(self, devices: list[str], slots: int, checkpoint_dir, minutes: float):
        ctx = torch.multiprocessing.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in devices]
        self.load = [0] * len(devices)
        self.slots = slots
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(i, d, slots, str(checkpoint_dir) if checkpoint_dir
                                        else None, minutes, self.inboxes[i], self.outbox))
                      for i, d in enumerate(devices)]
        for p in self.procs:
            p.start()

    def free(self) -> int:
        return sum(self.slots - n for n in self.load)

    def add(self, task: Task) -> Event:
        slot = min(range(len(self.load)), key=self.load.__getitem__)
        self.load[slot] += 1
        self.inboxes[slot].put(task)
        return Event("queued", task.key, 0, task.train.planned_steps())

    def poll(self, timeout: float = 1.0) -> list[Event]:
        events = []
        try:
            events.append(self._note(*self.outbox.get(timeout=timeout)))
            while True:
                events.append(self._note(*self.outbox.get_nowait()))
        except queue.Empty:
            pass
        if not events and not all(p.is_alive() for p in self.procs):
            raise RuntimeError("a phonebook worker process died without reporting "
                               "(out of host memory?)")
        return events

    def _note(self, slot: int, ev: Event) -> Event:
        if ev.kind in ("done", "stopped") and ev.key:
            self.load[slot] -= 1
        return ev

    def stop(self) -> list[Event]:
        for inbox in self.inboxes:
            inbox.put("stop")
        events, waiting = [], len(self.procs)
        while waiting:
            slot, ev = self.outbox.get()
            if ev.kind == "stopped" and not ev.key:
                waiting -= 1
            else:
                events.append(ev)
        for p in self.procs:
            p.join(timeout=30)
        return events

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()


@dataclass
class ExecutorReport:
    reused: list = field(default_factory=list)      # task names answered from the journal
    resumed: list = field(default_factory=list)     # (task name, step): from a checkpoint
    stopped_at: list = field(default_factory=list)  # runs checkpointed at a stop: name,
                                                    # steps, total, last epoch, exact match

    @property
    def stopped(self) -> list:
        """The names of the runs checkpointed at a stop."""
        return [r["name"] for r in self.stopped_at]


class Executor:
    """Runs plans (search.py) to their results on `devices` ("cpu", or one or more
    "cuda:N"), `slots` tasks at a time on each. out: the folder of the journal and the
    checkpoints (None: neither). stop_after: seconds, after which every running task is
    checkpointed and run() returns with stopped True; so does a SIGINT / SIGTERM."""

    def __init__(self, devices: list[str], slots: int, out: Path | None, *,
                 progress: bool = True, checkpoint_minutes: float = 5.0,
                 stop_after: float | None = None):
        self.devices, self.slots, self.out = devices, slots, out
        self.progress, self.minutes, self.stop_after = progress, checkpoint_minutes, stop_after
        # read and checked before any work: a damaged file stops the command at once
        self.journal, self._cut = read_journal(out / JOURNAL) if out is not None else ({}, None)
        if out is not None:
            check_checkpoints(out / CHECKPOINTS)
        self.report = ExecutorReport()
        self.stopped = False
        self.results: dict = {}         # plan name -> result, as the plans finish
        # plan name -> the finished training runs (not calibrations) of the round it waits
        # on: what a stopped search has measured beyond its last whole round
        self.in_round: dict = {}

    def _journal(self, key: str, record: dict) -> None:
        self.journal[key] = record
        if self.out is not None:
            append_journal(self.out / JOURNAL, key, record, self._cut)
            self._cut = None

    def _stopping(self, signals) -> bool:
        """A signal came, or --stop-after's time is up."""
        return bool(signals.requested) or (self.stop_after is not None and
                                            time.monotonic() - self._t0 > self.stop_after)

    def run(self, plans: dict, *, on_change=None) -> dict:
        """{name: plan} -> {name: result} (results of plans that finished; with stopped,
        the others are missing). on_change(results so far) after every finished task."""
        from ..training.signals import StopSignals
        ckpt = None if self.out is None else self.out / CHECKPOINTS
        self._t0 = time.monotonic()
        made = [] if self.out is None else [p for p in (ckpt, self.out / JOURNAL, self.out)
                                             if not p.exists()]
        if ckpt is not None:
            ckpt.mkdir(parents=True, exist_ok=True)
            (self.out / JOURNAL).touch()        # what --resume looks for
        backend = (DevicePool(self.devices[0], self.slots, ckpt, self.minutes)
                   if len(self.devices) == 1 else
                   Workers(self.devices, self.slots, ckpt, self.minutes))
        try:
            with StopSignals() as signals:
                if isinstance(backend, DevicePool):
                    backend.stop_requested = lambda: self._stopping(signals)
                return self._loop(plans, backend, signals, on_change)
        except BaseException:
            _drop_if_empty(self.out, made)      # a run that failed with nothing done
            raise
        finally:
            if isinstance(backend, Workers):
                backend.close()

    def _loop(self, plans: dict, backend, signals, on_change) -> dict:
        results, waiting, queue_, bars = self.results, {}, [], {}
        tasks: dict[str, Task] = {}
        if isinstance(backend, DevicePool):     # steps in this process: ticks come here
            backend.on_tick = lambda ev: self._on_event(ev, tasks, bars, finish)

        def ask(name, records=None):
            try:
                wanted = next(plans[name]) if records is None else plans[name].send(records)
            except StopIteration as stop:
                results[name] = stop.value
                return
            if not wanted:                          # a round with nothing to train
                ask(name, [])
                return
            waiting[name] = ([t.key for t in wanted], {})
            for t in wanted:
                tasks[t.key] = t
                if t.key in self.journal:
                    self.report.reused.append(t.name)
                    finish(t.key, self.journal[t.key], journaled=True)
                elif t.key not in queue_ and t.key not in bars:
                    queue_.append(t.key)

        def finish(key, record, journaled=False):
            if not journaled:
                self._journal(key, record)
            for name, (keys, got) in list(waiting.items()):
                if key in keys:
                    got[key] = record
                    self.in_round[name] = [got[k] for k in keys if k in got
                                           and tasks[k].purpose == "train"]
                    if len(got) == len(set(keys)):
                        del waiting[name]
                        self.in_round.pop(name)
                        ask(name, [got[k] for k in keys])
            if on_change is not None:
                on_change(results)

        for name in list(plans):
            ask(name)
        while waiting:
            if self._stopping(signals):
                self._stop(backend, tasks, bars, finish)
                break
            while queue_ and backend.free() > 0:
                key = queue_.pop(0)
                if tasks[key].note:
                    progress_note(tasks[key].note, enabled=self.progress)
                self._on_event(backend.add(tasks[key]), tasks, bars, finish)
            if not bars and not queue_:
                break                   # nothing runs and nothing is left to start
            for ev in backend.poll():
                self._on_event(ev, tasks, bars, finish)
        return results

    def _on_event(self, ev: Event, tasks, bars, finish) -> None:
        if ev.kind == "error":
            from ..checks import UserError
            raise (UserError if (ev.record or {}).get("user") else RuntimeError)(ev.message)
        task = tasks.get(ev.key)
        if task is None:
            return
        bar = bars.get(ev.key)
        if bar is None:
            bar = bars[ev.key] = [progress_bar(ev.total, desc=task.name, enabled=self.progress,
                                               initial=ev.steps), ev.steps]
        if ev.message.startswith("resumed"):
            self.report.resumed.append([task.name, ev.steps])
            progress_note(f"{task.name}: {ev.message}", enabled=self.progress)
        if ev.kind == "tick":
            bar[0].update(max(0, ev.steps - bar[1]))
            bar[1] = max(bar[1], ev.steps)
            return
        if ev.kind in ("progress", "done") and ev.loss == ev.loss:      # evaluated
            bar[0].set_postfix(loss=f"{ev.loss:.3f}", em=f"{ev.exact_match:.3f}")
        bar[0].update(ev.steps - bar[1])
        bar[1] = ev.steps
        if ev.kind in ("done", "stopped"):
            bar[0].close()
            del bars[ev.key]
            if ev.kind == "done":
                finish(ev.key, ev.record)
            else:
                self.report.stopped_at.append({"name": task.name, "steps": ev.steps,
                                               "total": ev.total, "epoch": ev.epoch,
                                               "exact_match": ev.exact_match})

    def _stop(self, backend, tasks, bars, finish) -> None:
        self.stopped = True
        for ev in backend.stop():
            self._on_event(ev, tasks, bars, finish)


def _drop_if_empty(out: Path | None, made: list[Path]) -> None:
    """Remove what a run made (the checkpoint folder, the journal, --out itself) while still
    empty: a command that failed before any run ended leaves nothing behind."""
    for path in made:
        try:
            if path.is_dir():
                path.rmdir()                    # only when empty
            elif path.stat().st_size == 0:
                path.unlink()
        except OSError:
            pass
