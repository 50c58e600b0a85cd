"""The study's process pool on a shared GPU: a run that ran out of memory beside other runs
of its GPU is started again, from its checkpoint, once the GPU has room, and the GPU takes
one run fewer from then on; alone on its GPU, or failing otherwise, a run fails. (Fake
processes: the pool's bookkeeping, not a GPU.)"""
from types import SimpleNamespace

from moremoe.study.runner import _Pool

OOM = ("moremoe train: error: GPU 0 ran out of memory (6.13 GiB more asked for, 1.82 GiB "
       "free of 79.18 GiB): MoRE-1920 ... does not fit\n")


class Proc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def pool(tmp_path, *runs, cap=3):
    """A pool over GPU "0" holding runs (name, exit code or None while running, log text)."""
    said = []
    study = SimpleNamespace(out=tmp_path, echo=said.append, collect=lambda run, lr: None,
                            rows={}, runs=[])
    p = _Pool.__new__(_Pool)
    p.study, p.slots, p.cap, p.log_at = study, ["0"], {"0": cap}, {}
    p.stopping, p.failed, p.finished, p.stopped, p.active = None, [], [], [], {}
    (tmp_path / "logs").mkdir(parents=True)
    for name, code, text in runs:
        log = tmp_path / "logs" / f"{name}.log"
        log.write_text("an earlier start's output\n")
        p.log_at[name] = log.stat().st_size
        log.write_text(log.read_text() + text)
        p.active[name] = (SimpleNamespace(name=name), Proc(code), "0", 1e-3)
    return p, said


def test_out_of_memory_beside_other_runs_waits_for_room_on_a_smaller_share(tmp_path):
    p, said = pool(tmp_path, ("more", 2, "step 150/916 ...\n" + OOM), ("moe-a", None, ""),
                   ("moe-b", None, ""))
    p._reap()
    assert p.failed == [] and "more" not in p.active and p.cap == {"0": 2}
    assert said[-1].startswith("OOM   more ran out of memory beside 2 other run(s) on GPU 0")
    assert p._free_slot() is None                       # two run, two fit now
    del p.active["moe-a"]                               # one of them ends
    assert p._free_slot() == "0"


def test_out_of_memory_alone_or_another_error_is_a_failure(tmp_path):
    p, said = pool(tmp_path, ("alone", 2, OOM))
    p._reap()
    assert p.failed == ["alone"] and p.cap == {"0": 3} and said[-1].startswith("FAIL  alone")
    q, said = pool(tmp_path / "b", ("bad", 2, "moremoe train: error: data: no such file\n"),
                   ("other", None, ""))
    q._reap()
    assert q.failed == ["bad"] and q.cap == {"0": 3}


def test_an_earlier_starts_out_of_memory_is_not_this_ones(tmp_path):
    """The log keeps every start of a run: only the part this start wrote counts."""
    p, _ = pool(tmp_path, ("run", 2, "killed\n"), ("other", None, ""))
    log = tmp_path / "logs" / "run.log"
    log.write_text(OOM + "resumed\n")
    p.log_at["run"] = len(OOM)
    p._reap()
    assert p.failed == ["run"]


def test_past_start_minutes_only_runs_with_a_checkpoint_start(tmp_path):
    """--start-minutes: a run with no checkpoint here is not begun late (the machine's disk
    may go before it could finish); one with a checkpoint still resumes; before the limit
    both start."""
    import time
    from moremoe.study.runner import Launch
    for elapsed, want in ((120.0, ["old"]), (10.0, ["new", "old"])):
        p, _ = pool(tmp_path / str(elapsed))
        runs = [SimpleNamespace(name="new"), SimpleNamespace(name="old")]
        (tmp_path / str(elapsed) / "runs" / "old").mkdir(parents=True)
        (tmp_path / str(elapsed) / "runs" / "old" / "log.jsonl").write_text("{}\n")
        p.study.runs, p.study.lr_of = runs, lambda run: 1e-3
        p.launch, p.t0 = Launch(start_minutes=1.0), time.monotonic() - elapsed
        started = []
        p._start = lambda run, lr, slot: (started.append(run.name),
                                          p.active.__setitem__(run.name, (run, Proc(), slot,
                                                                          lr)))
        p._start_ready()
        assert sorted(started) == want
