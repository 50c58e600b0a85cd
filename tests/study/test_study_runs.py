"""`moremoe study lm` on the CPU: the learning-rate selection, the runs, their rows, the
report; continuing a study (again, on another machine from its rows, after SIGTERM, after a
kill -9 mid-run, exactly as the uninterrupted study); refusing other data or other runs."""
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from cli_checks import fails
from moremoe.cli import main
from procs import finish, kill_group, launched

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--top-k", "2", "--width", "8",
        "--rank", "4", "--seq-len", "64", "--batch", "4", "--device", "cpu", "--parallel", "2",
        "--no-progress"]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def study(capsys, data, out, *extra):
    """(exit status, the --json result); exit 2 (an error, a failed run) fails the test
    with the command's error and its runs' last log lines: no test here expects one."""
    capsys.readouterr()
    code = main(["study", "lm", "--data", str(data), "--out", str(out), *TINY, *extra, "--json"])
    got = capsys.readouterr()
    if code == 2:
        logs = sorted((Path(out) / "logs").glob("*.log")) if (Path(out) / "logs").is_dir() else []
        tails = "".join(f"\n--- {p.name}: ...{p.read_text()[-1500:]}" for p in logs)
        raise AssertionError(f"study lm exited 2\nstdout: {got.out[-3000:]}\n"
                             f"stderr: {got.err[-3000:]}{tails}")
    return code, json.loads(got.out)


def rows(out):
    return [json.loads(ln) for ln in (Path(out) / "rows.jsonl").read_text().splitlines()]


SELECT = ["--budgets", "1024,2048", "--seeds", "0,1", "--lrs", "1e-3,3e-3", "--lr-tokens",
          "1024", "--eval-tokens", "512"]


def test_a_study_selects_rates_trains_and_reports(text_data, tmp_path, capsys):
    out = tmp_path / "study"
    code, r = study(capsys, text_data, out, *SELECT)
    assert code == 0 and r["result"]["failed"] == [] and r["result"]["left"] == []
    got = {row["run"]: row for row in rows(out)}
    assert len(got) == 4 + 8                     # 2 configurations x 2 rates, 2 x 2 x 2 runs
    chosen = r["report"]["lr"]
    for config, sel in chosen.items():
        cands = {c["lr"]: c["val_loss"] for c in sel["candidates"]}
        assert sel["chosen"] == min(cands, key=cands.get)
        assert all(row["lr"] == sel["chosen"] for row in got.values()
                   if row["kind"] == "main" and row["config"] == config)
    main_rows = [row for row in got.values() if row["kind"] == "main"]
    for row in main_rows:       # validation at the fixed marks (every 2 steps) and the end
        assert [e["tokens"] for e in row["evals"]] == list(range(512, row["budget"] + 1, 512))
        assert row["evals"][-1]["val_loss"] == row["val_loss"]
        assert row["tokens_per_param"] == row["tokens"] / row["params"]
        assert row["data"]["fingerprint"] == r["report"]["data"]["fingerprint"]
        assert row["device"] == "cpu" and row["commit"] and len(row["hnorm"]) == 1
        assert row["val_sequences"] == 64            # all of the data's, at seq_len 64
    pair = r["report"]["experiments"]["pair"]
    assert [b["tokens"] for b in pair["budgets"]] == [1024, 2048]
    assert all(b["gap"]["n"] == 2 and b["verdict"].endswith("noise") for b in pair["budgets"])
    assert (out / "pair.png").stat().st_size > 0 and (out / "report.json").is_file()
    # again: nothing to train; on a new machine from study.json and rows.jsonl alone, too
    logs = sorted((out / "logs").iterdir())
    code, again = study(capsys, text_data, out, *SELECT)
    assert code == 0 and again["result"]["finished"] == [] and sorted(
        (out / "logs").iterdir()) == logs
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in ("study.json", "rows.jsonl"):
        shutil.copy(out / name, moved / name)
    code, there = study(capsys, text_data, moved, *SELECT)
    assert code == 0 and not (moved / "runs").exists()
    assert there["report"]["experiments"] == again["report"]["experiments"]
    assert main(["study", "report", str(moved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == {"done": 12, "total": 12}


def test_a_study_refuses_other_data_and_other_runs(text_data, tmp_path, capsys):
    out = tmp_path / "study"
    code, _ = study(capsys, text_data, out, "--budgets", "512", "--seeds", "0", "--lr", "3e-3")
    assert code == 0
    fails(capsys, ["study", "lm", "--data", str(text_data), "--out", str(out), *TINY,
                   "--budgets", "512", "--seeds", "0", "--lr", "1e-2"],
          r"holds a study whose runs differ: lr: 0.003 -> 0.01")
    other = tmp_path / "other"
    shutil.copytree(text_data, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["sha256"] = {"train.bin": "e" * 64, "val.bin": "f" * 64}
    (other / "meta.json").write_text(json.dumps(meta))
    fails(capsys, ["study", "lm", "--data", str(other), "--out", str(out), *TINY,
                   "--budgets", "512", "--seeds", "0", "--lr", "3e-3"],
          r"trained on data of fingerprint [0-9a-f]{16} .*give the study's data")
    fails(capsys, ["study", "lm", "--data", str(text_data), "--out", str(tmp_path / "x"),
                   *TINY, "--budgets", "10e9", "--lr", "3e-3"], r"epochs of the data")
    fails(capsys, ["study", "lm", "--data", str(text_data), "--out", str(tmp_path / "x"),
                   "--experiments", "pair,nope"], r"--experiments")
    fails(capsys, ["study", "report", str(tmp_path / "x")], r"holds no study")


LONG = ["--budgets", "256000", "--seeds", "0", "--lr", "3e-3", "--eval-tokens", "64000",
        "--set", "train.ckpt_every=100"]


def _argv(data, out):
    return [sys.executable, "-m", "moremoe.cli", "study", "lm", "--data", str(data), "--out",
            str(out), *TINY, *LONG]


def _wait_for(predicate, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s")
        time.sleep(0.2)


def _checkpointed(out):
    runs = list((out / "runs").glob("*/checkpoints/step_*"))
    return len({p.parents[1] for p in runs}) == 2


@pytest.mark.slow
def test_a_stopped_or_killed_study_continues_its_runs_exactly(text_data, tmp_path, capsys):
    env = {**os.environ, "PYTHONPATH": SRC}
    ref = tmp_path / "ref"
    with launched(_argv(text_data, ref), env=env) as proc:
        finish(proc, _argv(text_data, ref), 300)
    assert proc.returncode == 0
    out = tmp_path / "study"
    with launched(_argv(text_data, out), env=env) as proc:      # SIGTERM: checkpoint, 75
        _wait_for(lambda: _checkpointed(out), "checkpoint of both runs")
        proc.send_signal(signal.SIGTERM)
        _, err = finish(proc, _argv(text_data, out), 120)
    assert proc.returncode == 75, err[-2000:]
    assert "SIGTERM: stopping every run at its checkpoint" in err
    with launched(_argv(text_data, out), env=env) as proc:      # kill -9 of the study and runs
        _wait_for(lambda: "resume" in (out / "runs").joinpath(
            next(p.name for p in (out / "runs").iterdir()), "log.jsonl").read_text(),
                  "resumed run")
        time.sleep(1.0)
        kill_group(proc)
        proc.wait(timeout=30)
    code, r = study(capsys, text_data, out, *LONG)              # and to the end
    assert code == 0 and r["result"]["left"] == []
    ours, theirs = ({row["run"]: row for row in rows(d)} for d in (out, ref))
    assert ours.keys() == theirs.keys()
    for name, row in ours.items():       # the same operations in the same order: exact
        assert row["evals"] == theirs[name]["evals"] and row["hnorm"] == theirs[name]["hnorm"]
        assert row["processes"] >= 2


def test_edited_study_files_are_named(capsys, tmp_path, text_data):
    out = tmp_path / "study"
    argv = ["--budgets", "512", "--seeds", "0", "--lr", "3e-3"]
    code, _ = study(capsys, text_data, out, *argv)
    assert code == 0
    rows_path = out / "rows.jsonl"
    good = rows_path.read_text()
    row = json.loads(good.splitlines()[0])
    del row["evals"][0]["tokens"]
    rows_path.write_text(json.dumps(row) + "\n" + "".join(good.splitlines(True)[1:]))
    fails(capsys, ["study", "report", str(out)],
          rf"{rows_path}, line 1: not a study row of this version \(no 'tokens'\)")
    rows_path.write_text(good)
    meta = json.loads((out / "study.json").read_text())
    meta["settings"]["budgets"] = "x"
    (out / "study.json").write_text(json.dumps(meta))
    fails(capsys, ["study", "report", str(out)], r"study\.json: its settings are not this "
                                                 r"version's")
    (out / "study.json").write_bytes(b"\x9f" * 10)
    fails(capsys, ["study", "report", str(out)], r"study\.json is not JSON")


def test_a_diverged_run_is_a_result_and_a_selection_without_a_rate_is_named(
        text_data, tmp_path, capsys):
    """A candidate rate that makes the loss non-finite gets a row saying where, loses the
    selection and is not trained again; a configuration whose every candidate diverged
    is refused in one line naming --lrs, not left waiting forever."""
    out = tmp_path / "study"
    args = ["--budgets", "1024", "--seeds", "0", "--lrs", "1e-3,1e30", "--lr-tokens", "1024",
            "--eval-tokens", "512"]
    code, r = study(capsys, text_data, out, *args)
    assert code == 0 and r["result"]["failed"] == [] and r["result"]["blocked"] == []
    got = {row["run"]: row for row in rows(out)}
    wild = [row for row in got.values() if row["lr"] == 1e30]
    assert len(wild) == 2 and all(row["diverged"] >= 1 and row["val_loss"] is None
                                  for row in wild)
    assert all(sel["chosen"] == 1e-3 for sel in r["report"]["lr"].values())
    assert {d["run"] for d in r["report"]["diverged"]} == {row["run"] for row in wild}
    assert all(row["val_loss"] is not None for row in got.values() if row["kind"] == "main")
    code, again = study(capsys, text_data, out, *args)      # nothing trains again
    assert code == 0 and again["result"]["finished"] == []
    import fcntl                # --force while another command holds the study: refused
    held = os.open(out / ".lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        fails(capsys, ["study", "lm", "--data", str(text_data), "--out", str(out), *TINY,
                       *args[:4], "--lrs", "1e-3", *args[6:], "--force"],
              r"another `moremoe study` command.*is training in")
    finally:
        os.close(held)
    assert {row["run"] for row in rows(out)} == set(got) and (out / "runs").is_dir()
    assert main(["study", "lm", "--data", str(text_data), "--out", str(tmp_path / "b"),
                 *TINY, *args[:4], "--lrs", "1e30", *args[6:]]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"moremoe study lm: error: 2 run\(s\) have no learning rate, every "
                    r"candidate of their selection having diverged.*lower --lrs", last), last


def test_a_row_after_a_line_cut_short_stays_a_line_of_its_own(tmp_path):
    from moremoe.study.rows import append_row
    (tmp_path / "rows.jsonl").write_text('{"run": "a"}\n{"run": "b", "ki')
    append_row(tmp_path, {"run": "c"})
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert lines[-1] == '{"run": "c"}' and lines[1] == '{"run": "b", "ki'


def test_the_figures_subtitle_wraps_many_devices_and_commits():
    """Two devices and three commits ran past a two-panel figure's edges on one line: the
    subtitle keeps every word, in lines of at most 130 characters."""
    from moremoe.study.plots import _subtitle
    report = {"data": {"fingerprint": "aaf4e20dd0f41c27", "corpus": "9e0be51d0a74a722ff",
                       "train_tokens": 173_000_000},
              "devices": [{"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"},
                          {"device": "NVIDIA H200", "torch": "2.11.0+cu130"}],
              "commits": ["3a3af9b", "3eff3e6", "bd5accc"]}
    text = _subtitle(report)
    assert len(text.splitlines()) == 2 and all(len(t) <= 130 for t in text.splitlines())
    assert text.split() == ("data aaf4e20dd0f41c27 (corpus 9e0be51d0a74a722), 173M training "
                            "tokens; NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130), NVIDIA H200 "
                            "(torch 2.11.0+cu130); commit 3a3af9b, 3eff3e6, bd5accc").split()
