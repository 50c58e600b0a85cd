"""`moremoe bench router --sweeps tune` and `bench experts --tune` (bench/tune.py) time each
block configuration beside the default on the same inputs: rows carry the overrides, the
speedup over the default, the low-rank router's agreement with the exact sweep, and an
error for a configuration the GPU cannot run (never for the default). CPU: Triton
interpreter, each call run once instead of timed."""
import json

import pytest
import torch

pytest.importorskip("triton")
from moremoe.bench import tune  # noqa: E402
from moremoe.cli import main  # noqa: E402


@pytest.fixture
def timings(monkeypatch):
    """time_ms runs the call once and reports the next of the times the test gives."""
    times = []

    def fake(fn, *, device, **kw):
        fn()
        return times.pop(0)
    monkeypatch.setattr(tune, "time_ms", fake)
    return times


def _rows(capsys, argv):
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def test_router_tune_rows(capsys, tmp_path, timings):
    timings += [2.0, 1.0, 4.0, 0.5, 2.0, 1.0]
    rows = _rows(capsys, ["bench", "router", "--quick", "--no-training", "--sweeps", "tune",
                          "--out", str(tmp_path / "router.jsonl")])
    lazy, eager = {"path": "buffer", "rounds": "lazy"}, {"path": "buffer", "rounds": "eager"}
    assert [(r["router"], r["config"]) for r in rows] == [
        ("lowrank", {}), ("lowrank", {"C": 0}), ("lowrank", lazy), ("lowrank", eager),
        ("linear", {}), ("linear", {"BM": 64})]
    for r in rows:
        assert r["bench"] == "router" and r["sweep"] == "tune" and r["impl"] == "triton"
        for key in ("device", "torch", "triton", "commit", "date", "ms", "flops", "bytes"):
            assert key in r, key
    # the one-pass selection's experts are the exact sweep's too
    assert [r["same_as_exact"] for r in rows if r["router"] == "lowrank"] == [True] * 4
    assert [r["speedup_vs_default"] for r in rows] == [1.0, 2.0, 0.5, 4.0, 1.0, 2.0]


def test_experts_tune_rows(capsys, tmp_path, timings):
    """Each configuration at uniform routing, then at Zipf-skewed routing (hot experts)."""
    timings += [2.0, 4.0, 1.0, 2.0] * 2     # forward, backward of the default, then BM=32
    rows = _rows(capsys, ["bench", "experts", "--quick", "--tune",
                          "--out", str(tmp_path / "experts.jsonl")])
    assert [(r["routing"], r["config"], r["phase"]) for r in rows] == [
        (routing, *case) for routing in ("uniform", "zipf") for case in (
            ({}, "forward"), ({}, "backward"), ({"BM": 32}, "forward"),
            ({"BM": 32}, "backward"))]
    for r in rows:
        assert r["bench"] == "experts" and r["sweep"] == "tune" and r["weights"] == "bfloat16"
        assert r["floor_ms"] is None or r["floor_ms"] > 0
    assert [r["speedup_vs_default"] for r in rows] == [1.0, 1.0, 2.0, 2.0] * 2


def test_zipf_routing_has_hot_experts_and_distinct_experts_a_row():
    from moremoe.bench.layer import LayerPoint
    p = LayerPoint(16, 64, s=16, N=4000)
    _, _, idx, _ = tune._expert_inputs(p, torch.float32, torch.device("cpu"), "zipf")
    assert all(len(set(r)) == p.k for r in idx.tolist())
    counts = torch.bincount(idx.reshape(-1).long(), minlength=p.M).float()
    assert counts.max() > 4 * counts.mean()          # uniform: about the mean


def test_a_configuration_that_cannot_run_is_an_error_row_but_the_default_raises():
    def fail():
        raise RuntimeError("out of resource: shared memory, Required: 262144\nmore")
    cpu = torch.device("cpu")
    assert tune._timed(fail, {"BM": 256}, cpu) == {
        "ms": None, "error": "RuntimeError: out of resource: shared memory, Required: 262144"}
    with pytest.raises(RuntimeError):
        tune._timed(fail, {}, cpu)


def test_dw_only_configurations_time_the_backward_alone():
    assert tune._dw_only({"dw_BR": 32}) and not tune._dw_only({}) and not tune._dw_only(
        {"BM": 64, "dw_BR": 32})
