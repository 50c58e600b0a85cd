"""`moremoe phonebook reproduce` and the execution options the phonebook commands share, with
a stand-in trainer (the training itself: tests/phonebook/test_trainer.py and test_step.py)."""
import io
import json
import os
import re
import signal
from dataclasses import asdict

import pytest

from cli_checks import fails
from moremoe.cli import main

import moremoe.phonebook.trainer as trainer
import moremoe.phonebook.pool as pool


class Instant:
    """A run that ends at its first evaluation: reached when the phonebook is at most the
    paper's capacity of its model (h64-s8: MoE-32 10K, MoRE-96 30K)."""
    CAP = {32: 10_000, 96: 30_000}
    built = []

    def __init__(self, model_cfg, cfg, lr, *, name, calibration=None, **kw):
        Instant.built.append(name)
        self.cfg, self.done, self.total = cfg, False, cfg.planned_steps()
        self.step = type("S", (), {"steps": 0})()
        reached = cfg.size <= self.CAP.get(model_cfg.moe.experts, 0)
        em = 0.95 if reached else 0.2
        self.run = trainer.PhonebookRun(
            name=name, model=model_cfg.to_dict(), train=asdict(cfg), lr=lr,
            params_total=model_cfg.total_params(), flops_inference=1, flops_training=3,
            calibration={str(k): v for k, v in (calibration or {}).items()},
            exact_match=em, char_accuracy=lr, reached=reached, hnorm=[0.9] * 6,
            history=[{"step": 1, "epoch": 1.0, "loss": 1.0 - lr, "exact_match": em,
                      "hnorm": [0.9] * 6}], step_mode="eager")

    def advance(self, stop=None):
        self.step.steps = self.total

    def settle(self):
        self.done = True
        return True


@pytest.fixture
def instant(monkeypatch):
    monkeypatch.setattr(pool, "PhonebookTrainer", Instant)
    Instant.built = []


def test_reproduce_finds_the_papers_capacities_and_writes_rows_and_figures(
        capsys, tmp_path, instant):
    out, rows = tmp_path / "r", tmp_path / "rows.jsonl"
    argv = ["phonebook", "reproduce", "--points", "h64-s8", "--out", str(out), "--device",
            "cpu", "--no-progress", "--rows", str(rows)]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = {s["name"]: s["capacity"] for s in report["searches"]}
    assert got == {"h64-s8 MoE-32": 10_000, "h64-s8 MoRE-96": 30_000}
    # each search: the paper's size and the next at once, with their calibrations: 2 x 4 runs
    assert len(Instant.built) == 16
    written = [json.loads(line) for line in (out / "phonebook_capacity.jsonl").open()]
    assert [(r["name"], r["capacity"], r["paper_capacity"]) for r in written] == [
        ("h64-s8 MoE-32", 10_000, 10_000), ("h64-s8 MoRE-96", 30_000, 30_000)]
    assert {t["size"] for t in written[0]["trials"]} == {10_000, 30_000}
    assert written[0]["device"] == "cpu" and written[0]["commit"]
    assert (out / "reproduce.png").stat().st_size > 0
    assert len(rows.read_text().splitlines()) == 2
    # again with --resume: every run comes from the journal, the rows file gains nothing
    Instant.built = []
    assert main([*argv, "--resume"]) == 0
    text = capsys.readouterr().out
    assert Instant.built == [] and "h64-s8 MoRE-96" in text and "30,000" in text
    assert len(rows.read_text().splitlines()) == 2
    assert len(json.loads((out / "reproduce.json").read_text())["execution"]["reused"]) == 16


class Endless(Instant):
    """Instant below the capacity and in calibration; above it, a run that never ends and
    stops the command as a SIGTERM would (once it has started)."""

    def advance(self, stop=None):
        if not self.ends():
            os.kill(os.getpid(), signal.SIGTERM)

    def ends(self):
        return self.run.reached or self.run.train["threshold"] == float("inf")

    def settle(self):
        self.done = self.ends()
        return self.done

    def state_dict(self):        # a trial state as the journal's reader checks it
        return {"step": {"model": {}, "optimizer": {}, "order": {}, "buffers": [],
                         "steps": self.step.steps}, "run": self.run.to_dict()}


def test_a_stopped_search_reports_what_it_measured(capsys, tmp_path, monkeypatch):
    """Stopped while the next size up still trains: the report keeps the size that was
    reached in that round (a lower bound, marked unfinished), the table says >=."""
    monkeypatch.setattr(pool, "PhonebookTrainer", Endless)
    rows = tmp_path / "rows.jsonl"
    argv = ["phonebook", "reproduce", "--points", "h64-s8", "--arch", "more", "--out",
            str(tmp_path / "r"), "--device", "cpu", "--no-progress", "--rows", str(rows)]
    assert main([*argv, "--json"]) == 75
    report = json.loads(capsys.readouterr().out)
    [search] = report["searches"]
    assert search["unfinished"] and search["capacity"] == 30_000
    assert [(t["train"]["size"], t["reached"]) for t in search["trials"]] == [(30_000, True)]
    [row] = [json.loads(line) for line in rows.open()]      # a row, marked a lower bound
    assert row["unfinished"] and row["capacity"] == 30_000 and report["rows_appended"] == 1
    assert main([*argv, "--resume"]) == 75
    assert ">= 30,000" in capsys.readouterr().out
    assert len(rows.read_text().splitlines()) == 1          # the same point: not again
    monkeypatch.setattr(pool, "PhonebookTrainer", Instant)  # the next session finishes it
    assert main([*argv, "--resume"]) == 0
    last = [json.loads(line) for line in rows.open()]
    assert [(r["capacity"], r["unfinished"]) for r in last] == [(30_000, True), (30_000, False)]
    from moremoe.cli.demo import capacity_table
    assert ">= 30,000" in capacity_table(last[:1]) and ">=" not in capacity_table(last[1:])


def test_rank_searches_chosen_and_the_start_alone_first(capsys, tmp_path, instant):
    """--ranks picks the rank figure's searches; --ahead 0 trains the start (100K) alone: a
    192-expert model fails it here, so no larger size is ever trained."""
    out = tmp_path / "r"
    assert main(["phonebook", "reproduce", "--points", "rank", "--ranks", "moe,4", "--ahead",
                 "0", "--out", str(out), "--device", "cpu", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in report["searches"]] == ["rank MoE-192", "rank r=4 MoRE-192"]
    sizes = {t["train"]["size"] for s in report["searches"] for t in s["trials"]}
    assert 100_000 in sizes and max(sizes) == 100_000 and 30_000 in sizes
    assert (out / "rank.png").stat().st_size > 0
    from moremoe.cli.phonebook_paper import _failed_starts
    from moremoe.phonebook.paper import searches, seeded
    below = _failed_starts(seeded(searches(["rank"], ["moe", 4]),
                                  trainer.PhonebookTrainConfig(size=100_000), [0]), report)
    r4 = report["searches"][1]
    if r4["capacity"] is None:          # nothing memorised: the figure draws it below 100K
        assert [(b["rank"], b["size"]) for b in below] == [(4, 100_000)]
        assert 0 <= below[0]["exact_match"] < 0.9 and below[0]["epoch"] >= 0
    else:
        assert below == []


def test_several_seeds_run_at_once_and_their_rows_name_the_search_and_seed(
        capsys, tmp_path, instant):
    """--seed 1,2: every search on each seed in one run (the runs named by seed), the rows
    named by the search alone with their seed, which the demo's table counts; a resume
    reuses every run; a repeated seed is refused."""
    out, rows = tmp_path / "r", tmp_path / "rows.jsonl"
    argv = ["phonebook", "reproduce", "--points", "h64-s8", "--seed", "1,2", "--out", str(out),
            "--device", "cpu", "--no-progress", "--rows", str(rows)]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["seed"], s["capacity"]) for s in report["searches"]] == [
        ("h64-s8 MoE-32 (seed 1)", 1, 10_000), ("h64-s8 MoRE-96 (seed 1)", 1, 30_000),
        ("h64-s8 MoE-32 (seed 2)", 2, 10_000), ("h64-s8 MoRE-96 (seed 2)", 2, 30_000)]
    assert len(Instant.built) == 32 and report["seeds"] == [1, 2]
    written = [json.loads(line) for line in rows.open()]
    assert [(r["name"], r["seed"]) for r in written] == [
        ("h64-s8 MoE-32", 1), ("h64-s8 MoRE-96", 1), ("h64-s8 MoE-32", 2),
        ("h64-s8 MoRE-96", 2)]
    assert len({r["search"] for r in written}) == 4       # each seed its own search
    from moremoe.cli.demo import capacity_table
    assert "10,000 (2 of 2 seeds)" in capacity_table(written)
    assert (out / "reproduce.png").stat().st_size > 0
    Instant.built = []
    assert main([*argv, "--resume"]) == 0 and Instant.built == []
    capsys.readouterr()
    fails(capsys, [*argv[:5], "1,1", *argv[6:]], r"--seed.*lists 1 twice")
    fails(capsys, [*argv[:5], "1,x", *argv[6:]], r"--seed.*comma-separated seeds")


def test_the_figures_draw_every_seed_and_the_median(tmp_path):
    from moremoe.phonebook.paper_plots import _middle, _seeds, plot_rank_figure, \
        plot_reproduction
    rows = [{"point": "h64-s8", "arch": "more", "rank": 16, "seed": seed, "capacity": cap,
             "unfinished": False, "history_at_capacity": []}
            for seed, cap in ((0, 30_000), (1, 100_000), (2, 30_000))]
    rows.append({**rows[1], "capacity": 10_000, "unfinished": True})   # an older lower bound
    assert len(_seeds(rows)) == 3 and _middle(_seeds(rows))["capacity"] == 30_000
    assert plot_reproduction(rows, tmp_path / "r.png").stat().st_size > 0
    rank = [{**r, "point": "rank", "experts": 192, "rank": k} for k in (8, 16) for r in rows]
    moe = [{**r, "point": "rank", "arch": "moe", "rank": None} for r in rows]
    below = [{"rank": 4, "size": 100_000, "exact_match": em, "epoch": 1500.0, "seed": seed}
             for seed, em in ((0, 0.35), (1, 0.4))]
    assert plot_rank_figure(rank + moe, tmp_path / "k.png", below).stat().st_size > 0


def test_the_rank_figure_takes_the_h128_dot_for_r16_and_draws_lower_bounds(tmp_path):
    from moremoe.phonebook.paper_plots import plot_rank_figure
    row = {"point": "h128-s8", "arch": "more", "experts": 192, "rank": 16, "capacity": 100_000,
           "unfinished": True, "history_at_capacity": []}
    moe = {**row, "point": "rank", "arch": "moe", "rank": None, "unfinished": False,
           "history_at_capacity": [{"step": 1, "hnorm": [0.9, 0.8]}]}
    assert plot_rank_figure([row, moe], tmp_path / "rank.png").stat().st_size > 0
    below = [{"rank": 4, "size": 100_000, "exact_match": 0.353, "epoch": 1368.1,
              "stopped": True}, {"rank": 16, "size": 100_000, "exact_match": 0.1, "epoch": 3}]
    assert plot_rank_figure([row, moe], tmp_path / "b.png", below).stat().st_size > 0


def test_reproduce_force_keeps_the_earlier_work_when_the_first_trial_cannot_fit(
        capsys, tmp_path, instant, monkeypatch):
    """Whether a search's first trials fit is checked before --force clears the earlier
    journal and report: a refusal after the clearing would lose them for nothing."""
    argv = ["phonebook", "reproduce", "--points", "h64-s8", "--arch", "more", "--out",
            str(tmp_path), "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    before = tree(tmp_path)
    assert before["trials.jsonl"] and before["reproduce.json"]
    monkeypatch.setattr(trainer, "training_memory", lambda model, cfg: 1 << 60)
    fails(capsys, [*argv, "--force"], r"MoRE\(M=96, .* needs at least .* of memory and "
                                      r"this machine has .*; give a smaller model")
    assert tree(tmp_path) == before


def test_reproduce_one_arm(capsys, tmp_path, instant):
    assert main(["phonebook", "reproduce", "--points", "h64-s8", "--arch", "more", "--out",
                 str(tmp_path), "--device", "cpu", "--no-progress", "--json"]) == 0
    names = [s["name"] for s in json.loads(capsys.readouterr().out)["searches"]]
    assert names == ["h64-s8 MoRE-96"]


@pytest.mark.parametrize("argv, message", [
    (["--points", "h64-s9"], r"argument --points: expected points among h64-s8, .*rank, got "
                             r"'h64-s9'"),
    (["--points", "rank", "--resume", "--out", "{tmp}/none"],
     r"--resume: \S+/none holds no trials.jsonl, so there is nothing to continue; drop "
     r"--resume to start"),
    (["--resume"], "--resume continues the work in --out: give --out"),
    (["--rows", "{tmp}/notes.md"], r"--rows \S+/notes.md, line 1: not JSON .*: not a phonebook "
                                   r"capacity rows file; give another file"),
    (["--rows", "{tmp}/ep.jsonl"], r"--rows \S+/ep.jsonl: 1 of its 1 rows \(the first: row 1\) "
                                   r"are not rows of `phonebook reproduce`; give another file"),
    (["--points", "h64-s8", "--ranks", "4"], r"--ranks chooses among the rank point's "
                                             r"searches: add rank to --points, or drop --ranks"),
    (["--points", "rank", "--ranks", "4,12"], r"argument --ranks: expected ranks among moe, 4, "
                                              r"8, 16, 32, got '4,12'"),
    (["--points", "rank,h64-s8,rank"], r"argument --points: 'rank,h64-s8,rank' lists rank "
                                       r"twice; give each value once"),
    (["--points", "rank", "--ranks", "8,moe,MoE"], r"argument --ranks: '8,moe,MoE' lists moe "
                                                   r"twice; give each value once"),
    (["--jobs", "2", "--device", "cpu"], r"--jobs 2 spreads the runs over GPUs, but --device "
                                         r"cpu names one device; use --device auto or cuda"),
])
def test_reproduce_refuses_in_one_line(capsys, tmp_path, argv, message):
    (tmp_path / "notes.md").write_text("# my notes\n")
    (tmp_path / "ep.jsonl").write_text('{"bench": "ep", "ms": 1.0}\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    fails(capsys, ["phonebook", "reproduce", *argv], message)


def test_an_earlier_search_is_kept_without_force_or_resume(capsys, tmp_path, instant):
    argv = ["phonebook", "reproduce", "--points", "h64-s8", "--out", str(tmp_path),
            "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    fails(capsys, argv, r"already holds reproduce.json, reproduce.png, "
                        r"phonebook_capacity.jsonl, trials.jsonl from an earlier run; give "
                        r"another folder or --force")
    Instant.built = []
    assert main([*argv, "--force"]) == 0               # starts afresh: trains again
    assert len(Instant.built) == 16


# the tiny settings of a real run (S), and a snapshot of a folder to compare
S = ["--hidden", "32", "--top-k", "2", "--rank", "4", "--layers", "1", "--max-steps", "2",
     "--batch-size", "8", "--eval-entries", "10", "--device", "cpu", "--no-progress",
     "--lr", "1e-3"]


def tree(path) -> dict:
    """Every file and folder under path with its bytes: what a refused command leaves as
    it was."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("refused, message", [
    (["--step", "graph"], r"--step graph captures a CUDA graph: it needs a GPU, the run is on "
                          r"cpu; use eager or auto"),
    (["--jobs", "2"], r"--jobs 2 spreads the runs over GPUs, but --device cpu names one "
                      r"device"),
])
def test_a_refused_command_leaves_out_as_it_was(capsys, tmp_path, monkeypatch, refused,
                                                message):
    """--force clears an earlier run's journal and checkpoints only once every check has
    passed; in a new folder a refused command leaves nothing, so the corrected command is
    not refused for what it left."""
    monkeypatch.setattr(pool, "PhonebookTrainer", Instant)
    out, new = tmp_path / "o", tmp_path / "new"
    argv = ["phonebook", "train", "--size", "10", *S]
    assert main([*argv, "--out", str(out)]) == 0
    before = tree(out)
    assert before["trials.jsonl"]
    monkeypatch.undo()                  # the real trainer, which meets the step mode too
    fails(capsys, [*argv, "--out", str(out), "--force", *refused], message)
    assert tree(out) == before
    fails(capsys, [*argv, "--out", str(new), *refused], message)
    assert not new.exists()
    monkeypatch.setattr(pool, "PhonebookTrainer", Instant)
    assert main([*argv, "--out", str(new)]) == 0


def test_an_empty_journal_is_no_earlier_run(tmp_path, instant):
    """What a refused command of an older version left: an empty journal and checkpoints
    folder, no work to keep."""
    out = tmp_path / "o"
    (out / "trial_checkpoints").mkdir(parents=True)
    (out / "trials.jsonl").touch()
    assert main(["phonebook", "train", "--size", "10", *S, "--out", str(out)]) == 0
    assert len((out / "trials.jsonl").read_text().splitlines()) == 2


def test_resume_takes_the_settings_of_the_report_and_no_others(capsys, tmp_path, instant):
    """--resume with another experiment's settings would train it from scratch and replace
    the report: refused, naming the first flag that differs. How it runs may change; a
    report of an older version, which records no settings, is taken as it is."""
    out = tmp_path / "o"
    argv = ["phonebook", "train", *S, "--out", str(out)]
    assert main([*argv, "--size", "10"]) == 0
    before = tree(out)
    report = out / "phonebook_train.json"
    fails(capsys, [*argv, "--size", "12", "--resume"],
          rf"--resume: {re.escape(str(report))} records --size 10, this command gives --size "
          rf"12; give the same settings, or another --out")
    fails(capsys, [*argv, "--size", "10", "--resume", "--refit"],
          r"records no --refit, this command gives --refit; give the same settings")
    assert tree(out) == before
    Instant.built = []
    assert main([*argv, "--size", "10", "--resume", "--concurrent", "2",
                 "--checkpoint-minutes", "1", "--step", "eager"]) == 0
    assert Instant.built == []                      # every run from the journal
    older = json.loads(report.read_text())
    del older["settings"]
    report.write_text(json.dumps(older))
    assert main([*argv, "--size", "12", "--resume"]) == 0


def test_resume_refuses_the_folder_of_another_command(capsys, tmp_path, instant):
    out = tmp_path / "o"
    assert main(["phonebook", "train", "--size", "10", *S, "--out", str(out)]) == 0
    before = tree(out)
    fails(capsys, ["phonebook", "reproduce", "--points", "h64-s8", "--out", str(out),
                   "--device", "cpu", "--no-progress", "--resume"],
          r"--resume: \S+ holds phonebook_train.json, the work of `moremoe phonebook train`; "
          r"continue it with that command, or give another --out")
    assert tree(out) == before


@pytest.mark.parametrize("points, mine", [
    (["--points", "h64-s8"], "phonebook_capacity.jsonl"),
    (["--points", "rank", "--ranks", "moe", "--grid", "100000"], "rank.png"),
])
def test_reproduce_keeps_what_the_user_has_in_out(capsys, tmp_path, instant, points, mine):
    """Every file reproduce writes in --out is kept without --force or --resume, not only
    its report."""
    (tmp_path / mine).write_text("mine\n")
    fails(capsys, ["phonebook", "reproduce", *points, "--out", str(tmp_path), "--device",
                   "cpu", "--no-progress"],
          rf"already holds {re.escape(mine)} from an earlier run; give another folder or "
          rf"--force to replace it")
    assert [p.name for p in tmp_path.iterdir()] == [mine]
    assert (tmp_path / mine).read_text() == "mine\n"


def test_rows_naming_the_rows_file_in_out_is_appended_to(capsys, tmp_path, instant):
    """--rows OUT/phonebook_capacity.jsonl makes that file the user's rows file: it gains
    this run's rows, as --rows does, and keeps those it had."""
    rows = tmp_path / "phonebook_capacity.jsonl"
    theirs = {"search": "0123", "capacity": 10_000, "device": "NVIDIA H200"}
    rows.write_text(json.dumps(theirs) + "\n")
    assert main(["phonebook", "reproduce", "--points", "h64-s8", "--out", str(tmp_path),
                 "--rows", str(rows), "--device", "cpu", "--no-progress"]) == 0
    got = [json.loads(line) for line in rows.open()]
    assert got[0] == theirs and [r["name"] for r in got[1:]] == ["h64-s8 MoE-32",
                                                                 "h64-s8 MoRE-96"]


def test_a_journal_line_cut_by_a_kill_is_dropped_and_a_bad_line_refused(capsys, tmp_path,
                                                                         instant):
    """The last line cut short (a kill while it was written): a one-line warning, its run
    trains again and the journal is whole again. A bad line anywhere else: refused, naming
    the file and the line."""
    out = tmp_path / "o"
    argv = ["phonebook", "train", "--size", "10", *S, "--out", str(out)]
    assert main(argv) == 0
    journal = out / "trials.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert len(lines) == 2
    journal.write_text(lines[0] + lines[1][:60])
    Instant.built = []
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and re.match(
        rf"warning: {re.escape(str(journal))}, line 2 is cut short \(the command was stopped "
        rf"while writing it\): it is dropped and its run trains again", warned[0])
    assert len(Instant.built) == 1
    assert [json.loads(line)["key"] for line in journal.open()] == \
        [json.loads(line)["key"] for line in lines]
    for bad, what in [(lines[1][:60] + "\n", r"not JSON \(Invalid control character at column \d+\)"),
                      ('{"rows": 1}\n', r'not a journal record \(an object with "key" and '
                                        r'"record"\)')]:
        journal.write_text(lines[0] + bad + lines[1])
        fails(capsys, [*argv, "--resume"],
              rf"{re.escape(str(journal))}, line 2: {what}; restore the journal from a copy, "
              rf"or delete that line \(its run trains again\)")


@pytest.mark.parametrize("damage, what", [
    (lambda data: b"", r"is empty \(0 bytes\)"),
    (lambda data: data[:len(data) // 2], r"is truncated or not a torch.save file \(\d+ bytes\)"),
])
def test_a_damaged_trial_checkpoint_is_named(capsys, tmp_path, instant, damage, what):
    import torch
    out = tmp_path / "o"
    argv = ["phonebook", "train", "--size", "10", *S, "--out", str(out)]
    assert main(argv) == 0
    journal = out / "trials.jsonl"
    key = json.loads(journal.read_text().splitlines()[0])["key"]
    journal.write_text("")              # its run stopped, not finished: the checkpoint has it
    buf = io.BytesIO()
    torch.save({"step": {}, "run": {}}, buf)
    ckpt = out / "trial_checkpoints" / f"{key}.pt"
    ckpt.write_bytes(damage(buf.getvalue()))
    fails(capsys, [*argv, "--resume"],
          rf"trial checkpoint {re.escape(str(ckpt))} {what}; delete it to run that trial "
          rf"again from its start")


def test_stop_after_ends_a_cpu_interval_within_it(capsys, tmp_path):
    """--stop-after is honoured within an evaluation interval on the CPU, as a signal is: a
    run of 3,000 steps evaluated once stops long before its end."""
    out = tmp_path / "o"
    rc = main(["phonebook", "train", "--size", "10", *S, "--arch", "more", "--max-steps",
               "3000", "--eval-every", "3000", "--stop-after", "0.01", "--out", str(out),
               "--json"])
    assert rc == 75
    stopped = json.loads(capsys.readouterr().out)["execution"]["stopped_at"]
    assert all(0 < at["steps"] < at["total"] == 3000 for at in stopped)


def test_a_journal_of_an_earlier_version_still_resumes(capsys, tmp_path, monkeypatch):
    """The h64-s16 MoRE search measured on an H200 at 83a675d (its journal and report as
    committed) continues on this tree: every trial is answered from the journal, none is
    trained, and the capacity is the one measured then."""
    from pathlib import Path
    import shutil
    import moremoe.phonebook.pool as pool
    import moremoe.phonebook.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a trial was trained: the journal was not read")
    for module in (trainer, pool):
        monkeypatch.setattr(module, "PhonebookTrainer", refuse)
    done = Path(__file__).resolve().parents[2] / "benchmarks/results/nvidia-h200/" \
        "phonebook_reproduce"
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(done / "trials_83a675d_h64-s16-more.jsonl", out / "trials.jsonl")
    shutil.copy(done / "reproduce_83a675d_h64-s16-more.json", out / "reproduce.json")
    assert main(["phonebook", "reproduce", "--points", "h64-s16", "--arch", "more", "--out",
                 str(out), "--resume", "--device", "cpu", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    [search] = report["searches"]
    assert search["name"] == "h64-s16 MoRE-224" and search["capacity"] == 100_000
    assert not search.get("unfinished") and report["execution"]["reused"]


def test_the_capacity_table_says_on_how_many_seeds_each_capacity_rests():
    from moremoe.cli.demo import capacity_table

    def row(seed, capacity, unfinished=False):
        return {"name": "h64-s8 MoE-32", "paper_capacity": 10_000, "capacity": capacity,
                "seed": seed, "unfinished": unfinished, "device": "NVIDIA H200",
                "commit": "abcdef123456", "date": "2026-12-04"}
    text = capacity_table([row(0, 10_000), row(1, 10_000), row(2, 30_000)])
    line = next(ln for ln in text.splitlines() if ln.startswith("h64-s8 MoE-32"))
    assert "10,000 (2 of 3 seeds); 30,000 (1 of 3 seeds)" in line and "2 of 3" in line
    one = capacity_table([row(0, 10_000, unfinished=True)])
    assert ">= 10,000 (1 of 1 seed)" in one and " 0 of 1 " in one


def test_the_capacity_table_names_every_commit_alike():
    from moremoe.cli.demo import capacity_table
    row = {"name": "h64-s8 MoE-32", "paper_capacity": 10_000, "capacity": 10_000,
           "device": "NVIDIA H200", "date": "2026-11-27T10:00:00Z"}
    text = capacity_table([{**row, "commit": "5ea6713"},
                           {**row, "name": "h64-s16 MoRE-224", "commit": "83a675d1c2e4"}])
    assert "NVIDIA H200, 5ea6713, 2026-11-27" in text
    assert "NVIDIA H200, 83a675d, 2026-11-27" in text and "83a675d1" not in text
