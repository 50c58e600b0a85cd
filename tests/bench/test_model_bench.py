"""`moremoe bench model`'s decode rows: each mode's row carries its byte floor, the floor
counts the bytes a step reads, MoRE / MoE is taken per mode, and the plots draw the modes.
On the CPU the static path runs without a graph (a code-path check)."""
import pytest
import torch

from moremoe.bench.model import PROMPT, ratios, run_model, step_bytes
from moremoe.bench.model_plots import render_model
from moremoe.model import TransformerConfig
from moremoe.nn import MoEConfig


def test_step_bytes_counts_weights_reached_and_the_cache():
    moe = MoEConfig.moe(M=8, k=2, h=16, s=4)
    cfg = TransformerConfig(vocab=10, layers=2, heads=2, kv_heads=1, moe=moe)
    attention = 16 * 8 * (2 * 2 + 2 * 1) + 2 * 16          # q, o, k, v and two norms
    for B, reached in ((1, 2), (4, 8 * (1 - 0.75 ** 4))):
        want = 2 * (2 * (attention + 8 * 16 + 3 * 4 * 16 * reached + 2 * B * 1 * 5 * 8)
                    + B * 16 + 16 + 10 * 16)
        assert step_bytes(cfg, B, 5) == pytest.approx(want)
    more = TransformerConfig(vocab=10, layers=2, heads=2, kv_heads=1,
                             moe=MoEConfig.more(8, 2, 16, 4, 3))
    assert step_bytes(more, 1, 5) - step_bytes(cfg, 1, 5) == 2 * 2 * (8 * 3 + 3 * 16 - 8 * 16)


def test_decode_rows_of_each_mode_with_floor_and_ratios(tmp_path):
    from moremoe.cli.bench import _pair_configs
    rows = list(run_model(torch.device("cpu"), pairs=_pair_configs(["tiny"], True),
                          quick=True, phases=("decode",), batches=(1,),
                          modes=("eager", "captured"), new_tokens=2))
    assert [(r["model"], r["mode"], r["B"]) for r in rows] == [
        ("tiny-moe", "eager", 1), ("tiny-moe", "captured", 1),
        ("tiny-more", "eager", 1), ("tiny-more", "captured", 1)]
    for r in rows:
        assert r["ms"] > 0 and r["new_tokens"] == 2 and r["prompt"] == PROMPT
        assert r["step_bytes"] > 0 and r["floor_ms"] is None      # no copy rate on a CPU
    captured = [r for r in rows if r["mode"] == "captured"]
    assert all(r["components"] is None and r["graph"] is False for r in captured)
    by_mode = {r["mode"]: r for r in ratios(rows)}
    assert set(by_mode) == {"eager", "captured"}
    assert by_mode["captured"]["ratio"] == pytest.approx(captured[1]["ms"] / captured[0]["ms"])
    names = [p.name for p in render_model(rows, tmp_path)]
    assert names == ["model.png", "model_decode.png"]
