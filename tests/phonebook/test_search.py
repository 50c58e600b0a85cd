"""The phonebook plans (phonebook/search.py) and the executor that runs many at once
(phonebook/pool.py): the calibration, the capacity searches, the journal, a resume
from checkpoints, and worker processes."""
import json
import pickle

import pytest

from moremoe.nn import MoEConfig
from moremoe.phonebook import pool
from moremoe.phonebook.trainer import PhonebookTrainConfig, phonebook_model_config
from moremoe.phonebook.pool import Executor
from moremoe.phonebook.search import Task, best_rate, capacity, parallel, trial

MODEL = phonebook_model_config(MoEConfig.moe(4, 2, 32, 8), layers=1)


def record(task: Task, reached=False, acc=0.0) -> dict:
    return {"name": task.name, "train": {"size": task.train.size}, "lr": task.train.lr,
            "reached": reached, "char_accuracy": acc, "exact_match": float(reached)}


def drive(plan, answer):
    """Run a plan to its result, answering each round's tasks with answer(task)."""
    rounds = []
    try:
        tasks = next(plan)
        while True:
            rounds.append(tasks)
            tasks = plan.send([answer(t) for t in tasks])
    except StopIteration as stop:
        return stop.value, rounds


def test_trial_calibrates_at_once_then_trains_at_the_best_rate():
    acc = {1e-4: 0.2, 3e-4: 0.7, 1e-3: 0.5}
    cfg = PhonebookTrainConfig(size=10, calibration_steps=7)
    rec, rounds = drive(trial(MODEL, cfg, "x"),
                        lambda t: record(t, acc=acc[t.train.lr]))
    assert [len(r) for r in rounds] == [3, 1]
    assert all(t.purpose == "calibration" and t.train.max_steps == 7 and
               t.train.threshold == float("inf") for t in rounds[0])
    assert rounds[1][0].train.lr == 3e-4 and rec["lr"] == 3e-4
    assert rounds[1][0].calibration == {"0.0001": 0.2, "0.0003": 0.7, "0.001": 0.5}
    _, given = drive(trial(MODEL, PhonebookTrainConfig(size=10, lr=1e-3), "x"), record)
    assert [len(r) for r in given] == [1]                   # --lr: no calibration


def test_rates_at_chance_are_tied_and_the_lower_loss_wins():
    """After 200 steps every rate sits near 0.1 digit accuracy: 0.103 against 0.109 over
    8,000 digits is noise (se 0.0035), so the loss decides; 0.15 is not noise."""
    cfg = PhonebookTrainConfig(size=10000, lr_grid=(1e-4, 3e-4, 1e-3))

    def recs(accs, losses):
        return [{"char_accuracy": a, "history": [{"loss": x}]} for a, x in zip(accs, losses)]
    assert best_rate(cfg, recs([0.101, 0.109, 0.103], [2.9, 2.5, 2.2])) == 1e-3
    assert best_rate(cfg, recs([0.101, 0.150, 0.103], [2.9, 2.5, 2.2])) == 3e-4
    assert best_rate(cfg, recs([0.60, 0.61, 0.20], [0.9, 1.0, 0.5])) == 1e-4


def test_parallel_runs_plans_in_rounds_and_returns_their_results_in_order():
    cfg = PhonebookTrainConfig(size=10, calibration_steps=7)
    res, rounds = drive(parallel(trial(MODEL, cfg, "a"), trial(MODEL, cfg.__class__(
        size=20, lr=1e-3), "b")), lambda t: record(t, acc=t.train.lr or 0))
    assert [len(r) for r in rounds] == [4, 1]       # a's 3 calibrations with b's run; a's run
    assert [r["name"] for r in res] == ["a", "b"]


@pytest.mark.parametrize("cap", [None, 100, 300, 1000, 3000, 10000])
@pytest.mark.parametrize("start", [None, 100, 1000, 10000])
def test_capacity_finds_the_largest_size_reached(cap, start):
    grid = [10000, 100, 300, 1000, 3000]
    cfg = PhonebookTrainConfig(size=1, lr=1e-3)
    res, rounds = drive(capacity(MODEL, grid, cfg, name="m", start=start),
                        lambda t: record(t, reached=cap is not None and t.train.size <= cap))
    assert res.capacity == cap and res.sizes == sorted(grid)
    tried = [t.train.size for r in rounds for t in r]
    assert len(tried) == len(set(tried))
    if start is None:
        assert len(rounds) <= 3                      # binary search over 5 sizes
    else:                                            # the start and the next size at once
        first = sorted(grid)[sorted(grid).index(start):][:2]
        assert sorted(tried[:len(first)]) == first and len(rounds[0]) == len(first)


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_capacity_trains_one_plus_ahead_sizes_a_round_going_up(ahead):
    """--ahead 0 goes up one size at a time: a 150K failure never leaves a 200K trial of the
    same round to train for nothing (the 150K bracket of the rank figure trained one)."""
    grid = [100, 300, 1000, 3000, 10000, 30000]
    res, rounds = drive(capacity(MODEL, grid, PhonebookTrainConfig(size=1, lr=1e-3), name="m",
                                 start=100, ahead=ahead),
                        lambda t: record(t, reached=t.train.size <= 1000))
    sizes = [[t.train.size for t in r] for r in rounds]
    assert res.capacity == 1000
    assert sizes == {0: [[100], [300], [1000], [3000]],
                     1: [[100, 300], [1000, 3000]],
                     2: [[100, 300, 1000], [3000, 10000, 30000]]}[ahead]


def test_capacity_at_the_papers_value_takes_one_round():
    grid = [3000, 10000, 30000, 100000]
    res, rounds = drive(capacity(MODEL, grid, PhonebookTrainConfig(size=1, lr=1e-3), name="m",
                                 start=10000),
                        lambda t: record(t, reached=t.train.size <= 10000))
    assert res.capacity == 10000 and len(rounds) == 1


class FakeTrainer:
    """Finishes a run in one interval: reached when the size is at most CAP."""
    CAP, built = 100, []

    def __init__(self, model, cfg, lr, *, name, calibration=None, stream=None, state=None):
        FakeTrainer.built.append(name)
        self.cfg, self.name, self.done, self.total = cfg, name, False, cfg.planned_steps()
        self.step = type("S", (), {"steps": 0})()
        self.run = type("R", (), {"resumed_at": 0})()

    def advance(self, stop=None):
        self.step.steps = self.total

    def settle(self):
        self.done = True
        reached = self.cfg.size <= self.CAP
        self.run.exact_match = float(reached)
        self.run.history = [{"step": self.total, "loss": 1.0, "exact_match": float(reached)}]
        self.run.to_dict = lambda: {"name": self.name, "model": {"moe": {}},
                                    "train": {"size": self.cfg.size}, "lr": self.cfg.lr,
                                    "params_total": 1, "flops_inference": 1,
                                    "history": self.run.history, "steps": self.total,
                                    "reached": reached, "char_accuracy": self.cfg.lr,
                                    "exact_match": float(reached), "hnorm": [1.0]}
        return True


def test_the_executor_journals_runs_and_a_rerun_trains_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(pool, "PhonebookTrainer", FakeTrainer)
    FakeTrainer.built = []
    cfg = PhonebookTrainConfig(size=1, max_steps=5)

    def plans():
        return {"a": capacity(MODEL, [30, 100, 300], cfg, name="a", start=100),
                "b": capacity(MODEL, [30, 100, 300], cfg, name="b", start=100)}
    ex = Executor(["cpu"], 2, tmp_path, progress=False)
    res = ex.run(plans())
    assert res["a"].capacity == res["b"].capacity == 100
    # the two searches ask for the same runs: each is trained once, answered to both
    assert len(FakeTrainer.built) == 8            # 2 sizes x (3 calibrations + 1 run)
    lines = (tmp_path / pool.JOURNAL).read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(line)["key"] for line in lines)
    FakeTrainer.built = []
    again = Executor(["cpu"], 2, tmp_path, progress=False)
    assert again.run(plans())["a"].capacity == 100
    assert FakeTrainer.built == [] and len(again.report.reused) == 16


def test_a_stopped_search_resumes_from_its_checkpoints_exactly(tmp_path):
    cfg = PhonebookTrainConfig(size=64, batch_size=32, lr=3e-3, max_steps=2000,
                               eval_every=20, eval_entries=32, device="cpu")
    model = phonebook_model_config(MoEConfig.more(8, 2, 32, 8, 4), layers=1)
    whole = Executor(["cpu"], 1, None, progress=False).run(
        {"m": trial(model, cfg, "m")})["m"]
    stopped = Executor(["cpu"], 1, tmp_path, progress=False, checkpoint_minutes=0,
                       stop_after=0.3)
    assert stopped.run({"m": trial(model, cfg, "m")}) == {}
    assert stopped.stopped and stopped.report.stopped == ["m"]
    [at] = stopped.report.stopped_at        # where it stopped, with its last evaluation
    assert at["name"] == "m" and 0 < at["steps"] < at["total"]
    # the same code run twice in one process (as the losses below): an exact match is a
    # count of entries over the evaluated ones, the epoch steps x rows / size
    seen = {h["epoch"]: h["exact_match"] for h in whole["history"]}
    assert at["epoch"] == 0 or seen[at["epoch"]] == at["exact_match"]
    assert len(list((tmp_path / pool.CHECKPOINTS).glob("*.pt"))) == 1
    resumed = Executor(["cpu"], 1, tmp_path, progress=False)
    rec = resumed.run({"m": trial(model, cfg, "m")})["m"]
    assert resumed.report.resumed and rec["resumed_at"] > 0
    assert [h["loss"] for h in rec["history"]] == [h["loss"] for h in whole["history"]]
    assert not list((tmp_path / pool.CHECKPOINTS).glob("*.pt"))   # dropped once finished


def test_a_stop_request_on_the_cpu_ends_the_interval_at_once_and_resumes_exactly(tmp_path):
    """On the CPU, steps run as they are called: a stop request (a signal) ends the
    evaluation interval after the current step instead of at its end, the run is
    checkpointed there without an evaluation, and the resumed run evaluates, logs and
    stops at the same steps, with the same losses, as one never stopped."""
    cfg = PhonebookTrainConfig(size=64, batch_size=32, lr=3e-3, max_steps=60,
                               eval_every=20, eval_entries=32, device="cpu")
    model = phonebook_model_config(MoEConfig.more(8, 2, 32, 8, 4), layers=1)
    whole = Executor(["cpu"], 1, None, progress=False).run(
        {"m": trial(model, cfg, "m")})["m"]
    task = next(trial(model, cfg, "m"))[0]
    ckpt = tmp_path / pool.CHECKPOINTS
    ckpt.mkdir()
    device = pool.DevicePool("cpu", 1, ckpt)
    asked = iter(range(100))
    device.stop_requested = lambda: next(asked) >= 3   # poll asks once, then after each step:
                                                       # a request after step 3
    device.add(task)
    device.poll()                               # the first interval: cut after step 3
    (_, trainer, _), = device.active.values()
    assert trainer.step.steps == 3 and not trainer.run.history
    assert [e.kind for e in device.stop()] == ["stopped"]
    (tmp_path / pool.JOURNAL).touch()
    resumed = Executor(["cpu"], 1, tmp_path, progress=False)
    rec = resumed.run({"m": trial(model, cfg, "m")})["m"]
    assert resumed.report.resumed == [["m", 3]]
    assert [h["step"] for h in rec["history"]] == [h["step"] for h in whole["history"]]
    assert [h["loss"] for h in rec["history"]] == [h["loss"] for h in whole["history"]]


def test_a_run_stopped_before_its_first_interval_is_neither_evaluated_nor_saved(tmp_path):
    """A stop between add() and the poll that would queue the run's first interval: the
    run is reported stopped at step 0, with no evaluation of an untrained model in its
    history and no checkpoint."""
    cfg = PhonebookTrainConfig(size=64, batch_size=32, lr=3e-3, max_steps=60,
                               eval_every=20, eval_entries=32, device="cpu")
    model = phonebook_model_config(MoEConfig.more(8, 2, 32, 8, 4), layers=1)
    task = next(trial(model, cfg, "m"))[0]
    ckpt = tmp_path / pool.CHECKPOINTS
    ckpt.mkdir()
    device = pool.DevicePool("cpu", 1, ckpt)
    device.add(task)
    (_, trainer, _), = device.active.values()
    [event] = device.stop()
    assert (event.kind, event.steps) == ("stopped", 0) and not trainer.run.history
    assert not list(ckpt.glob("*.pt")) and not device.fresh


def test_worker_processes_give_the_records_of_one_process(tmp_path):
    cfg = PhonebookTrainConfig(size=32, batch_size=32, lr=3e-3, max_steps=20, eval_every=10,
                               eval_entries=32, device="cpu")
    models = [phonebook_model_config(MoEConfig.moe(4, 2, 32, 8), layers=1),
              phonebook_model_config(MoEConfig.more(8, 2, 32, 8, 4), layers=1)]

    def plans():
        return {m.moe.label: trial(m, cfg, m.moe.label) for m in models}
    one = Executor(["cpu"], 1, None, progress=False).run(plans())
    two = Executor(["cpu", "cpu"], 1, tmp_path, progress=False).run(plans())
    for name in one:                    # the same steps, data and seeds: the same losses,
        # to fp32 rounding (a worker's thread count, and with it the BLAS's summation order,
        # may differ from this process's)
        assert [h["step"] for h in two[name]["history"]] == \
            [h["step"] for h in one[name]["history"]]
        assert [h["loss"] for h in two[name]["history"]] == pytest.approx(
            [h["loss"] for h in one[name]["history"]], rel=1e-4)


def test_a_row_keeps_where_its_trials_ran_when_replayed_elsewhere():
    """A search finished by replaying its journal on a CPU (no training) keeps the GPU's tags
    that its trials recorded; only when no trial carries tags (older journals) does the row
    take the caller's."""
    from moremoe.phonebook.paper import capacity_row, searches
    [search] = searches(["rank"], ["moe"])
    cfg = PhonebookTrainConfig(size=1)
    gpu = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
           "commit": "abc", "date": "2026-11-29T02:00:00Z"}
    here = {**gpu, "device": "cpu", "torch": "2.13.0+cpu", "date": "2026-11-29T03:00:00Z"}

    def rec(size, env):
        return {"train": {"size": size}, "lr": 1e-3, "calibration": {}, "reached": size < 2,
                "exact_match": 0.9, "char_accuracy": 0.99, "steps": 5, "seconds": 1.0,
                "diverged_at": 0, "resumed_at": 0, "history": [], "hnorm": [],
                "step_mode": "graph", "env": env}
    older = {**gpu, "date": "2026-11-28T00:00:00Z", "commit": "old"}
    row = capacity_row(search, {"capacity": 1, "trials": [rec(1, older), rec(2, gpu)]},
                       [1, 2], cfg, here)
    assert (row["device"], row["torch"], row["commit"]) == ("NVIDIA H200", "2.11.0+cu130", "abc")
    assert [t["commit"] for t in row["trials"]] == ["old", "abc"]
    # an untagged trial (an older journal) beside a tagged one: the tagged one says where
    row = capacity_row(search, {"capacity": 1, "trials": [rec(1, {}), rec(2, gpu)]},
                       [1, 2], cfg, here)
    assert row["device"] == "NVIDIA H200" and "device" not in row["trials"][0]
    row = capacity_row(search, {"capacity": 1, "trials": [rec(1, {}), rec(2, {})]},
                       [1, 2], cfg, here)
    assert row["device"] == "cpu"


@pytest.mark.parametrize("error", [EOFError("Ran out of input"),
                                   RuntimeError("PytorchStreamReader failed reading file"),
                                   pickle.UnpicklingError("invalid load key, 'x'.")])
def test_a_trial_checkpoint_that_cannot_be_read_is_one_error_naming_it(tmp_path, monkeypatch,
                                                                       error):
    """Whole on the outside (its zip directory is there), bad within: whatever torch.load
    raises becomes one ValueError naming the file and what to do."""
    import torch
    from moremoe.phonebook.journal import load_checkpoint
    path = tmp_path / "0123.pt"
    state = {"step": {"model": {}, "optimizer": {}, "order": {}, "buffers": [], "steps": 3},
             "run": {"name": "m", "model": {"moe": {}}, "train": {}, "lr": 1e-3,
                     "history": [], "steps": 3}}
    torch.save(state, path)
    assert load_checkpoint(path) == state

    def load(*args, **kwargs):
        raise error
    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(ValueError, match=rf"trial checkpoint \S+0123.pt cannot be read "
                                         rf"\({type(error).__name__}: .+\); delete it to run "
                                         rf"that trial again from its start"):
        load_checkpoint(path)
