"""The hypercube construction of the paper's load-balancing Proposition, through the
library's router: top-1 is the sign pattern of z, and the loads stay within the bound."""
import math

import pytest
import torch

from cli_checks import fails
from moremoe.cli import main
from moremoe.eval.theory import hypercube_check, hypercube_router, load_bound
from moremoe.ops.router_lowrank import router_lowrank


def test_top1_is_the_sign_pattern_of_z():
    R1, R2 = hypercube_router(5, hidden=9)
    x = torch.randn(500, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # float64: the runner-up is 2 min|z_l| / sqrt(r) below the winner, tiny for some rows
    idx = router_lowrank(x, R1.double(), R2.double(), 1, impl="reference")[1][:, 0]
    bits = (x[:, :5] > 0).long()                        # a_l = +1 <-> bit l set
    assert torch.equal(idx.long(), (bits << torch.arange(5)).sum(1))


def test_loads_within_the_bound_and_balanced():
    out = hypercube_check(4, 3, 30_000, seed=3)
    assert sum(out["counts"]) == 30_000 * 3 and len(out["counts"]) == 16
    assert out["max_deviation"] <= out["bound"] and out["within_bound"]
    assert out["bound"] == pytest.approx(math.sqrt(2 * 30_000 * 3 * math.log(3200) / 16)
                                         + 2 * math.log(3200) / 3)
    assert out["hnorm"] > 0.999


def test_bound_matches_the_issue_check():
    assert load_bound(200_000, 4, 64, 0.01) == pytest.approx(492.5, abs=0.1)


def test_cli_json_plot_and_errors(capsys, tmp_path):
    plot = tmp_path / "hc.png"
    assert main(["theory", "hypercube", "--rank", "3", "--top-k", "2", "--tokens", "4000",
                 "--plot", str(plot), "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["experts"] == 8 and out["within_bound"] and plot.stat().st_size > 10_000
    fails(capsys, ["theory", "hypercube", "--rank", "3", "--top-k", "2", "--plot", str(plot)],
          r"--plot .*hc.png exists; give another name or --force")
    fails(capsys, ["theory", "hypercube", "--rank", "3", "--experts", "10", "--top-k", "2"],
          r"--experts must be 2\^--rank = 8")
    fails(capsys, ["theory", "hypercube", "--rank", "3", "--top-k", "9"],
          r"--top-k must be in \[1, M=8\], got 9")
    fails(capsys, ["theory", "hypercube", "--rank", "4", "--hidden", "3", "--top-k", "2"],
          r"--hidden must be >= --rank=4, got 3")


def test_rank_agreement_full_rank_svd_is_exact_and_overlap_grows():
    from moremoe.eval.theory import rank_agreement
    g = torch.Generator().manual_seed(0)
    W, x = torch.randn(40, 24, generator=g), torch.randn(3000, 24, generator=g)
    rows = rank_agreement(W, x, 3, [2, 8, 24], methods=("svd", "jl"))
    svd = {r["rank"]: r for r in rows if r["method"] == "svd"}
    assert svd[24]["set_preserved"] == 1.0 and svd[24]["rel_error"] < 1e-5
    assert svd[2]["mean_overlap"] < svd[8]["mean_overlap"] < svd[24]["mean_overlap"]
    assert {r["method"] for r in rows} == {"svd", "jl"}


def test_rank_bounds_shapes():
    from moremoe.eval.theory import rank_bounds
    b = rank_bounds(256, 4, bits=8)
    log_f = math.log(math.comb(256, 4))
    assert b["sufficient_jl"] == pytest.approx(4 * math.log(256 + math.comb(256, 4)))
    assert b["necessary_counting"] == pytest.approx(log_f / math.log(1 + 2 ** 9))


def test_rank_cli_with_a_trained_router_file(capsys, tmp_path):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "router.safetensors"
    save_file({"layers.0.gate.weight": torch.randn(32, 16, generator=g),
               "layers.1.gate.weight": torch.randn(32, 16, generator=g)}, str(path))
    fails(capsys, ["theory", "rank", "--weights", str(path), "--top-k", "2"],
          r"holds 2 2-D tensors; name one with --weights-key")
    assert main(["theory", "rank", "--weights", str(path), "--weights-key",
                 "layers.1.gate.weight", "--top-k", "2", "--tokens", "500", "--ranks", "4,16",
                 "--method", "svd", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["rows"]] == [4, 16] and out["experts"] == 32
    assert out["rows"][1]["set_preserved"] == 1.0                  # r = h = 16: exact
    fails(capsys, ["theory", "rank", "--weights", str(path), "--weights-key", "nope",
                   "--top-k", "2"], r"--weights-key 'nope' is not in")
    fails(capsys, ["theory", "rank", "--experts", "8", "--hidden", "4", "--top-k", "2",
                   "--ranks", "5"], r"--ranks must be in \[1, min\(M, h\) = 4\], got \[5\]")
    fails(capsys, ["theory", "rank", "--top-k", "2"], r"needs --experts and --hidden")
