"""Every bad input is one line on stderr and exit status 2 (--debug shows the traceback);
outputs are checked before the work and never lost; --json is strict JSON; a stopped run
says why in its exit status."""
import errno
import json
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

from cli_checks import fails
from moremoe.cli import main
from moremoe.model import checkpoint as stored
from procs import finish, launched
from test_cli_eval import hf_dir, tiny_gpt2_model, write_data_dir

PB = ["--size", "40", "--hidden", "32", "--width", "8", "--rank", "4", "--layers", "1",
      "--batch-size", "16", "--lr", "3e-3", "--max-steps", "2", "--eval-every", "2",
      "--eval-entries", "8", "--device", "cpu", "--no-progress"]
TRAIN = ["--preset", "tiny-moe", "--device", "cpu", "--set", "model.seq_len=64",
         "--set", "train.batch_size=4", "--set", "train.log_every=1",
         "--set", "train.eval_batches=1", "--set", "train.ckpt_every=2"]


def strict_json(text):
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=reject)


@pytest.fixture
def run2(text_data, tmp_path):
    """A tiny run with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    assert main(["train", "--data", str(text_data), "--out", str(out), *TRAIN,
                 "--set", "train.max_steps=4"]) == 0
    return out


@pytest.mark.parametrize("argv, match", [
    (["phonebook", "train", *PB, "--heads", "5"], "--heads 5 must divide --hidden 32"),
    (["phonebook", "train", *PB, "--device", "tpu"], "device must be one of auto, cpu, cuda"),
    (["phonebook", "train", *PB, "--rank", "33"], "--rank 33 must be at most --hidden 32"),
    (["phonebook", "train", *PB, "--size", "12000000"], "--size 12,000,000 exceeds the "
                                                        "11,881,376 unique five-letter names"),
    (["phonebook", "capacity", *PB[2:], "--sizes", "8,12000000"], "--sizes 12,000,000 exceeds"),
    (["phonebook", "train", *PB, "--lr", "inf"], "argument --lr: expected a finite number"),
    (["phonebook", "train", *PB, "--threshold", "5"], r"--threshold: expected a number in "
                                                      r"\(0, 1\], got '5'"),
    # 0 would call a run that memorised nothing "reached"
    (["phonebook", "train", *PB, "--threshold", "0"], r"--threshold: expected a number in "
                                                      r"\(0, 1\], got '0'"),
    (["phonebook", "capacity", *PB[2:], "--sizes", "8,12.5"], "--sizes: expected comma-separated "
                                                              "integers"),
    (["phonebook", "train", *PB, "--batch-size", "1.5"], "--batch-size: expected a positive int"),
    (["phonebook", "train", *PB, "--seed", "-1"], "--seed: expected an integer >= 0"),
    (["plan", "--hidden", "512", "--width", "64", "--top-k", "4", "--rank", "64", "--budget",
      "1e400"], "--budget: expected a finite number, got '1e400'"),
    (["plan", "--hidden", "512", "--width", "64", "--top-k", "4", "--rank", "64", "--ce", "inf"],
     "--ce: expected a finite number"),
    (["plan", "--hidden", "512", "--width", "64", "--top-k", "4", "--rank", "64", "--cr", "nan"],
     "--cr: expected a finite number"),
    (["bench", "router", "--plot-only", "missing.jsonl"], "missing.jsonl: no such results file"),
    (["train", "--preset", "tiny-moe", "--set", "optim.lr=[1", "--data", "x"],
     r"--set optim.lr=\[1: the value .* is not a YAML value"),
    (["train", "--preset", "tiny-moe", "--set", "optim.lr=inf", "--data", "x"],
     "optim.lr must be a finite number > 0, got inf"),
    (["train", "--preset", "tiny-moe", "--resume", "--force"], "not allowed with argument"),
    (["eval", "nowhere", "--num-fewshot", "-1"], "--num-fewshot: expected an integer >= 0"),
])
def test_bad_arguments_are_one_line(capsys, argv, match):
    fails(capsys, argv, match)


def test_device_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    fails(capsys, ["phonebook", "train", *PB, "--device", "cuda"],
          "device 'cuda' was asked for but this machine has no CUDA GPU.*use cpu or auto")


def test_bad_files_are_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"router": "lowrank"}\n{bad\n')
    fails(capsys, ["bench", "router", "--plot-only", str(bad)], r"bad.jsonl, line 2: not JSON")
    bad.write_text('{"x": 1}\n')
    fails(capsys, ["bench", "layer", "--plot-only", str(bad)], "not rows of `moremoe bench layer`")
    fails(capsys, ["bench", "model", "--plot-only", str(bad)], "not rows of `moremoe bench model`")
    fails(capsys, ["bench", "model", "--pairs", "h512,x"], r"--pairs got 'h512,x', expected")
    fails(capsys, ["bench", "layer", "--experts", "0"], r"--experts: expected positive integers")
    fails(capsys, ["bench", "decode", "--hidden", "64,x"],
          r"--hidden: expected comma-separated integers .* got '64,x'")
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: [1\n")
    fails(capsys, ["train", "--config", str(yaml_file), "--data", "x"],
          r"run.yaml is not valid YAML: .* at line 2, column 1")
    data = write_data_dir(tmp_path / "data", np.zeros((2, 16), dtype=np.int64))
    meta = json.loads((data / "meta.json").read_text())
    for key, value in (("seq_len", "16"), ("val_sequences", 2.5), ("sha256", [])):
        (data / "meta.json").write_text(json.dumps({**meta, key: value}))
        fails(capsys, ["data", "verify", str(data)], rf"meta.json: {key} must (be|map)")


@pytest.mark.parametrize("name, damage, match", [
    (stored.STATE_FILE, "garble", r"state.pt cannot be read .* the file is corrupt; the previous "
                              r"complete checkpoint is .*step_00000002"),
    (stored.MODEL_FILE, "truncate", r"checkpoint .*step_00000004 is incomplete: model.safetensors "
                                r"has .* bytes, .*previous complete checkpoint is .*step_000000"
                                r"02"),
    (stored.CONFIG_FILE, "garble", r"step_00000004 is incomplete: config.json cannot be read"),
])
def test_damaged_checkpoints_are_named(capsys, run2, text_data, name, damage, match):
    path = run2 / "checkpoints" / "step_00000004" / name
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    else:
        at = data.index(b"data.pkl") + 40 if name == stored.STATE_FILE else 0
        data[at:at + 64] = b"\xff" * 64
        path.write_bytes(bytes(data))
    if name == stored.STATE_FILE:             # read by a resume only
        fails(capsys, ["train", "--data", str(text_data), "--out", str(run2), *TRAIN,
                       "--set", "train.max_steps=6", "--resume"], match)
    else:
        fails(capsys, ["eval", str(run2 / "checkpoints" / "step_00000004"), "--tasks", "none",
                       "--data", str(text_data)], match)


def test_token_ids_beyond_the_vocabulary(capsys, tmp_path):
    from prepared import write_token_dir
    data = write_token_dir(tmp_path / "data")
    rows = np.fromfile(data / "train.bin", dtype="<u2").reshape(-1, 128)
    rows[:, 3] = 999
    rows.tofile(data / "train.bin")
    out = tmp_path / "run"
    fails(capsys, ["train", "--data", str(data), "--out", str(out), *TRAIN,
                   "--set", "model.vocab=256", "--set", "train.max_steps=4"],
          r"train.bin: sequence \d+ holds token id 999, not below the model's vocabulary of "
          r"256: .* `moremoe data verify`")
    assert not stored.checkpoints(out) and not stored.incomplete_checkpoints(out)


def test_eval_task_errors(capsys, tmp_path, lm_eval_tasks):
    model = hf_dir(tmp_path, tiny_gpt2_model())
    fails(capsys, ["eval", str(model), "--tasks", "no_such_task", "--device", "cpu"],
          "unknown task no_such_task: not among lm-eval's .* tasks")
    fails(capsys, ["eval", str(model), "--tasks", "sciq", "--include-path",
                   str(tmp_path / "nowhere"), "--device", "cpu"],
          "--include-path .*nowhere: no such folder of task YAMLs")
    t0 = time.time()           # HF_HUB_OFFLINE=1 (tests/conftest.py): no network, as offline
    fails(capsys, ["eval", str(model), "--tasks", "sciq", "--limit", "1", "--device", "cpu"],
          r"Couldn't reach .*'(allenai/)?sciq'.*: the tasks' datasets must be downloaded first.*"
          r"--include-path")
    assert time.time() - t0 < 60                            # one attempt, not minutes of retries


def test_debug_shows_the_traceback(capsys, monkeypatch):
    argv = ["plan", "--hidden", "512", "--top-k", "1", "--rank", "64",
            "--budget", "100"]
    with pytest.raises(ValueError, match="does not cover the low-rank projection"):
        main(argv + ["--debug"])
    monkeypatch.setenv("MOREMOE_DEBUG", "1")
    with pytest.raises(ValueError):
        main(argv)


def test_a_bug_is_one_line_that_says_so(capsys, monkeypatch):
    import moremoe.cli.plan as plan

    def broken(args):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(plan, "cmd_flops", broken)
    fails(capsys, ["flops", "--experts", "4", "--top-k", "2", "--hidden", "8", "--width", "4"],
          r"internal error \(ZeroDivisionError: division by zero\); run it again with --debug",
          code=1)


# ------------------------------------------------------------------ outputs


def test_outputs_under_a_file_are_refused_before_the_work(capsys, tmp_path, text_data):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    under = str(blocker / "out")
    why = "cannot write there \\(a part of the path is a file, not a folder\\)"
    fails(capsys, ["phonebook", "train", *PB, "--out", under], f"--out {under}: {why}")
    fails(capsys, ["demo", "--size", "8", "--steps", "1", "--device", "cpu", "--out", under],
          f"--out {under}: {why}")
    fails(capsys, ["data", "prepare", str(text_data), "--out", under], f"--out {under}: {why}")
    fails(capsys, ["data", "corpus", under], f"OUT {under}: {why}")
    fails(capsys, ["train", "--data", str(text_data), "--out", under, *TRAIN],
          rf"--out \(train.out\) {under}: {why}")
    fails(capsys, ["eval", "nowhere", "--tasks", "sciq", "--out", str(blocker / "r.json")],
          why)                                                 # before loading any model
    fails(capsys, ["eval", "nowhere", "--tasks", "sciq", "--out", str(tmp_path)],
          "is a folder; give a file name")


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_an_unwritable_folder_is_refused_before_the_work(capsys, tmp_path, monkeypatch, code):
    """A read-only file system, a folder without write permission (root writes anyway, so it
    is simulated at the probe) or a full disk: named before any training starts."""
    real_open = os.open

    def refuse(path, flags, *args):
        if ".moremoe-write-test" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", refuse)
    out = tmp_path / "ro"
    fails(capsys, ["phonebook", "train", *PB, "--out", str(out)],
          rf"--out {out}: cannot write there \({os.strerror(code)}\)")


def test_a_failed_command_leaves_no_empty_folders(capsys, tmp_path):
    out = tmp_path / "new" / "run"
    fails(capsys, ["train", "--preset", "tiny-moe", "--data", str(tmp_path / "nowhere"),
                   "--out", str(out)], "meta.json is missing")
    fails(capsys, ["phonebook", "train", *PB, "--heads", "5", "--out", str(out)], "--heads")
    assert not (tmp_path / "new").exists()


def test_eval_report_survives_a_full_disk(capsys, tmp_path, monkeypatch):
    import moremoe.cli.eval as cli_eval
    model = hf_dir(tmp_path, tiny_gpt2_model())
    data = write_data_dir(tmp_path / "data", np.random.default_rng(0).integers(0, 50257, (4, 16)))
    target, real = tmp_path / "report.json", cli_eval.write_json

    def full_disk(path, obj):
        if path == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, obj)
    monkeypatch.setattr(cli_eval, "write_json", full_disk)
    capsys.readouterr()
    assert main(["eval", str(model), "--data", str(data), "--tasks", "none", "--device",
                 "cpu", "--out", str(target), "--json", "--no-progress"]) == 2
    captured = capsys.readouterr()
    printed = strict_json(captured.out)                 # the numbers were printed first
    [line] = captured.err.strip().splitlines()
    assert "No space left on device" in line and "printed above" in line
    spare = line.split("it is in ")[1].split(" (and")[0]
    assert strict_json(open(spare).read()) == printed
    os.unlink(spare)


def test_reports_respect_the_umask(tmp_path):
    from moremoe.report import write_json
    from moremoe.training.metrics import RunLog
    old = os.umask(0o022)
    try:
        assert (os.stat(write_json(tmp_path / "r.json", {"a": 1})).st_mode & 0o777) == 0o644
        RunLog(tmp_path, enabled=True, tensorboard=False).close()
        assert (os.stat(tmp_path / "log.jsonl").st_mode & 0o777) == 0o644
    finally:
        os.umask(old)


def test_prepared_metadata_is_readable_by_the_group(tmp_path, capsys):
    from moremoe.tasks.text import stdlib_corpus
    corpus = stdlib_corpus(tmp_path / "corpus", format="jsonl")[0]
    old = os.umask(0o022)
    try:
        assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "d"), "--seq-len",
                     "64", "--val-sequences", "4", "--workers", "1", "--no-progress"]) == 0
    finally:
        os.umask(old)
    for name in ("meta.json", "train.bin", "val.bin"):
        assert os.stat(tmp_path / "d" / name).st_mode & 0o044 == 0o044, name


def test_hf_export_never_overwrites_a_checkpoint(capsys, run2, tmp_path):
    step = run2 / "checkpoints" / "step_00000004"
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    fails(capsys, ["hf", "export", str(step), str(step)], "is CHECKPOINT: write the export")
    fails(capsys, ["hf", "export", str(run2), str(step)], "is inside")
    fails(capsys, ["hf", "export", str(step), str(run2)], "holds a run of moremoe; it is never "
                                                          "written into")
    fails(capsys, ["hf", "export", str(step), str(run2), "--force"], "never written into")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    fails(capsys, ["hf", "export", str(step), str(other)], "is not empty; pass --force")
    (tmp_path / "afile").write_text("x")
    fails(capsys, ["hf", "export", str(step), str(tmp_path / "afile")], "is a file")
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before
    assert main(["hf", "export", str(step), str(other), "--force", "--json"]) == 0
    assert (other / "notes.txt").read_text() == "mine"
    assert {"config.json", "model.safetensors"} <= {p.name for p in other.iterdir()}


# ------------------------------------------------------------------ JSON and exit status


def test_json_is_strict_with_nan_values(capsys, tmp_path):
    from moremoe.report import dumps, emit, write_json

    class Args:
        json = True
    emit(Args, {"stderr": float("nan"), "x": [float("inf"), 1.5]}, "")
    assert strict_json(capsys.readouterr().out) == {"stderr": None, "x": [None, 1.5]}
    assert strict_json(write_json(tmp_path / "r.json", {"a": float("-inf")}).read_text()) \
        == {"a": None}
    assert dumps({"p": tmp_path}) == json.dumps({"p": str(tmp_path)})


def test_eval_json_with_a_one_question_standard_error_is_strict(capsys, tmp_path,
                                                                lm_eval_tasks):
    model = hf_dir(tmp_path, tiny_gpt2_model())
    assert main(["eval", str(model), "--tasks", "triviaqa_fixture", "--include-path",
                 str(lm_eval_tasks), "--limit", "1", "--max-gen-toks", "2", "--device", "cpu",
                 "--json"]) == 0
    report = strict_json(capsys.readouterr().out)
    assert report["tasks"]["triviaqa_fixture"]["metrics"]["f1"]["stderr"] is None  # n = 1


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_run_checkpoints_and_exits_non_zero(tmp_path, text_data, sig, code):
    from pathlib import Path
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "moremoe.cli", "train", "--data", str(text_data), "--out",
            str(out), *TRAIN, "--set", "train.max_steps=100000", "--json"]
    with launched(argv, env=env) as proc:
        deadline = time.time() + 120
        while not stored.checkpoints(out) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = finish(proc, argv, 120)
    assert proc.returncode == code, stderr[-2000:]
    summary = strict_json(stdout)
    assert summary["stopped"] == sig.name and summary["exit_code"] == code
    assert not summary["finished"]
    assert stored.latest_checkpoint(out).name == f"step_{summary['step']:08d}"


def test_budget_stops_exit_75_and_a_finished_run_0(capsys, tmp_path, text_data):
    out = tmp_path / "run"
    assert main(["train", "--data", str(text_data), "--out", str(out), *TRAIN,
                 "--set", "train.max_steps=6", "--stop-step", "2", "--json"]) == 75
    first = strict_json(capsys.readouterr().out)
    assert first["stopped"] == "stop_step" and first["exit_code"] == 75
    assert main(["train", "--data", str(text_data), "--out", str(out), *TRAIN,
                 "--set", "train.max_steps=6", "--resume", "--max-minutes", "1e-6"]) == 75
    capsys.readouterr()
    assert main(["train", "--data", str(text_data), "--out", str(out), *TRAIN,
                 "--set", "train.max_steps=6", "--resume", "--json"]) == 0
    last = strict_json(capsys.readouterr().out)
    assert last["finished"] and last["stopped"] == "max_steps" and last["step"] == 6


def test_a_non_finite_run_is_one_line(capsys, tmp_path, text_data):
    out = tmp_path / "run"
    fails(capsys, ["train", "--data", str(text_data), "--out", str(out), *TRAIN,
                   "--set", "optim.lr=1e4", "--set", "optim.warmup_frac=0",
                   "--set", "train.max_steps=50"],
          r"step \d+: the loss is .*lower optim.lr, or pass --set train.nan_policy=skip")


def test_a_diverging_phonebook_run_is_one_line(capsys, tmp_path):
    argv = [a if a != "3e-3" else "1e6" for a in PB]
    fails(capsys, ["phonebook", "train", *argv, "--max-steps", "20", "--out",
                   str(tmp_path / "pb")], r"step \d+: the loss is not finite; lower the "
                                          r"learning rate \(--lr 1e\+06\)")
