"""Progress of long work: a tqdm bar on a terminal, plain lines on stderr in a log (a line
when the work first moves, then at most one per 5 % and never within 10 s of the last, and
one at the end), nothing with --no-progress; stdout keeps the report (strict JSON)."""
import json
import re

import pytest

from cli_checks import fails
from moremoe import runtime
from moremoe.cli import main
from moremoe.runtime import ProgressLines, eta_text, progress_bar


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def lines(capsys):
    captured = capsys.readouterr()
    assert captured.out == ""                      # progress never goes to stdout
    return captured.err.splitlines()


def test_a_line_per_five_percent_when_that_is_slower_than_ten_seconds(capsys):
    clock = FakeClock()
    bar = ProgressLines(1000, desc="work", clock=clock)
    for _ in range(1000):                          # 1 s a unit: 5 % = 50 s > 10 s
        clock.now += 1.0
        bar.update()
    bar.close()
    got = lines(capsys)
    counts = [int(re.search(r"\((\d[\d,]*)/1,000\)", line)[1].replace(",", "")) for line in got]
    assert counts == [1, *range(51, 1000, 50), 1000]    # the first, every 50 units, the last
    assert got[0] == "work: 0% (1/1,000) 1.0s elapsed, ~16m39s left"
    assert got[-1] == "work: 100% (1,000/1,000) 16m40s elapsed, done"


def test_never_two_lines_within_ten_seconds(capsys):
    clock = FakeClock()
    bar = ProgressLines(1000, desc="fast", clock=clock)
    for _ in range(1000):                          # 1/32 s a unit: 31.25 s in all
        clock.now += 1 / 32
        bar.update()
    bar.close()
    got = lines(capsys)
    assert [re.search(r"\((\d[\d,]*)/", line)[1] for line in got] == ["1", "321", "641",
                                                                       "961", "1,000"]


def test_a_line_reads_like_a_trainer_log(capsys):
    clock = FakeClock()
    bar = ProgressLines(1000, desc="MoRE-96", clock=clock)
    clock.now = 72.0
    bar.set_postfix(loss="0.412")
    bar.update(370)
    assert lines(capsys) == ["MoRE-96: 37% (370/1,000) 1m12s elapsed, ~2m03s left "
                             "[loss=0.412]"]
    assert eta_text(1, 3, 7200.0) == "2h00m elapsed, ~4h00m left"


def test_resumed_work_counts_but_is_left_out_of_the_rate(capsys):
    clock = FakeClock()
    bar = ProgressLines(100, desc="tokenising", initial=50, clock=clock)
    clock.now = 10.0
    bar.update(10)                                  # 10 units in 10 s: 40 s for the 40 left
    assert lines(capsys) == ["tokenising: 60% (60/100) 10s elapsed, ~40s left"]


def test_work_of_unknown_size_by_time_alone(capsys):
    clock = FakeClock()
    bar = ProgressLines(None, desc="source", clock=clock)
    for _ in range(100):
        clock.now += 1.0
        bar.update(1000)
    bar.close()
    assert lines(capsys) == ["source: 1,000 so far, 1.0s elapsed",
                             "source: 31,000 so far, 31s elapsed",
                             "source: 61,000 so far, 1m01s elapsed",
                             "source: 91,000 so far, 1m31s elapsed",
                             "source: 100,000 so far, 1m40s elapsed, done"]


def test_nothing_until_the_work_moves_and_nothing_when_off(capsys):
    bar = progress_bar(10, desc="off", enabled=False)
    bar.update(5)
    bar.close()
    bar = progress_bar(10, desc="idle")              # stderr is not a terminal here
    assert isinstance(bar, ProgressLines)
    bar.close()                                      # an error before any work: no line
    runtime.progress_note("note", enabled=False)
    assert lines(capsys) == []


def test_a_terminal_gets_the_tqdm_bar(monkeypatch):
    monkeypatch.setattr(runtime.sys.stderr, "isatty", lambda: True, raising=False)
    from tqdm import tqdm
    bar = progress_bar(3, desc="tty", initial=1)
    try:
        assert isinstance(bar, tqdm) and bar.n == 1
    finally:
        bar.close()


def strict_json(text):
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=reject)


PB = ["--size", "40", "--hidden", "32", "--width", "8", "--rank", "4", "--layers", "1",
      "--batch-size", "16", "--max-steps", "2", "--eval-every", "2", "--eval-entries", "8",
      "--device", "cpu", "--arch", "more"]


def test_phonebook_train_in_a_log_says_what_it_does(capsys, tmp_path):
    """A 2-step run: its first and last progress lines and the learning-rate calibration
    (which rates, how many steps) on stderr, none with --no-progress; stdout strict JSON."""
    assert main(["phonebook", "train", *PB, "--lr-grid", "1e-3,3e-3", "--calibration-steps",
                 "1", "--out", str(tmp_path / "a"), "--json"]) == 0
    captured = capsys.readouterr()
    report = strict_json(captured.out)
    err = captured.err.splitlines()
    name = report["runs"][0]["name"]
    assert err[0] == (f"{name}: calibrating the learning rate over 0.001, 0.003 (1 steps "
                      f"each, before training for at most 2 steps; --lr skips this)")
    assert any(line.startswith(f"{name} lr=0.001 (calibration): 100% (1/1) ")
               for line in err)
    # on a CPU the bar moves a step at a time, inside an evaluation interval too
    assert f"{name}: 50% (1/2) " in "\n".join(err)
    assert any(re.fullmatch(rf"{re.escape(name)}: training with lr \S+, the calibration's best "
                            rf"\(digit accuracy 0.001: \S+, 0.003: \S+\)", line)
               for line in err)
    assert re.fullmatch(rf"{re.escape(name)}: 100% \(2/2\) \S+ elapsed, done "
                        rf"\[loss=\S+, em=\S+\]", err[-1])
    assert main(["phonebook", "train", *PB, "--lr-grid", "1e-3", "--calibration-steps", "1",
                 "--out", str(tmp_path / "b"), "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert strict_json(captured.out)["runs"][0]["steps"] == 2 and captured.err == ""


def test_train_shows_its_first_step(capsys, tmp_path, text_data):
    """The log's first line comes after step 1, not after log_every steps."""
    assert main(["train", "--data", str(text_data), "--out", str(tmp_path / "run"),
                 "--preset", "tiny-moe", "--device", "cpu", "--set", "model.seq_len=64",
                 "--set", "train.batch_size=2", "--set", "train.log_every=10",
                 "--set", "train.eval_batches=1", "--set", "train.max_steps=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert steps[0].startswith("step 1/3 | loss ")
    assert steps[0].endswith("| first step (compilation and warm-up included)")
    assert steps[1].startswith("step 3/3 | loss ") and "left" not in steps[1]


def test_eval_progress_never_comes_before_a_task_name_error(capsys, tmp_path,
                                                             lm_eval_tasks):
    """Perplexity shows progress, but the tasks are checked before it starts."""
    np = pytest.importorskip("numpy")
    from test_cli_eval import hf_dir, tiny_gpt2_model, write_data_dir
    model = hf_dir(tmp_path, tiny_gpt2_model())
    data = write_data_dir(tmp_path / "data", np.zeros((4, 16), dtype=np.int64))
    argv = ["eval", str(model), "--data", str(data), "--batch-size", "2", "--device", "cpu",
            "--include-path", str(lm_eval_tasks)]
    assert main([*argv, "--tasks", "none", "--json"]) == 0
    captured = capsys.readouterr()
    assert strict_json(captured.out)["perplexity"]["tokens"] == 4 * 15
    assert any(line.startswith("perplexity: 100% (2/2) ")
               for line in captured.err.splitlines())
    fails(capsys, [*argv, "--tasks", "sciq_fixture,no_such_task"], "unknown task no_such_task")


def test_a_result_from_a_modified_tree_says_so(monkeypatch):
    """commit_id names the commit, and "+modified" where the tracked source differs from
    it (a device's copy of a working tree whose git metadata is older): not another
    commit's name alone."""
    import subprocess
    from moremoe import runtime
    monkeypatch.delenv("MOREMOE_COMMIT", raising=False)
    state = {"status": ""}

    def fake_run(cmd, **kw):
        out = "abc123def456" if "rev-parse" in cmd else state["status"]
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")
    monkeypatch.setattr(runtime.subprocess, "run", fake_run)
    assert runtime.commit_id() == "abc123def456"
    state["status"] = " M src/moremoe/ops/linear_ce.py"
    assert runtime.commit_id() == "abc123def456+modified"
    monkeypatch.setenv("MOREMOE_COMMIT", "0123456789ab")
    assert runtime.commit_id() == "0123456789ab"
