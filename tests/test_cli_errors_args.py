"""Flags read as written and never silently dropped: integers parsed exactly, comma lists
without repeats, flags a command or mode does not read refused, and contradictions named in
one line with the flags the user typed."""
import json

import pytest

from cli_checks import fails
from moremoe.cli import main

PLAN = ["plan", "--hidden", "64", "--width", "8", "--top-k", "4", "--rank", "16"]


def run_json(capsys, argv):
    capsys.readouterr()
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------ integers


@pytest.mark.parametrize("text, value", [("1e30", 10 ** 30), ("1.5e3", 1500), ("10000.0", 10000),
                                         ("123456789012345678901", 123456789012345678901)])
def test_integer_flags_are_read_exactly(capsys, text, value):
    out = run_json(capsys, ["flops", "--experts", text, "--top-k", "2", "--hidden", "8",
                            "--width", "8"])
    assert out["experts"] == value and out["params_router"] == 8 * value


@pytest.mark.parametrize("argv, match", [
    (["flops", "--experts", "1.5", "--top-k", "1", "--hidden", "8", "--width", "8"],
     r"argument --experts: expected a positive integer, got '1.5'"),
    (["flops", "--experts", "1e-2", "--top-k", "1", "--hidden", "8", "--width", "8"],
     r"argument --experts: expected a positive integer, got '1e-2'"),
    (["flops", "--experts", "1e999999999", "--top-k", "1", "--hidden", "8", "--width", "8"],
     r"argument --experts: expected an integer of at most 4,300 digits, got '1e999999999'"),
    (["data", "prepare", "x", "--out", "y", "--seed", "-1"],
     r"argument --seed: expected an integer >= 0, got -1"),
    (["data", "mixture", "--list", "--seed", "2.5"], r"argument --seed: expected an integer"),
])
def test_integers_that_are_not_are_named_with_the_flag(capsys, argv, match):
    fails(capsys, argv, match)


# ------------------------------------------------------------------ comma lists


@pytest.fixture
def no_training(monkeypatch):
    """A command that gets past its checks fails its test at once instead of training."""
    import moremoe.phonebook.trainer as trainer
    import moremoe.phonebook.pool as pool

    def refuse(*args, **kwargs):
        raise AssertionError("training started: the arguments were accepted")
    for module in (trainer, pool):
        monkeypatch.setattr(module, "PhonebookTrainer", refuse)


@pytest.mark.parametrize("argv, match", [
    ([*PLAN, "--sweep", "rank", "--ranks", "16,16,8"], r"--ranks: '16,16,8' lists 16 twice"),
    (["theory", "rank", "--experts", "8", "--hidden", "8", "--top-k", "2", "--tokens", "100",
      "--ranks", "2,2", "--no-progress"], r"--ranks: '2,2' lists 2 twice"),
    (["phonebook", "sweep", "--over", "rank", "--values", "4,4", "--size", "10", "--out", "OUT"],
     r"--values: '4,4' lists 4 twice; give each value once"),
    (["phonebook", "capacity", "--sizes", "8,16,8", "--out", "OUT"],
     r"--sizes: '8,16,8' lists 8 twice"),
    (["phonebook", "train", "--size", "8", "--lr-grid", "1e-3,0.001", "--out", "OUT"],
     r"--lr-grid: '1e-3,0.001' lists 0.001 twice"),
    (["train", "--preset", "tiny-moe", "--data", "OUT", "--lr-grid", "3e-4,3e-4,3e-4"],
     r"--lr-grid: .* lists 0.0003 3 times"),
    (["bench", "layer", "--experts", "64,1e3,1000", "--plot-only", "OUT"],
     r"--experts: .* lists 1000 twice"),
    (["convert-router", "OUT", "--out", "OUT", "--rank", "4,4"], r"--rank: '4,4' lists 4 twice"),
])
def test_a_repeated_list_value_is_refused(capsys, tmp_path, no_training, argv, match):
    out = tmp_path / "out"
    fails(capsys, [str(out) if a == "OUT" else a for a in argv], match)
    assert not out.exists()


# ------------------------------------------------------------------ plan


@pytest.mark.parametrize("extra, match", [
    (["--budget", "30000"], r"--width 8 and --budget 30000 both set tau .*; give one$"),
    (["--experts", "2"], r"--top-k must be in \[1, --experts=2\] \(the reference MoE's "
                         r"experts\), got 4"),
    (["--round-width", "1000"], r"--round-width 1000 rounds the MoRE width 6.0 to 1000, wider "
                                r"than the 11 that tau = 24,576 leaves room for with --top-k 4 "
                                r"experts; give a --round-width of at most 11$"),
    (["--round-width", "1000", "--no-refit"], r"--round-width 1000 rounds the MoRE width"),
    (["--ranks", "8", "--fixed-width", "3", "--peer-heads", "3"],
     r"--ranks and --fixed-width are read only with --sweep rank; --peer-heads is read only "
     r"with --peer; add --sweep rank and --peer or drop them$"),
    (["--peer-dq", "4"], r"--peer-dq is read only with --peer; add --peer or drop it$"),
])
def test_plan_refuses_what_it_would_ignore_or_cannot_honour(capsys, extra, match):
    fails(capsys, [*PLAN, *extra], match)


def test_plan_budget_with_experts_and_a_round_width_that_fits(capsys):
    fails(capsys, ["plan", "--hidden", "64", "--top-k", "4", "--rank", "16", "--budget",
                   "30000", "--experts", "3"],
          r"--experts 3 sets the reference MoE of --width, and --budget gives none")
    out = run_json(capsys, [*PLAN, "--round-width", "11"])        # the largest that fits
    assert out["more"]["width"] == 11 and out["more"]["flops"] <= out["budget"]
    fails(capsys, ["plan", "--hidden", "64", "--top-k", "4", "--rank", "16", "--budget",
                   "30000", "--round-width", "16"],
          r"rounds the MoRE width 7.8 to 16, wider than the 15 that tau = 30,000 .*at most 15$")
    out = run_json(capsys, [*PLAN, "--sweep", "rank", "--ranks", "16,8", "--fixed-width", "4",
                            "--peer", "--peer-heads", "2"])
    assert [l["rank"] for l in out["sweep"]["layers"]] == [16, 8] and out["peer"]["heads"] == 2
    # the default ranks are those whose router leaves room for k experts (up to 37 here):
    # the user gave no --ranks to blame; a given rank that does not fit is named
    out = run_json(capsys, [*PLAN, "--sweep", "rank"])
    assert [l["rank"] for l in out["sweep"]["layers"]] == [16, 32]
    fails(capsys, [*PLAN, "--sweep", "rank", "--ranks", "16,128"],
          r"--ranks 128 must be at most --hidden 64")
    fails(capsys, [*PLAN, "--sweep", "rank", "--ranks", "16,64"],
          r"--ranks 64: a rank-64 router at expert width s = 6 \(the planned MoRE width\) "
          r"leaves room for fewer than k = 4 experts within tau = 24,576; give ranks up to 37$")
    fails(capsys, [*PLAN, "--sweep", "rank", "--fixed-width", "40"],
          r"the default ranks from 16: .* s = 40 \(--fixed-width\) .*; no rank fits: give a "
          r"smaller --fixed-width$")


# ------------------------------------------------------------------ theory rank


RANK = ["theory", "rank", "--top-k", "2", "--no-progress", "--ranks", "2"]


@pytest.mark.parametrize("extra, match", [
    (["--weights", "W", "--experts", "100", "--hidden", "3", "--tokens", "50"],
     r"--experts and --hidden are not read: the router's M and h are those of --weights; "
     r"drop them$"),
    (["--experts", "8", "--hidden", "6", "--weights-key", "a"],
     r"--weights-key is not read: it names a tensor in --weights, not given; drop it$"),
    (["--weights", "W", "--inputs", "X6", "--tokens", "50"],
     r"--tokens is not read: the tokens are those of --inputs; drop it$"),
    (["--weights", "W", "--inputs-key", "a"], r"--inputs-key is not read: .*; drop it$"),
    (["--weights", "W", "--inputs", "X5"],
     r"--inputs \S+x5.pt: tokens of h = 5 \(shape \(10, 5\)\) for a router of h = 6 "
     r"\(--weights \S+w.pt\); give tokens \(N, 6\)$"),
    (["--experts", "8", "--hidden", "6", "--inputs", "X5"],
     r"--inputs \S+x5.pt: tokens of h = 5 .* for a router of h = 6 \(--hidden\)"),
    (["--weights", "DIR"], r"--weights \S+adir is a folder; give a .safetensors or torch file$"),
    (["--experts", "8", "--hidden", "6", "--inputs", "DIR"], r"--inputs \S+adir is a folder"),
])
def test_theory_rank_names_flags_it_would_ignore_and_files_that_do_not_fit(capsys, tmp_path,
                                                                          extra, match):
    import torch
    files = {"W": tmp_path / "w.pt", "X5": tmp_path / "x5.pt", "X6": tmp_path / "x6.pt",
             "DIR": tmp_path / "adir"}
    for key, shape in (("W", (8, 6)), ("X5", (10, 5)), ("X6", (10, 6))):
        torch.save(torch.randn(*shape), files[key])
    files["DIR"].mkdir()
    fails(capsys, [*RANK, *(str(files[a]) if a in files else a for a in extra)], match)


def test_theory_rank_routes_the_inputs_through_a_trained_router(capsys, tmp_path):
    import torch
    torch.save(torch.randn(8, 6), tmp_path / "w.pt")
    torch.save(torch.randn(10, 6), tmp_path / "x.pt")
    out = run_json(capsys, [*RANK, "--weights", str(tmp_path / "w.pt"), "--inputs",
                            str(tmp_path / "x.pt")])
    assert (out["experts"], out["hidden"], out["tokens"]) == (8, 6, 10)
    assert run_json(capsys, [*RANK, "--experts", "8", "--hidden", "6"])["tokens"] == 20_000


# ------------------------------------------------------------------ phonebook's model


@pytest.mark.parametrize("argv, match", [
    (["train", "--size", "10", "--hidden", "1", "--rank", "1"],
     r"--hidden 1 over 1 head \(the default, h/32; --heads sets them\) gives a head dim of 1: "
     r"rotary positions need an even head dim; give an even --hidden$"),
    (["train", "--size", "10", "--hidden", "2", "--rank", "1", "--heads", "2"],
     r"--hidden 2 over --heads 2 gives a head dim of 1: .*; give --heads so that --hidden / "
     r"--heads is even$"),
    (["train", "--size", "10", "--hidden", "100"],
     r"--hidden 100 does not split over 3 heads \(the default, h/32; --heads sets them\); "
     r"give --heads that divides --hidden$"),
    (["train", "--size", "10", "--moe-experts", "1", "--top-k", "2"],
     r"--top-k 2 must be at most --moe-experts 1 .*; give a smaller --top-k or a larger "
     r"--moe-experts$"),
    (["train", "--size", "10", "--arch", "more", "--more-experts", "1", "--top-k", "2"],
     r"--top-k 2 must be at most --more-experts 1"),
    (["sweep", "--over", "hidden", "--values", "32,33", "--size", "10"],
     r"--over hidden --values 33: --hidden 33 over 1 head .* gives a head dim of 33"),
    (["train", "--size", "10", "--arch", "moe", "--more-experts", "64"],
     r"--more-experts sets the MoRE model, which --arch moe does not train; drop "
     r"--more-experts or give --arch both$"),
    (["capacity", "--sizes", "10,30", "--arch", "more", "--moe-experts", "8"],
     r"--moe-experts sets the MoE model, which --arch more does not train"),
    (["train", "--size", "10", "--arch", "peer", "--more-width", "8"],
     r"--more-width sets the MoRE model, which --arch peer does not train"),
])
def test_phonebook_model_errors_name_the_flags(capsys, tmp_path, no_training, argv, match):
    out = tmp_path / "out"
    fails(capsys, ["phonebook", *argv, "--out", str(out)], match)
    assert not out.exists()


# ------------------------------------------------------------------ demo


def test_demo_refuses_two_limits(capsys, tmp_path, no_training):
    out = tmp_path / "out"
    fails(capsys, ["demo", "--steps", "2", "--max-epochs", "5", "--device", "cpu", "--out",
                   str(out)],
          r"--steps 2 replaces the epoch limit, so --max-epochs 5 would not be read; give one "
          r"of them$")
    assert not out.exists()
