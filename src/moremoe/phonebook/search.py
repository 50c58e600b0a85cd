"""What the phonebook experiments ask to train, as plans: generators that yield the runs they
need next (a list of Tasks, run at the same time) and receive their records, so that one
executor (pool.py) can run the tasks of many plans at once, on several GPUs, and a
resumed search replays its plans against the records it already has.

- trial: the paper's protocol at one phonebook size: the learning-rate calibration (one
  short run per rate of the grid, at the same time), then the run at the best rate.
- capacity: the largest size on a grid whose trial reaches the threshold, assuming that a
  model which memorises a phonebook memorises every smaller one: a binary search, or, given
  a start (the paper's value), trials at the start and the next size up at the same time,
  then one grid point at a time up or down until the answer is bracketed.
- sweep: independent trials (rank, experts or hidden size), all at once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Generator

from ..model import TransformerConfig
from .trainer import PhonebookTrainConfig, calibration_config

Plan = Generator[list, list, object]      # yields [Task], receives [record dict], returns


@dataclass
class Task:
    """One training run a plan asks for: the model, its training config (learning rate
    set), whether it is a calibration run, and the calibration that chose its rate."""
    name: str
    model: TransformerConfig
    train: PhonebookTrainConfig
    purpose: str = "train"                              # "train" or "calibration"
    calibration: dict = field(default_factory=dict)     # lr -> digit accuracy
    note: str = ""                                      # said when the task starts

    @property
    def key(self) -> str:
        """Names the experiment (model, training settings, purpose), not where it ran: a
        resumed search reuses the record of a finished task with the same key."""
        text = json.dumps({"model": self.model.to_dict(), "train": self.train.experiment(),
                           "purpose": self.purpose}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parallel(*plans: Plan) -> Plan:
    """Several plans at once, in rounds: each round runs the tasks all of them ask for and
    hands each plan its own records; returns their results in order."""
    results, asks = [None] * len(plans), {}
    for i, plan in enumerate(plans):
        try:
            asks[i] = next(plan)
        except StopIteration as stop:
            results[i] = stop.value
    while asks:
        order = sorted(asks)
        records = yield [t for i in order for t in asks[i]]
        at = 0
        for i in order:
            mine, at = records[at:at + len(asks[i])], at + len(asks[i])
            try:
                asks[i] = plans[i].send(mine)
            except StopIteration as stop:
                results[i] = stop.value
                del asks[i]
    return results


def trial(model: TransformerConfig, cfg: PhonebookTrainConfig, name: str) -> Plan:
    """The learning-rate calibration (unless cfg.lr is set), then the run at the best rate;
    returns that run's record."""
    calibration, lr, note = {}, cfg.lr, ""
    if lr is None:
        rates = ", ".join(f"{rate:g}" for rate in cfg.lr_grid)
        first = (f"{name}: calibrating the learning rate over {rates} "
                 f"({cfg.calibration_steps:,} steps each, before training for at most "
                 f"{cfg.planned_steps():,} steps; --lr skips this)")
        records = yield [Task(f"{name} lr={rate:g} (calibration)", model,
                              calibration_config(cfg, rate), "calibration",
                              note=first if i == 0 else "")
                         for i, rate in enumerate(cfg.lr_grid)]
        calibration = {rate: rec["char_accuracy"] for rate, rec in zip(cfg.lr_grid, records)}
        lr = best_rate(cfg, records)
        scores = ", ".join(f"{rate:g}: {acc:.3f}" for rate, acc in calibration.items())
        note = (f"{name}: training with lr {lr:g}, the calibration's best (digit accuracy "
                f"{scores})")
    [record] = yield [Task(name, model, replace(cfg, lr=lr), "train",
                           {str(k): v for k, v in calibration.items()}, note)]
    return record


def best_rate(cfg: PhonebookTrainConfig, records: list) -> float:
    """The rate of the calibration run with the highest digit accuracy (the paper's rule).
    After a brief run every rate can still sit at chance (a tenth of the digits right), where
    the accuracies differ by sampling noise alone: rates within two standard errors of the
    best (binomial, over the evaluated digits) are tied, and the tie goes to the rate whose
    run reached the lower training loss."""
    from .task import NUMBER_LEN
    accs = [rec["char_accuracy"] for rec in records]
    top = max(accs)
    digits = min(cfg.size, cfg.eval_entries) * NUMBER_LEN
    se = (top * (1 - top) / digits) ** 0.5
    tied = [i for i, a in enumerate(accs) if a >= top - 2 * se]
    loss = [records[i]["history"][-1]["loss"] if records[i].get("history") else 0.0
            for i in tied]
    return cfg.lr_grid[tied[min(range(len(tied)), key=loss.__getitem__)]]


@dataclass
class CapacityResult:
    name: str
    sizes: list
    capacity: int | None                    # largest size that reached the threshold
    trials: list = field(default_factory=list)   # run records, in the order they finished
    start: int | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "sizes": self.sizes, "capacity": self.capacity,
                "start": self.start, "trials": self.trials}


def unfinished(name: str, partial: dict | None, running: list) -> dict:
    """An unfinished search as far as it went: the trials of its whole rounds (partial, the
    last on_trial result) and those finished in the round it waits on (running); capacity is
    then a lower bound (the largest size reached so far)."""
    trials = list(partial["trials"] if partial else []) + list(running)
    reached = [t["train"]["size"] for t in trials if t["reached"]]
    return {**(partial or {"name": name}), "trials": trials,
            "capacity": max(reached) if reached else None, "unfinished": True}


def capacity(model: TransformerConfig, sizes, cfg: PhonebookTrainConfig, *, name: str,
             start: int | None = None, on_trial=None, ahead: int = 1) -> Plan:
    """The largest size on the grid whose trial reaches the threshold (None: none does).
    Without start, a binary search; with start (a size, taken to the nearest grid point),
    the start and the `ahead` next sizes up at once; after a size is reached, the next
    1 + ahead sizes up; after a failure, one size down; until bracketed. on_trial(result)
    after each round (the caller's report)."""
    grid = sorted(set(int(s) for s in sizes))
    if not grid or grid[0] < 1:
        raise ValueError(f"sizes must be positive integers, got {sizes!r}")
    result = CapacityResult(name=name, sizes=grid, capacity=None, start=start)
    lo, hi, picks = 0, len(grid) - 1, None
    if start is not None:
        s = min(range(len(grid)), key=lambda i: abs(grid[i] - start))
        picks = list(range(s, min(len(grid), s + 1 + ahead)))
    while lo <= hi:
        picks = picks or [(lo + hi) // 2]
        records = yield from parallel(*(trial(model, replace(cfg, size=grid[i]),
                                              f"{name} {grid[i]:,}") for i in picks))
        for i, rec in sorted(zip(picks, records)):
            result.trials.append(rec)
            if rec["reached"]:
                result.capacity = max(result.capacity or 0, grid[i])
                lo = max(lo, i + 1)
            else:
                hi = min(hi, i - 1)
        if on_trial is not None:
            on_trial(result)
        if start is None:
            picks = None
        elif any(rec["reached"] for rec in records):
            # the next size and the `ahead` after it: with ahead 0 one at a time, so that a
            # failure never leaves a larger size of the same round to train for nothing
            picks = [i for i in range(max(picks) + 1, max(picks) + 2 + ahead) if lo <= i <= hi]
        else:
            picks = [i for i in (min(picks) - 1,) if lo <= i <= hi]
    return result
