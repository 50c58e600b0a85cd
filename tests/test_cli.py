"""The moremoe command line: tables, JSON, reports and plots, and its errors."""
import json
import subprocess
import sys

import pytest

from cli_checks import fails
from moremoe.cli import main


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_flops_json_keys_and_values(capsys):
    out = run_json(capsys, ["flops", "--experts", "1792", "--top-k", "4", "--hidden", "512",
                            "--width", "56", "--rank", "64", "--layers", "12", "--vocab",
                            "50257", "--heads", "8"])
    assert out["params_router"] == (1792 + 512) * 64
    assert out["params_experts"] == 3 * 1792 * 512 * 56
    assert out["flops_inference"] == 1572864 and round(out["flops_training"] / 1e6, 2) == 4.13
    assert abs(out["params_total"] - 1.91e9) / 1.91e9 < 0.02
    std = run_json(capsys, ["flops", "--experts", "256", "--top-k", "4", "--hidden", "512",
                            "--width", "64"])
    assert "params_total" not in std and std["params_router"] == 256 * 512


def test_flops_paper_model_gives_the_paper_totals(capsys):
    out = run_json(capsys, ["flops", "--experts", "1792", "--top-k", "4", "--width", "56",
                            "--rank", "64", "--paper-model", "h512", "--json"])
    assert out["params_total"] == 1_910_797_824 and out["hidden"] == 512     # paper: 1.91B
    out = run_json(capsys, ["flops", "--experts", "128", "--top-k", "4", "--width", "32",
                            "--paper-model", "h1024", "--json"])
    assert out["params_total"] == 286_977_024                                  # paper: 287.0M
    fails(capsys, ["flops", "--experts", "128", "--top-k", "4", "--width", "32", "--hidden",
                   "512", "--paper-model", "h1024"], r"--hidden=512 contradicts --paper-model")
    fails(capsys, ["flops", "--experts", "128", "--top-k", "4", "--width", "32"],
          r"--hidden is required")


def test_plan_rank_sweep_reproduces_the_papers_expert_counts(capsys):
    out = run_json(capsys, ["plan", "--hidden", "512", "--width", "64", "--experts", "256",
                            "--top-k", "4", "--rank", "64", "--round-width", "8",
                            "--sweep", "rank", "--json"])
    sweep = out["sweep"]
    assert sweep["width"] == 56                 # MoRE-1792's s' at MoE-256's tau
    assert [(l["rank"], l["experts"]) for l in sweep["layers"]] == [
        (16, 8704), (32, 4096), (64, 1792), (128, 640), (256, 64)]   # the paper's figure
    assert all(l["flops"] <= out["budget"] for l in sweep["layers"])


def test_plan_peer_both_readings(capsys):
    out = run_json(capsys, ["plan", "--hidden", "512", "--width", "64", "--experts", "256",
                            "--top-k", "4", "--rank", "64", "--round-width", "8", "--peer",
                            "--json"])
    peer = out["peer"]
    assert peer["experts"] == 388 ** 2                   # the paper's M = 150,544
    assert peer["paper"]["topk_per_head"] == 56 and peer["paper"]["active"] == 448
    assert peer["inference"]["topk_per_head"] == 4       # the consistent reading


def test_plan_budget_needs_no_width(capsys):
    tau = run_json(capsys, ["plan", "--hidden", "512", "--width", "64", "--top-k", "4",
                            "--rank", "64", "--json"])["budget"]
    out = run_json(capsys, ["plan", "--hidden", "512", "--top-k", "4", "--rank", "64",
                            "--budget", str(tau), "--json"])
    assert out["budget"] == tau
    fails(capsys, ["plan", "--hidden", "512", "--top-k", "4", "--rank", "64"],
          r"needs a reference MoE width --width s, or the active-FLOP budget --budget")


def test_flops_table_and_errors(capsys):
    assert main(["flops", "--experts", "32", "--top-k", "4", "--hidden", "64", "--width", "8"]) == 0
    text = capsys.readouterr().out
    assert "MoE-32" in text and "24,576" in text        # 6 k h s + 6 M h
    fails(capsys, ["flops", "--experts", "4", "--top-k", "5", "--hidden", "64", "--width", "8"],
          r"--top-k must be in \[1, --experts=4\], got 5")
    fails(capsys, ["flops", "--experts", "4", "--top-k", "2", "--hidden", "64", "--width", "8",
                   "--layers", "2"], "missing --vocab, --heads")
    fails(capsys, ["flops", "--experts", "0", "--top-k", "2", "--hidden", "64", "--width", "8"],
          "argument --experts: expected a positive integer, got '0'")


def test_plan(capsys):
    out = run_json(capsys, ["plan", "--hidden", "512", "--width", "64", "--top-k", "4",
                            "--rank", "64"])
    assert out["moe"]["experts"] == 256 and out["more"]["experts"] == 1792
    assert out["more"]["width"] == 56 and out["more"]["flops"] == out["moe"]["flops"]
    assert main(["plan", "--hidden", "64", "--width", "8", "--top-k", "4", "--rank", "16",
                 "--round-width", "8", "--no-refit"]) == 0
    text = capsys.readouterr().out
    assert "MoE-32" in text and "MoRE-96" in text and "3.00x the experts" in text
    fails(capsys, ["plan", "--hidden", "512", "--top-k", "1", "--rank", "64",
                   "--budget", "100"], "does not cover the low-rank projection")


TINY = ["--size", "48", "--hidden", "32", "--width", "8", "--rank", "4", "--layers", "1",
        "--batch-size", "16", "--lr", "3e-3", "--max-steps", "12", "--eval-every", "6",
        "--eval-entries", "20", "--device", "cpu", "--no-progress"]


def test_phonebook_train_writes_report_and_plot(capsys, tmp_path):
    out = run_json(capsys, ["phonebook", "train", *TINY, "--out", str(tmp_path)])
    assert [r["model"]["moe"]["rank"] for r in out["runs"]] == [None, 4]
    assert out["runs"][0]["model"]["moe"]["experts"] == 32       # k s
    # the paper's convention: M' of the optimum, s' rounded to a multiple of 8
    assert out["runs"][1]["model"]["moe"]["experts"] == 240      # (tau - 6 h r) / (12 r)
    assert out["runs"][1]["model"]["moe"]["width"] == 8
    for run in out["runs"]:
        assert [h["step"] for h in run["history"]] == [6, 12]
        assert len(run["hnorm"]) == 1
    saved = json.loads((tmp_path / "phonebook_train.json").read_text())
    assert saved["runs"] == out["runs"]
    assert (tmp_path / "phonebook_train.png").stat().st_size > 10_000
    assert out["runs"][1]["model"]["moe"]["router_init"] == "variance_matched"


def test_phonebook_router_init_ablation(capsys, tmp_path):
    out = run_json(capsys, ["phonebook", "train", *TINY, "--arch", "more", "--router-init",
                            "default", "--out", str(tmp_path)])
    assert [r["model"]["moe"]["router_init"] for r in out["runs"]] == ["default"]


def test_phonebook_sweeps(capsys, tmp_path):
    out = run_json(capsys, ["phonebook", "sweep", "--over", "rank", "--values", "2,4", *TINY,
                            "--out", str(tmp_path / "rank")])
    runs = [(r["value"], r["arch"], r["model"]["moe"]["rank"]) for r in out["runs"]]
    assert runs == [(2, "moe", None), (2, "more", 2), (4, "more", 4)]   # the MoE once
    assert (tmp_path / "rank" / "sweep.png").stat().st_size > 10_000
    out = run_json(capsys, ["phonebook", "sweep", "--over", "hidden", "--values", "32,64",
                            *TINY, "--out", str(tmp_path / "hidden")])
    assert [(r["value"], r["arch"], r["model"]["moe"]["hidden"]) for r in out["runs"]] == [
        (32, "moe", 32), (32, "more", 32), (64, "moe", 64), (64, "more", 64)]
    fails(capsys, ["phonebook", "sweep", "--over", "experts", "--values", "2", *TINY],
          r"--over experts --values 2: --top-k 4 must be at most --more-experts 2")


def test_phonebook_capacity(capsys, tmp_path):
    out = run_json(capsys, ["phonebook", "capacity", "--sizes", "8,16", "--arch", "more",
                            *TINY[2:], "--threshold", "0.5", "--out", str(tmp_path)])
    (res,) = out["results"]
    assert res["sizes"] == [8, 16] and 1 <= len(res["trials"]) <= 2
    assert (tmp_path / "capacity.png").exists() and (tmp_path / "capacity.json").exists()


def test_demo_small(capsys, tmp_path):
    assert main(["demo", "--size", "32", "--steps", "4", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for needle in ("MoE-32", "MoRE-112", "exact match", "H_norm per layer",
                   "router time per token", "total parameters", "memorised (exact match >= 0.9)",
                   "Neither memorises the 32 entries within 4 steps"):
        assert needle in text
    data = json.loads((tmp_path / "demo.json").read_text())
    assert len(data["runs"]) == 2 and data["runs"][1]["router_seconds_per_token"] > 0


def test_help_for_every_command(capsys):
    # the module's entry point once, in a process of its own; the commands in this one
    # (a fresh interpreter costs seconds of imports each)
    r = subprocess.run([sys.executable, "-m", "moremoe.cli", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "usage: moremoe" in r.stdout
    for argv in (["flops", "--help"], ["plan", "--help"], ["phonebook", "--help"],
                 ["phonebook", "train", "--help"], ["phonebook", "capacity", "--help"],
                 ["demo", "--help"], ["theory", "hypercube", "--help"],
                 ["theory", "rank", "--help"], ["convert-router", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0 and "usage: moremoe" in capsys.readouterr().out, argv


def test_bench_router_quick_code_path(capsys, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "router.jsonl"
    data = run_json(capsys, ["bench", "router", "--quick", "--no-training", "--out", str(out)])
    rows = data["rows"]
    assert {(r["router"], r["impl"]) for r in rows} == {
        ("lowrank", "triton"), ("lowrank", "unfused"), ("lowrank", "alg1"),
        ("linear", "triton"), ("linear", "unfused")}
    fused = [r for r in rows if r["impl"] == "triton"]
    assert all(r["speedup_vs_unfused"] > 0 for r in fused)       # timed in the same run
    assert all(r["speedup_vs_alg1"] > 0 for r in fused if r["router"] == "lowrank")
    for row in rows:
        for key in ("device", "torch", "triton", "commit", "date", "ms", "flops", "bytes"):
            assert key in row, key
    assert len(out.read_text().splitlines()) == len(rows)


def test_bench_router_plots_from_committed_results(tmp_path):
    import shutil
    from pathlib import Path
    src = Path(__file__).parents[1] / "benchmarks/results/nvidia-h100-80gb-hbm3/router.jsonl"
    shutil.copy(src, tmp_path / "router.jsonl")
    assert main(["bench", "router", "--plot-only", str(tmp_path / "router.jsonl")]) == 0
    assert (tmp_path / "router_M.png").stat().st_size > 50_000


def test_bench_experts_shapes_are_each_users_own_once(capsys):
    """--shapes: the paper's points, every training preset's expert shape at its micro-batch
    (one point for a shape two presets share), the study pair's and the phonebook's."""
    from moremoe.cli.bench_points import EXPERT_SHAPES, expert_points
    every = expert_points(EXPERT_SHAPES)
    shapes = [(p.h, p.M, p.s, p.k, p.N) for _, p in every]
    assert len(shapes) == len(set(shapes)) == 18
    pts = {label: p for label, p in every if label != "paper"}
    assert (512, 1792, 56, 4, 65536) == next((p.h, p.M, p.s, p.k, p.N) for label, p in
                                             pts.items() if "h512-s64-more1792" in label)
    shared = next(label for label in pts if "h512-s64-more1792" in label)
    assert "h512-s56-moe1792" in shared                     # the same expert shape
    assert pts["study more-1920"].s == 60 and pts["study moe-256"].h == 256
    assert pts["phonebook MoRE-96"] == type(pts["phonebook MoRE-96"])(64, 96, s=8, k=4,
                                                                      N=16384)
    assert sum(1 for label, _ in expert_points(["paper"])) == 5
    assert not any(label.startswith("phonebook") for label, _ in expert_points(["presets"]))
    fails(capsys, ["bench", "experts", "--shapes", "presets,nope"],
          r"--shapes got 'presets,nope', expected a comma-separated subset of paper, "
          r"presets, study, phonebook")


@pytest.mark.parametrize("name", ["layer", "decode", "experts", "model"])
def test_bench_layer_decode_experts_quick_code_paths(capsys, tmp_path, name):
    pytest.importorskip("triton")
    out = tmp_path / f"{name}.jsonl"
    data = run_json(capsys, ["bench", name, "--quick", "--out", str(out)])
    assert data["rows"] and len(out.read_text().splitlines()) == len(data["rows"])
    for row in data["rows"]:
        assert row["bench"] == name and "commit" in row and "device" in row
    if name == "layer":
        variants = {r["variant"] for r in data["rows"]}
        assert {"moe_unfused", "moe_fused", "more_fused", "more_unfused",
                "moe_grouped_mm"} <= variants
    if name == "experts":
        assert {(r["variant"], r["phase"]) for r in data["rows"]} == {
            ("experts", "forward"), ("experts", "backward"), ("experts", "forward+backward"),
            ("grouped_mm", "forward"), ("grouped_mm", "forward+backward")}
        assert {r["shape"] for r in data["rows"]} == {"quick"}
        assert not any("kernel_time" in r for r in data["rows"])    # no device kernels on a CPU
    if name == "model":        # a tiny pair, both phases, components that add up to the total
        rows = data["rows"]
        assert {(r["kind"], r["phase"], r.get("mode")) for r in rows} == {
            (k, p, m) for k in ("moe", "more") for p, m in (
                ("prefill", None), ("decode", "eager"), ("decode", "captured"),
                ("decode", "compiled"))}
        assert all(r["step_bytes"] > 0 for r in rows if r["phase"] == "decode")
        for r in rows:         # every block's spans were recorded (a missed hook gives 0)
            if r.get("mode") in ("captured", "compiled"):      # a graph replay has none
                assert r["components"] is None
                continue
            parts = r["components"]
            assert set(parts) == {"attention", "router", "experts", "rest"}
            assert min(parts["attention"], parts["router"], parts["experts"]) > 0
            assert parts["rest"] >= 0 and r["tokens_per_s"] > 0
        assert (out.parent / "model.png").exists()
    if name == "decode":       # the floor's bytes: touched experts, router, x and y
        for r in data["rows"]:
            assert 1 <= r["experts_touched"] <= min(r["M"], r["B"] * r["k"])
            assert r["bytes"] > 2 * 3 * r["experts_touched"] * r["h"] * r["s"]
