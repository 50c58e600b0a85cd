"""benchmarks/routing_meta_ab.py on a CPU (--quick, the interpreter): rows of every path of
the metadata (the counting sort only where its tile holds the pairs) and of pair_order's
three, which agree field by field; without --quick a CPU is refused in one line."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import routing_meta_ab  # noqa: E402


def test_the_quick_check_writes_every_paths_rows(tmp_path, capsys):
    out = tmp_path / "ab.jsonl"
    assert routing_meta_ab.main([str(out), "--quick"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    meta = [r for r in rows if r["bench"] == "routing_meta"]
    assert [(r["M"], r["path"], r["fits"]) for r in meta] == [
        (32, "torch", True), (32, "counting", True), (32, "sorted", True),
        (300, "torch", False), (300, "sorted", False)]
    order = [r for r in rows if r["bench"] == "pair_order"]   # where the tile holds them
    assert [(r["M"], r["path"]) for r in order] == [
        (32, "counting"), (32, "sorted"), (32, "sort_search")]
    assert len(meta) + len(order) == len(rows)
    assert all(r["same_as_torch"] and "device" in r for r in rows)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU times it")
def test_a_cpu_without_quick_is_refused(tmp_path, capsys):
    assert routing_meta_ab.main([str(tmp_path / "ab.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("error: the A/B times a GPU")
