"""benchmarks/phonebook_inductor_ab.py off a GPU: bad names and a missing OUT refused in one
line each, --list names the variants, and a variant's process reports a failure as a row."""
import json
import queue
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import phonebook_inductor_ab as ab  # noqa: E402


def test_list_names_every_variant(capsys):
    assert ab.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(ab.VARIANTS)
    assert json.loads(out[1].split(None, 1)[1]) == {"combo_kernels": True}


@pytest.mark.parametrize("argv, said", [
    (["o.jsonl", "--variants", "base,fast"], "--variants: unknown fast"),
    (["o.jsonl", "--models", "MoE-64"], "--models: unknown MoE-64"),
    ([], "OUT: the JSONL file"),
])
def test_bad_arguments_are_named(argv, said, capsys):
    assert ab.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU measures it")
def test_a_cpu_is_refused_and_a_failed_variant_is_a_row(tmp_path, capsys, monkeypatch):
    assert ab.main([str(tmp_path / "o.jsonl")]) == 2
    assert "run this on a GPU" in capsys.readouterr().err
    from moremoe.phonebook import step
    monkeypatch.setattr(step, "COMPILE_OPTIONS", step.COMPILE_OPTIONS)  # _measure sets it
    q = queue.Queue()
    ab._measure("base", "MoE-32", q)           # the compiled step needs CUDA: an error row
    row = q.get_nowait()
    assert row["variant"] == "base" and row["options"] == {} and "error" in row
    assert step.COMPILE_OPTIONS == {}          # what the step's blocks would have compiled with
