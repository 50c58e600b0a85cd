"""The failure classes a new user met (issue 53), each through the commands it was found in:
numbers out of range, edited files, options accepted and ignored, files that are not text,
failures that leave files behind. Each is one line naming the option, key or file and what
to do, exit status 2, and nothing left behind by a refused or failed command."""
import json
import shutil

import pytest
import torch

from cli_checks import fails
from moremoe.cli import main

PB = ["--size", "64", "--hidden", "16", "--width", "4", "--rank", "4", "--layers", "1",
      "--device", "cpu", "--no-progress"]
TRAIN = ["--preset", "tiny-more", "--device", "cpu", "--set", "model.seq_len=64",
         "--set", "train.batch_size=2", "--set", "train.eval_batches=1",
         "--set", "train.max_steps=4", "--set", "train.ckpt_every=2"]


def refuses(capsys, tmp_path, argv, match):
    """argv (with OUT for a fresh folder) fails in one line; OUT is not left behind."""
    out = tmp_path / "out"
    fails(capsys, [str(out) if a == "OUT" else a for a in argv], match)
    assert not out.exists(), sorted(p.name for p in out.iterdir())


# ------------------------------------------------------------------ numbers out of range


@pytest.mark.parametrize("argv, match", [
    (["phonebook", "train", *PB, "--lr", "1e-3", "--max-steps", "1e30", "--out", "OUT"],
     r"the run would last 1e\+30 steps \(--max-steps\), more than .* \(2\^53\)"),
    (["phonebook", "capacity", "--sizes", "32,64", *PB[2:], "--lr", "1e-3", "--max-epochs",
      "1e30", "--out", "OUT"], r"--max-epochs 1e\+30 of 64 entries .* more than .*2\^53"),
    (["phonebook", "train", *PB, "--max-steps", "3", "--calibration-steps", "1e30", "--out",
      "OUT"], r"--calibration-steps 1,000,000,.* is more than .* \(2\^53\)"),
    (["phonebook", "train", *PB, "--lr", "1e-3", "--hidden", "1e300", "--out", "OUT"],
     r"--hidden 1e\+300 is more than 2\^62: no model of that size fits"),
    (["phonebook", "sweep", "--over", "hidden", "--values", "16,1e300", *PB[2:], "--lr", "1e-3",
      "--size", "32", "--out", "OUT"], r"--values 1e\+300: --hidden 1e\+300 is more than"),
    (["phonebook", "train", *PB, "--lr", "1e-3", "--hidden", "1e18", "--out", "OUT"],
     r"needs at least [\d,.e+]+ GiB"),
])
def test_phonebook_numbers_out_of_range_are_named(capsys, tmp_path, argv, match):
    refuses(capsys, tmp_path, argv, match)


@pytest.mark.parametrize("setting, match", [
    ("optim.lr=1e300", r"optim\.lr must be at most fp32's largest number, 3\.4e38, got 1e\+300"),
    ("model.hidden=1e300", r"model\.hidden must be a 64-bit integer .* got '1e300'"),
    ("train.seed=1e30", r"train\.seed must be a 64-bit integer .* got '1e30'"),
])
def test_train_numbers_out_of_range_are_named(capsys, tmp_path, text_data, setting, match):
    refuses(capsys, tmp_path, ["train", *TRAIN, "--data", str(text_data), "--out", "OUT",
                               "--set", setting], match)


# ------------------------------------------------------------------ edited files


def _phonebook_run(tmp_path, *extra):
    out = tmp_path / "pb"
    assert main(["phonebook", "train", *PB, "--lr", "1e-3", "--out", str(out), "--json",
                 *extra]) in (0, 75)
    return out


@pytest.mark.parametrize("edit, match", [
    (lambda r: r["history"][0].pop("step"), r"its record history\[0\] lacks 'step'"),
    (lambda r: r.pop("history"), r"its record lacks 'history'"),
    (lambda r: r.__setitem__("exact_match", "x"), r"'exact_match' = \"x\", not an integer or"),
    (lambda r: r.__setitem__("steps", "x"), r"has 'steps' = \"x\", not an integer"),
])
def test_an_edited_journal_record_is_named_with_its_line(capsys, tmp_path, edit, match):
    out = _phonebook_run(tmp_path, "--max-steps", "4", "--eval-every", "2")
    journal = out / "trials.jsonl"
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    edit(rows[0]["record"])
    journal.write_text("".join(json.dumps(row) + "\n" for row in rows))
    fails(capsys, ["phonebook", "train", *PB, "--lr", "1e-3", "--max-steps", "4",
                   "--eval-every", "2", "--out", str(out), "--resume"],
          rf"{journal}, line 1: .*{match}.*delete that line")


@pytest.mark.parametrize("edit, match", [
    (lambda s: s["run"].__setitem__("history", "x"), r"has 'history' = \"x\", not a list"),
    (lambda s: [1, 2], r"holds no trial state"),
    (lambda s: s["step"].pop("optimizer"), r"lacks 'optimizer'"),
    (lambda s: s["step"]["model"].__setitem__(next(iter(s["step"]["model"])),
                                              torch.zeros(3)), r"does not fit this trial"),
])
def test_an_edited_trial_checkpoint_is_named(capsys, tmp_path, edit, match):
    out = _phonebook_run(tmp_path, "--max-steps", "100000", "--stop-after", "0.01")
    [path] = list((out / "trial_checkpoints").glob("*.pt"))
    state = torch.load(path, weights_only=False)
    state = edit(state) if isinstance(edit(state), list) else state
    torch.save(state, path)
    fails(capsys, ["phonebook", "train", *PB, "--lr", "1e-3", "--max-steps", "100000",
                   "--out", str(out), "--resume", "--stop-after", "0.01"],
          rf"trial checkpoint {path} .*{match}.*delete it to run that trial again")


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["model"]["moe"].pop("hidden"), r"model\.moe\.hidden: 'missing'"),
    (lambda c: c["model"]["moe"].__setitem__("experts", 65), r"model\.moe\.experts: 65"),
    (lambda c: c["train"]["train"].__setitem__("batch_size", "x"),
     r"holds no run config this version reads \(train\.batch_size must be an integer"),
])
def test_an_edited_checkpoint_config_is_named(capsys, tmp_path, text_data, edit, match):
    out = tmp_path / "run"
    argv = ["train", *TRAIN, "--data", str(text_data), "--out", str(out)]
    assert main([*argv, "--stop-step", "2"]) == 75
    capsys.readouterr()
    [ckpt] = list((out / "checkpoints").glob("step_*"))
    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    (ckpt / "config.json").write_text(json.dumps(config))
    fails(capsys, [*argv, "--resume"], rf"cannot resume .*{ckpt.name}/config\.json .*{match}")


# ------------------------------------------------------------------ accepted and ignored


@pytest.mark.parametrize("argv, match", [
    (["phonebook", "train", *PB, "--lr", "1e-3", "--lr-grid", "1e-3,3e-3", "--out", "OUT"],
     r"--lr-grid is not read: --lr 0\.001 skips the learning-rate calibration"),
    (["phonebook", "capacity", "--sizes", "32", *PB[2:], "--lr", "1e-3", "--calibration-steps",
      "5", "--out", "OUT"], r"--calibration-steps is not read"),
    (["phonebook", "train", *PB, "--peer-heads", "4", "--out", "OUT"],
     r"--peer-heads sets PEER, which --arch both does not train"),
    (["phonebook", "sweep", "--over", "rank", "--values", "2,4", "--arch", "moe", *PB,
      "--out", "OUT"], r"--arch moe: --over rank sweeps the MoRE; give --arch more, or both"),
    (["phonebook", "sweep", "--over", "experts", "--values", "32,64", "--more-experts", "16",
      *PB, "--out", "OUT"], r"--more-experts 16: --over experts sets M' to each of --values"),
    (["bench", "router", "--quick", "--sweeps", "k", "--out", "OUT"],
     r"--sweeps k would not be measured: --quick runs a small sweep of its own"),
    (["train", "--preset", "tiny-more", "--set", "model.peer_heads=4", "--data", "OUT"],
     r"model\.peer_heads is read by model\.kind=peer only, and this model is model\.kind=more"),
    (["train", "--preset", "tiny-moe", "--set", "model.router_init=default", "--data", "OUT"],
     r"model\.router_init is read by model\.kind=more only"),
])
def test_an_option_the_command_would_not_read_is_refused(capsys, tmp_path, argv, match):
    refuses(capsys, tmp_path, argv, match)


def test_sweep_over_rank_with_arch_more_trains_no_moe():
    import argparse
    from moremoe.cli.phonebook import _sweep_models
    args = argparse.Namespace(over="rank", values=[2, 4], arch="more", hidden=16, width=4,
                              top_k=4, rank=4, layers=1, heads=None, moe_experts=None,
                              more_experts=None, more_width=None, round_width=8, refit=False,
                              router_init="variance_matched", peer_heads=2, peer_dq=8,
                              peer_reading="inference", size=64, seed=0, batch_size=1024,
                              lr=1e-3, lr_grid=[1e-3], calibration_steps=1, max_epochs=1.0,
                              max_steps=1, max_minutes=None, threshold=0.9, eval_every=1,
                              eval_entries=8, loss_on="number", device="cpu", step="auto")
    assert [(v, arch) for v, arch, _ in _sweep_models(args)] == [(2, "more"), (4, "more")]
    args.arch = "both"
    assert [arch for _, arch, _ in _sweep_models(args)] == ["moe", "more", "more"]


@pytest.mark.parametrize("argv, match", [
    (["bench", "router", "--sweeps", "M,M", "--out", "OUT"], r"'M,M' lists M twice"),
    (["bench", "model", "--pairs", "h512-s64,h512-s64"], r"lists h512-s64 twice"),
    (["bench", "phonebook", "--modes", "eager,eager"], r"lists eager twice"),
    (["data", "mixture", "--skip", "cosmopedia,cosmopedia", "--out", "OUT"],
     r"lists cosmopedia twice"),
    (["eval", "OUT", "--tasks", "sciq,sciq"], r"--tasks sciq,sciq lists sciq twice"),
])
def test_a_repeated_list_value_is_refused_everywhere(capsys, tmp_path, argv, match):
    refuses(capsys, tmp_path, argv, match)


def test_plot_refuses_a_run_given_twice(capsys, tmp_path, text_data):
    run = tmp_path / "run"
    assert main(["train", *TRAIN, "--data", str(text_data), "--out", str(run), "--json"]) == 0
    fails(capsys, ["plot", str(run), str(run), "--out", str(tmp_path / "p.png")],
          r"RUN .*run is given twice; give each run once")
    fails(capsys, ["plot", str(run), str(run), "--names", "a,a", "--out",
                   str(tmp_path / "p.png")], r"'a,a' lists a twice")
    assert not (tmp_path / "p.png").exists()


# ------------------------------------------------------------------ files that are not text


def test_a_binary_results_file_is_named_with_its_option(capsys, tmp_path):
    binary = tmp_path / "rows.jsonl"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    for bench in ("router", "layer", "phonebook", "peer"):
        fails(capsys, ["bench", bench, "--plot-only", str(binary)],
              rf"--plot-only {binary}, line 1: not UTF-8 text \(a binary file\?\)")


def test_a_binary_meta_json_is_named(capsys, tmp_path, text_data):
    data = tmp_path / "data"
    shutil.copytree(text_data, data)
    (data / "meta.json").write_bytes(b"\x9f\x80" * 20)
    fails(capsys, ["data", "verify", str(data)],
          rf"{data}/meta\.json is not UTF-8 text \(byte 0\): the file is corrupt")


# ------------------------------------------------------------------ left behind


def test_a_prepare_that_fails_before_a_shard_leaves_nothing(capsys, tmp_path):
    from moremoe.tasks.text import stdlib_corpus
    binary = tmp_path / "rnd.txt"
    binary.write_bytes(bytes(range(128, 256)) * 30)
    out = tmp_path / "data"
    fails(capsys, ["data", "prepare", str(binary), "--out", str(out), "--seq-len", "16",
                   "--val-sequences", "1", "--no-progress"], r"rnd\.txt: not UTF-8 at byte 0")
    assert not out.exists()
    stdlib_corpus(tmp_path / "corpus")
    assert main(["data", "prepare", str(tmp_path / "corpus"), "--out", str(out), "--seq-len",
                 "64", "--val-sequences", "4", "--no-progress", "--json"]) == 0


def test_a_kernel_the_device_cannot_run_is_refused_before_any_file(capsys, tmp_path, text_data,
                                                                   monkeypatch):
    import moremoe.kernels as kernels
    monkeypatch.setattr(kernels, "INTERPRET", False)
    refuses(capsys, tmp_path, ["train", *TRAIN, "--data", str(text_data), "--out", "OUT",
                               "--set", "model.router_impl=triton"],
            r"model\.router_impl=triton needs Triton and a CUDA GPU .*use auto .* or reference")
