"""`moremoe bench ep`: the quick run over two gloo processes (Triton's interpreter) covers
every flow, variant and pass with tagged rows written by rank 0 only, the link's rates on
every row, the plot and the targets; the targets and the plot read the newest rows; a run without torchrun is a
one-line error."""
import json
import os
import socket

import pytest

from cli_checks import fails
from procs import spawn_bounded
from moremoe.bench.ep import VARIANTS, plan_points, QUICK
from moremoe.bench.ep_plots import TARGET_M, render_ep, summary_text, targets
from moremoe.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out, stdout, oom_rank=None):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import contextlib
    import io
    if rank == oom_rank:        # out of memory where the others wait in a collective
        import torch
        from moremoe.bench import ep

        def comm(self):         # the phase builds; its call runs out of memory
            def fn():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            return fn
        ep.Phases.comm = comm
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        code = main(["bench", "ep", "--quick", "--out", out, "--json", "--no-progress"])
    with open(f"{stdout}.{rank}", "w") as f:
        f.write(json.dumps({"code": code, "out": buf.getvalue(), "err": err.getvalue()}))


def test_quick_run_on_two_gloo_ranks(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "ep.jsonl"
    spawn_bounded(_rank, (2, _free_port(), str(out), str(tmp_path / "stdout")), 2, 600)
    r0, r1 = (json.loads((tmp_path / f"stdout.{r}").read_text()) for r in (0, 1))
    assert r0["code"] == r1["code"] == 0 and r1["out"] == ""          # rank 0 speaks
    data = json.loads(r0["out"])
    rows = data["rows"]
    assert len(out.read_text().splitlines()) == len(rows) == len(list(plan_points(QUICK)))
    assert {(r["flow"], r["variant"], r["phase"]) for r in rows} == {
        (f, v, p) for f in ("a", "b", "one_gpu") for v in VARIANTS
        for p in ("forward", "forward+backward") if (v != "more_sharded" or f == "a") and (
            v != "more_one_chunk" or (f != "one_gpu" and p == "forward"))}
    for r in rows:
        assert r["bench"] == "ep" and r["E"] == 2 and r["ms"] > 0 and not r["oom"]
        for key in ("device", "torch", "triton", "commit", "date", "router_ms",
                    "experts_ms", "comm_ms", "wire_bytes", "N", "M", "h", "s", "k",
                    "link_peer_copy_gbps"):
            assert key in r, key
        assert r["link_bytes"] == QUICK.link_bytes and r["link_peer_copy_gbps"] is None
        assert r["link_send_recv_gbps"] > 0 and r["link_all_to_all_gbps"] > 0     # gloo
        assert (r["comm_ms"] == 0) == (r["flow"] == "one_gpu")
        assert r["chunks"] == (None if r["flow"] == "one_gpu" else
                               1 if r["variant"] == "more_one_chunk" else 2)
    sharded = [r for r in rows if r["variant"] == "more_sharded"]
    assert all(r["merge_ms"] > 0 for r in sharded)
    assert data["plots"] == [str(tmp_path / "ep.png")] and (tmp_path / "ep.png").exists()


def test_without_torchrun_it_says_how_to_launch(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    fails(capsys, ["bench", "ep", "--quick"],
          r"bench ep runs one process per GPU: launch it with `torchrun --nproc_per_node E "
          r"-m moremoe.cli bench ep`")


def _row(flow, variant, ms, phase="forward", E=2, **kw):
    return {"bench": "ep", "flow": flow, "variant": variant, "phase": phase, "M": TARGET_M,
            "E": E, "ms": ms, "router_ms": ms / 2, "experts_ms": ms / 3, "comm_ms": ms / 6,
            **kw}


def test_targets_read_the_newest_rows():
    link = dict(link_bytes=128 << 20, link_peer_copy_gbps=400.0, link_send_recv_gbps=300.0,
                link_all_to_all_gbps=None)
    rows = [_row("a", "more", 9.0), _row("a", "more", 3.0), _row("a", "moe_torch", 10.0),
            _row("a", "moe_fused", 6.0), _row("b", "moe_torch", 6.0),
            _row("b", "more", 4.0, wire_bytes=int(2e9), comm_ms=5.0, **link),   # 200 GB/s
            _row("b", "more", 16.0, "forward+backward"),
            _row("one_gpu", "more", 30.0, "forward+backward"),
            _row("a", "more", 12.0, "forward+backward", router_ms=2.5),
            _row("a", "more_sharded", 3.2, merge_ms=0.1, router_ms=2.0),
            _row("a", "more_sharded", 12.0, "forward+backward", router_ms=3.0)]
    got = {t["what"]: t for t in targets(rows)}
    assert got["(a) MoRE forward"]["value"] == 3.0 and got["(a) MoRE forward"]["met"]
    assert got["(b) MoRE forward"]["met"] is False
    assert got["(b) MoRE forward+backward over one GPU's"]["value"] == 16.0 / 30.0
    assert got["(b) MoRE forward+backward over one GPU's"]["met"]              # <= 0.6
    assert got["(b) exchange, GB/s a direction"]["value"] == pytest.approx(200.0)
    assert got["(b) exchange, GB/s a direction"]["met"] is False              # >= 250
    assert got["(b) exchange over the peer copy"]["value"] == pytest.approx(0.5)
    # backward = router_ms(forward+backward) - router_ms(forward): 1.0 against 1.0
    assert got["sharded router's backward over the plain router's"]["value"] == 1.0
    assert got["(a) MoRE over MoE with the plain-torch router"]["value"] == 10.0 / 3.0
    assert got["(b) MoRE over MoE with the plain-torch router"]["met"] is False      # 1.5x
    assert got["sharded router: merge / router phase"]["value"] == 0.05
    text = summary_text(rows)
    assert "E=2, M=8,192: (a) MoRE forward: 3.00 ms (target <= 3.0 ms: met)" in text
    assert "(b) MoRE forward: 4.00 ms (target <= 3.0 ms: missed)" in text
    assert "(b) exchange, GB/s a direction: 200.00 GB/s (target >= 250.0 GB/s: missed)" in text
    assert "merge / router phase: 5.0% (target <= 10%: met)" in text
    assert "(a) MoRE over MoE with our fused router (reported): 2.00x" in text
    assert ("link at 128 MiB a peer, GB/s a direction: peer copy 400, send/recv 300, "
            "all-to-all -") in text


def test_a_rank_out_of_memory_inside_a_collective_stops_every_rank_in_one_line(tmp_path):
    """It used to hang: the rank out of memory went on to agree with the others, which
    waited in the collective it never reached. Now it stops with a one-line error naming
    where, and the other rank's collective fails into a one-line error of its own."""
    pytest.importorskip("triton")
    out, stdout = tmp_path / "ep.jsonl", tmp_path / "stdout"
    spawn_bounded(_rank, (2, _free_port(), str(out), str(stdout), 1), 2, 120)
    r0, r1 = (json.loads((tmp_path / f"stdout.{r}").read_text()) for r in (0, 1))
    assert r0["code"] != 0 and r1["code"] != 0
    assert "rank 1 ran out of GPU memory in (a) moe_torch M=4 forward: its comm phase" in r1["err"]
    assert "which holds collectives the other ranks wait in" in r1["err"]
    assert "rank 0: a collective failed because another rank stopped" in r0["err"]
    for r in (r0, r1):
        assert "Traceback" not in r["err"] and len(r["err"].strip().splitlines()) == 1


def test_plot_only_draws_the_stacked_bars(tmp_path, capsys):
    path = tmp_path / "ep.jsonl"
    rows = [_row(f, v, 5.0 + i, p) for i, (f, v) in enumerate(
        [("a", "moe_torch"), ("a", "more"), ("b", "more"), ("one_gpu", "more")])
        for p in ("forward", "forward+backward")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "ep", "--plot-only", str(path)]) == 0
    assert (tmp_path / "ep.png").stat().st_size > 10_000
    capsys.readouterr()
    assert main(["bench", "ep", "--plot-only", str(path), "--json"]) == 0   # JSON, not a path
    assert json.loads(capsys.readouterr().out) == {
        "plots": [str(tmp_path / "ep.png")], "rows": len(rows), "file": str(path)}
    assert render_ep([], tmp_path) == []
