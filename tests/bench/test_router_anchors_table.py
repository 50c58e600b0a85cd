"""benchmarks/router_anchors_table.py: our router's rows beside the anchor programs', shape
by shape, with issue 54's targets; files of two devices refused."""
import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "router_anchors_table.py"
spec = importlib.util.spec_from_file_location("router_anchors_table", PATH)
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)

N = 262_144


def ours(h, M, k, impl, ms, device="NVIDIA H200", **kw):
    return {"bench": "router", "phase": "inference", "router": "lowrank", "impl": impl,
            "h": h, "M": M, "k": k, "r": 64, "N": N, "ms": ms, "device": device, **kw}


def anchor(v, h, M, k, ms, **cfg):
    return {"v": v, "h": h, "M": M, "k": k, "N": N, "r": 64, "cfg": cfg, "ms": ms}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_table_pairs_shapes_takes_each_familys_fastest_and_checks_the_targets(
        tmp_path, capsys):
    router = write(tmp_path / "router.jsonl", [
        ours(512, 8192, 4, "triton", 1.15, floor_ms=0.403), ours(512, 8192, 4, "alg1", 4.8),
        ours(512, 8192, 4, "unfused", 21.5),
        ours(512, 512, 4, "triton", 0.36),
        ours(512, 8192, 4, "triton", 1.6, phase="training"),       # not inference: left out
        ours(512, 2048, 4, "triton", 0.6),
        # the tune sweep: a tuned row is not the default; the candidates pass's rows apart
        ours(512, 8192, 4, "triton", 0.9, sweep="tune", config={"C": 3}),
        ours(512, 8192, 4, "triton", 1.45, sweep="tune", config={"path": "candidates"}),
        ours(512, 8192, 4, "triton", 1.25, sweep="tune",
             config={"path": "candidates", "cand_stages": 2})])
    fast = write(tmp_path / "fast.jsonl", [
        {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6"},
        anchor("top2f_ifr", 512, 8192, 4, 1.33, BN=64), anchor("top2f_ifr", 512, 8192, 4, 1.31),
        anchor("floor_maxonly", 512, 8192, 4, 0.6), anchor("alg1", 512, 8192, 4, 4.6),
        anchor("top2f_ifr", 512, 512, 4, 0.185),
        {"skipped": {"h": 2048, "M": 8192, "k": 4}, "reason": "time budget"}])
    rows = {(r["h"], r["M"], r["k"]): r for r in table.join(table._lines(router),
                                                            table._lines(fast))}
    big = rows[(512, 8192, 4)]
    assert (big["ours_ms"], big["prototype_ms"], big["anchor_alg1_ms"], big["alg1_ms"]) == \
        (1.15, 1.31, 4.6, 4.8)                                 # the floor row is no router
    assert big["ours_over_prototype"] == pytest.approx(1.15 / 1.31) and big["meets"] is True
    assert big["candidates_ms"] == 1.25 and rows[(512, 512, 4)]["candidates_ms"] is None
    small = rows[(512, 512, 4)]
    assert small["target_ms"] == 0.20 and small["meets"] is False     # 0.36 > 0.185, 0.20
    assert rows[(512, 2048, 4)]["prototype_ms"] is None and rows[(512, 2048, 4)]["meets"]
    assert table.main([str(router), str(fast)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| h | M | k | ours | candidates | prototype") and len(out) == 2 + 3
    assert "| 512 | 512 | 4 | 0.360 | - | 0.185 | 1.95 |" in out[2]
    assert out[2].endswith("| 0.200 | **no** |")


def test_files_of_two_devices_or_not_json_are_named(tmp_path):
    router = write(tmp_path / "router.jsonl", [ours(512, 512, 4, "triton", 0.3,
                                                    device="NVIDIA H100 80GB HBM3")])
    fast = write(tmp_path / "fast.jsonl", [{"device": "NVIDIA H200"},
                                           anchor("top2f_ifr", 512, 512, 4, 0.2)])
    with pytest.raises(SystemExit, match="rows of 2 devices"):
        table.main([str(router), str(fast)])
    (tmp_path / "bad.jsonl").write_text("{}\nnot json\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:2 is not a JSON line"):
        table.main([str(tmp_path / "bad.jsonl"), str(fast)])
    with pytest.raises(SystemExit, match="no such file"):
        table.main([str(tmp_path / "missing.jsonl"), str(fast)])


def test_bench_router_times_ours_at_every_shape_the_prototype_runs():
    """The prototype's shapes (the anchor's cases: issue 54's table and k = 8 at three M)
    are all in bench router's M and k sweeps, so the table has ours beside each."""
    from moremoe.bench.router import SWEEPS
    grid = {(p.h, p.M, p.k, p.r) for name in ("M", "k") for p in SWEEPS[name]}
    for h, M, k in [(512, 512, 4), (512, 2048, 4), (512, 8192, 4), (2048, 8192, 4),
                    (512, 512, 8), (512, 2048, 8), (512, 8192, 8)]:
        assert (h, M, k, 64) in grid, (h, M, k)
