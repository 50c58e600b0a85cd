"""Hostile inputs on theory, phonebook, demo, flops, plan, hf export and the parallel run
options: one line that names the argument or file and what to do, earlier outputs kept
unless --force, and sizes that cannot fit refused before anything is allocated."""
import json
import os

import pytest
import torch

from cli_checks import fails
from moremoe.cli import main

MODEL = ["--hidden", "32", "--width", "8", "--rank", "4", "--layers", "1", "--batch-size", "16",
         "--lr", "3e-3", "--max-steps", "1", "--eval-every", "1", "--eval-entries", "8",
         "--device", "cpu", "--no-progress"]
PB = ["--size", "40", *MODEL]
TRAIN = ["--preset", "tiny-moe", "--device", "cpu", "--set", "model.seq_len=64",
         "--set", "train.batch_size=4", "--set", "train.max_steps=1",
         "--set", "train.eval_batches=1"]


# ------------------------------------------------------------------ outputs and --force


WRITERS = [
    pytest.param(["phonebook", "sweep", "--over", "rank", "--values", "2", *PB],
                 ("sweep.json", "sweep.png"), id="phonebook-sweep"),
    pytest.param(["phonebook", "train", *PB], ("phonebook_train.json", "phonebook_train.png"),
                 id="phonebook-train"),
    pytest.param(["phonebook", "capacity", "--sizes", "40", *MODEL],
                 ("capacity.json", "capacity.png"), id="phonebook-capacity"),
    pytest.param(["demo", "--size", "16", "--steps", "1", "--device", "cpu", "--no-progress"],
                 ("demo.json", "demo.png"), id="demo"),
]


@pytest.mark.parametrize("argv, files", WRITERS)
def test_an_earlier_report_and_plot_are_kept_without_force(capsys, tmp_path, monkeypatch,
                                                           argv, files):
    import moremoe.phonebook.trainer as trainer
    import moremoe.phonebook.pool as pool

    def no_training(*args, **kwargs):
        raise AssertionError("training started before the outputs were checked")
    for module in (trainer, pool):
        monkeypatch.setattr(module, "PhonebookTrainer", no_training)
    out = tmp_path / "out"
    out.mkdir()
    for name in files:
        (out / name).write_text("earlier")
    fails(capsys, [*argv, "--out", str(out)],
          rf"--out {out} already holds {files[0]}, {files[1]} from an earlier run; give "
          rf"another folder or --force to replace them")
    (out / files[0]).unlink()
    fails(capsys, [*argv, "--out", str(out)], rf"already holds {files[1]} .*replace it$")
    assert (out / files[1]).read_text() == "earlier"


def test_sweep_with_force_replaces_the_earlier_sweep(capsys, tmp_path, monkeypatch):
    from dataclasses import asdict
    import moremoe.phonebook.trainer as trainer
    import moremoe.phonebook.pool as pool

    class Quick:                                  # the sweep's files, not its training
        def __init__(self, model_cfg, cfg, lr, *, name, **kwargs):
            self.done, self.total = False, 1
            self.step = type("S", (), {"steps": 1})()
            self.run = trainer.PhonebookRun(
                name=name, model=model_cfg.to_dict(), train=asdict(cfg), lr=cfg.lr,
                params_total=model_cfg.total_params(), flops_inference=1, flops_training=3,
                exact_match=cfg.seed / 10, hnorm=[0.5], history=[{"loss": 1.0,
                                                                   "exact_match": 0.0}])

        def advance(self, stop=None):
            pass

        def settle(self):
            self.done = True
            return True
    monkeypatch.setattr(pool, "PhonebookTrainer", Quick)
    out = tmp_path / "sweep"
    argv = ["phonebook", "sweep", "--over", "rank", "--values", "2", *PB, "--out", str(out),
            "--json"]
    assert main(argv) == 0
    assert {r["exact_match"] for r in json.loads((out / "sweep.json").read_text())["runs"]} == {0}
    capsys.readouterr()
    fails(capsys, argv, "already holds sweep.json, sweep.png")
    assert main([*argv, "--seed", "1", "--force"]) == 0
    assert {r["exact_match"] for r in json.loads((out / "sweep.json").read_text())["runs"]} \
        == {0.1}


# ------------------------------------------------------------------ theory rank --weights


def _saved(tmp_path, obj, name="router.pt"):
    torch.save(obj, tmp_path / name)
    return str(tmp_path / name)


def _nan_router():
    w = torch.randn(16, 8)
    w[3, 2] = float("nan")
    return w


def _inf_router():
    w = torch.randn(16, 8)
    w[0, 0] = float("inf")
    return {"gate.weight": w}


@pytest.mark.parametrize("obj, match", [
    ([1, 2, 3], r"--weights \S+ holds a list; it must hold the router as a 2-D tensor \(M, h\)"),
    ({"step": 3}, r"--weights \S+ holds no 2-D tensor; it must hold the router"),
    (_nan_router(), r"--weights \S+: the router has 1 non-finite entries \(NaN or inf\)"),
    (_inf_router(), r"--weights \S+: the router has 1 non-finite entries \(NaN or inf\)"),
    (torch.zeros(0, 8), r"--weights \S+: the tensor is empty \(shape \(0, 8\)\)"),
    (torch.zeros(16, 8), r"--weights \S+: the router is all zeros"),
    (torch.randn(16, 8).to(torch.complex64), r"expected real numbers, got a torch.complex64"),
])
def test_theory_rank_names_what_the_weights_file_must_hold(capsys, tmp_path, obj, match):
    fails(capsys, ["theory", "rank", "--weights", _saved(tmp_path, obj), "--top-k", "2",
                   "--tokens", "50"], match)


def test_theory_rank_inputs_with_nan_are_named(capsys, tmp_path):
    fails(capsys, ["theory", "rank", "--experts", "16", "--hidden", "8", "--top-k", "2",
                   "--inputs", _saved(tmp_path, _nan_router(), "x.pt")],
          r"--inputs \S+: the tokens have 1 non-finite entries")


# ------------------------------------------------------------------ sizes that cannot fit


def test_theory_rank_tokens_beyond_memory_name_tokens_and_the_range(capsys):
    line = fails(capsys, ["theory", "rank", "--experts", "16", "--hidden", "8", "--top-k", "2",
                          "--tokens", "1e30"],
                 r"--tokens: routing 1e\+30 tokens of h = 8 through a router of M = 16 needs "
                 r"at least [\d.e+,]+ GiB of memory and this machine has [\d.,]+ GiB; give "
                 r"--tokens in \[1, [\d,]+\]$")
    assert len(line) < 300


@pytest.mark.parametrize("argv, match", [
    (["theory", "rank", "--experts", "1e9", "--hidden", "1e9", "--top-k", "2"],
     r"a router of 1,000,000,000 x 1,000,000,000 \(M x h\) needs at least .* GiB"),
    (["theory", "hypercube", "--rank", "4", "--top-k", "2", "--hidden", "1e12"],
     r"hypercube router \(--rank 4: M = 16 experts, --hidden 1,000,000,000,000\) needs at "
     r"least [\d,]+ GiB .*; lower --hidden"),
    (["phonebook", "sweep", "--over", "experts", "--values", "100000000000", *PB, "--out", "OUT"],
     r"--over experts --values 100000000000: MoRE\(M=100000000000, .*\) x 1 layers .* needs "
     r"at least [\d,]+ GiB of memory and this machine has .*; give a smaller model"),
    (["phonebook", "train", *PB, "--layers", "1e9", "--out", "OUT"],
     r"x 1000000000 layers .* needs at least"),
    (["phonebook", "train", *PB, "--width", "1e9", "--out", "OUT"], r"needs at least .* GiB"),
    (["phonebook", "train", *PB, "--arch", "peer", "--peer-heads", "1e6", "--out", "OUT"],
     r"PEER-\d+ \(H=1000000, .* needs at least"),
])
def test_sizes_that_cannot_fit_are_refused_with_the_memory_they_need(capsys, tmp_path, argv,
                                                                     match):
    out = tmp_path / "out"
    fails(capsys, [str(out) if a == "OUT" else a for a in argv], match)
    assert not out.exists()


def test_hypercube_rank_20_routes_in_chunks_that_fit(capsys, monkeypatch):
    """r = 20 (inside the documented range) over 70,000 tokens asked for 275 GB of logits at
    once; the tokens now go through the router a few at a time."""
    import moremoe.eval.theory as theory
    seen = []

    def router(x, R1, R2, k, impl):
        seen.append(x.shape[0])
        assert x.shape[0] * R1.shape[0] * 4 <= 1 << 30, "a chunk of logits above 1 GiB"
        return None, torch.zeros(x.shape[0], k, dtype=torch.int64)
    monkeypatch.setattr(theory, "router_lowrank", router)
    assert main(["theory", "hypercube", "--rank", "20", "--tokens", "70000", "--top-k", "2",
                 "--json"]) in (0, 1)
    assert sum(seen) == 70_000
    assert json.loads(capsys.readouterr().out)["experts"] == 1 << 20


@pytest.mark.parametrize("argv, match", [
    (["theory", "rank", "--experts", "16", "--hidden", "8", "--top-k", "2", "--seed", "1e30"],
     r"argument --seed: expected an integer in \[0, \d+\], got '1e30'"),
    (["theory", "hypercube", "--rank", "4", "--top-k", "2", "--seed", "1e30"],
     r"argument --seed: expected an integer in \[0, \d+\]"),
    (["phonebook", "train", *PB, "--seed", "1e30"], r"argument --seed: expected an integer in"),
    (["theory", "hypercube", "--rank", "4", "--top-k", "2", "--delta", "5e-324"],
     r"--delta 4.94066e-324 is too small for the bound to be a number"),
    (["phonebook", "train", *PB, "--arch", "peer", "--peer-dq", "7"], r"--peer-dq 7 must be even"),
    (["demo", "--size", "12000000"], r"--size 12,000,000 exceeds the 11,881,376 unique"),
    (["plan", "--hidden", "64", "--width", "8", "--top-k", "4", "--rank", "400"],
     r"--rank 400 must be at most --hidden 64"),
    (["plan", "--hidden", "64", "--width", "8", "--top-k", "4", "--rank", "4", "--sweep", "rank",
      "--ranks", "16,100"], r"--ranks 100 must be at most --hidden 64"),
    (["plan", "--hidden", "64", "--width", "8", "--top-k", "4", "--rank", "4", "--peer",
      "--peer-dq", "7"], r"--peer-dq 7 must be even"),
    (["flops", "--experts", "8", "--top-k", "4", "--width", "8", "--hidden", "64", "--rank",
      "100"], r"--rank 100 must be at most --hidden 64"),
    (["flops", "--experts", "8", "--top-k", "4", "--width", "8", "--hidden", "64",
      "--kv-heads", "2"], r"total parameters need --layers, --vocab and --heads \(--kv-heads "
                          r"counts only in them\)"),
    (["flops", "--experts", "8", "--top-k", "4", "--width", "8", "--hidden", "64", "--layers",
      "2", "--vocab", "10", "--heads", "4", "--kv-heads", "3"], r"--kv-heads must divide "
                                                               r"--heads=4, got 3"),
])
def test_values_the_commands_took_or_broke_on_are_named(capsys, argv, match):
    fails(capsys, argv, match)


# ------------------------------------------------------------------ demo, hf export


def test_demo_labels_exact_match_with_the_entries_it_evaluates():
    """The phonebook's eval entries (1,000), or all of a smaller phonebook."""
    from moremoe.cli.demo import format_demo
    for size, label in ((512, "exact match (512 entries)"),
                        (5000, "exact match (1,000 entries)")):
        text = format_demo(_demo_result(size))
        assert label in text and text.count("exact match (") == 1


def _demo_result(size: int) -> dict:
    """run_demo's result, with the runs' records made up instead of trained."""
    from dataclasses import asdict
    from moremoe.cli.demo import DemoConfig
    from moremoe.nn import MoEConfig
    from moremoe.phonebook.trainer import (PhonebookRun, PhonebookTrainConfig,
                                            phonebook_model_config)
    runs = []
    for moe in (MoEConfig.moe(32, 4, 64, 8), MoEConfig.more(96, 4, 64, 8, 16)):
        model = phonebook_model_config(moe, layers=2)
        run = PhonebookRun(name=moe.name, model=model.to_dict(),
                           train=asdict(PhonebookTrainConfig(size=size, max_steps=1)), lr=1e-3,
                           params_total=model.total_params(), flops_inference=moe.active_flops(),
                           flops_training=moe.active_flops(training=True), hnorm=[0.9, 0.8])
        runs.append({**run.to_dict(), "router_seconds_per_token": 1e-8})
    return {"config": asdict(DemoConfig(size=size, steps=1).resolved()), "runs": runs,
            "device": "cpu", "torch": "2", "files": {"json": "demo.json", "png": "demo.png"}}


def test_hf_export_gives_every_file_the_same_permissions(capsys, tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import save_file
    from moremoe.model import Transformer, TransformerConfig
    from moremoe.nn import MoEConfig
    cfg = TransformerConfig(vocab=64, layers=1, heads=2, moe=MoEConfig.moe(4, 2, 16, 4),
                            max_seq_len=16)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(Transformer(cfg).state_dict(), str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "train": {}}))
    old = os.umask(0o022)
    try:
        assert main(["hf", "export", str(ckpt), str(tmp_path / "hf"), "--json"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


# ------------------------------------------------------------------ parallel run options


@pytest.mark.parametrize("value, match", [
    ("1", r"parallel.data must be one of ddp, fsdp, got 1$"),
    ("[fsdp]", r"parallel.data must be one of ddp, fsdp, got \['fsdp'\]"),
    ("null", r"parallel.data must be one of ddp, fsdp, got None"),
])
def test_parallel_data_values_name_the_choices(capsys, tmp_path, text_data, value, match):
    fails(capsys, ["train", "--data", str(text_data), "--out", str(tmp_path / "run"), *TRAIN,
                   "--set", f"parallel.data={value}"], match)


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0", "WORLD_SIZE": "two"}, r"environment variable WORLD_SIZE='two' must be an "
                                         r"integer; launch several processes with torchrun"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, r"environment variable RANK=3 must be in \[0, "
                                       r"WORLD_SIZE=2\)"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"RANK=0 and WORLD_SIZE=2 are set but the process group "
                                       r"cannot start \(.*MASTER_ADDR.*\); launch several"),
])
def test_a_launch_without_torchrun_is_named(capsys, tmp_path, text_data, monkeypatch, env,
                                           match):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fails(capsys, ["train", "--data", str(text_data), "--out", str(tmp_path / "run"), *TRAIN,
                   "--set", "parallel.data=fsdp"], match)
