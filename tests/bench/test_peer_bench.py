"""`moremoe bench peer`: the matched layers are the paper's, the quick run covers every layer,
variant and pass with tagged rows and a plot (CPU: Triton interpreter), and the summary's
ratios read the newest rows."""
import json

import pytest

from moremoe.bench.peer import PAPER_RATIO, PeerSetup, layer_configs, ratios, summary_text
from moremoe.cli import main


def test_the_matched_layers_are_the_papers():
    cfgs = layer_configs(PeerSetup())
    assert cfgs["more"].name == "MoRE-1792" and cfgs["more"].width == 56
    assert cfgs["moe"].name == "MoE-256" and cfgs["moe"].width == 64
    paper, infer = cfgs["peer_paper"], cfgs["peer_inference"]
    assert paper.experts == infer.experts == 388 ** 2
    assert (paper.heads, paper.d_q, paper.kappa, paper.top_k) == (8, 32, 56, 448)
    assert (infer.kappa, infer.top_k) == (4, 32)
    assert paper.impl == "triton"


def test_quick_run_covers_every_variant_and_pass(capsys, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "peer.jsonl"
    assert main(["bench", "peer", "--quick", "--tokens", "16", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert len(out.read_text().splitlines()) == len(rows) == 2 * (2 + 2 * 3)
    assert {(r["variant"], r["reading"], r["phase"]) for r in rows} == {
        (v, rd, ph) for ph in ("forward", "forward+backward")
        for v, rd in [("more", None), ("moe", None)] + [
            (v, rd) for v in ("peer_fused", "peer_torch", "peer_retrieval")
            for rd in ("paper", "inference")]}
    for r in rows:
        assert r["bench"] == "peer" and r["N"] == 16 and r["ms"] > 0
        for key in ("device", "torch", "triton", "commit", "date", "layer", "h", "M", "k"):
            assert key in r, key
    assert data["plots"] == [str(tmp_path / "peer.png")] and (tmp_path / "peer.png").exists()


def _row(variant, N, phase, ms, reading=None):
    return {"bench": "peer", "variant": variant, "reading": reading, "N": N, "phase": phase,
            "ms": ms}


def test_ratios_and_summary_take_the_newest_rows():
    rows = [_row("more", 4096, "forward", 9.0), _row("more", 4096, "forward", 1.0),
            _row("moe", 4096, "forward", 1.5),
            _row("peer_fused", 4096, "forward", 2.0, "paper"),
            _row("peer_torch", 4096, "forward", 8.0, "paper"),
            _row("peer_retrieval", 4096, "forward", 0.5, "paper"),
            {**_row("peer_torch", 65536, "forward", None, "paper"), "oom": True},
            _row("peer_fused", 65536, "forward", 20.0, "paper")]
    got = ratios(rows)
    assert [(r["N"], r["phase"]) for r in got] == [(4096, "forward"), (65536, "forward")]
    first = got[0]
    assert (first["fused_vs_more"], first["torch_vs_more"], first["moe_vs_more"],
            first["retrieval_share"]) == (2.0, 8.0, 1.5, 0.25)
    assert first["paper"] == PAPER_RATIO["forward"][4096]
    assert got[1]["torch_vs_more"] is None and got[1]["fused_vs_more"] is None   # no MoRE row
    text = summary_text(rows)
    assert "PEER (paper) forward N=4,096: fused / MoRE 2.0x, torch / MoRE 8.0x" in text
    assert "retrieval 25% of fused; paper 5.2x" in text


def test_plot_only_renders_from_rows(tmp_path):
    path = tmp_path / "peer.jsonl"
    rows = [_row("more", N, ph, 1.0) for N in (4096, 16384) for ph in ("forward",
                                                                      "forward+backward")]
    rows += [_row("peer_fused", N, ph, 3.0 * N / 4096, "paper") for N in (4096, 16384)
             for ph in ("forward", "forward+backward")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "peer", "--plot-only", str(path)]) == 0
    assert (tmp_path / "peer.png").stat().st_size > 10_000
