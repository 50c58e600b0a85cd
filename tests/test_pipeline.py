"""The whole text pipeline through the command line, offline, on real prose (the docs that
Python ships in pydoc_data): data prepare -> train -> interrupt and resume -> eval
(perplexity and lm-eval on local fixtures) -> Hugging Face export and reload."""
import json
import math
from pathlib import Path

import pytest
import torch

from moremoe.cli import main
from numerics import model_reduction_length, reduction_tol

TRAIN = ["--preset", "tiny-more", "--device", "cpu", "--set", "model.seq_len=64",
         "--set", "train.batch_size=8", "--set", "train.max_steps=80",
         "--set", "train.eval_every=40", "--set", "train.log_every=10", "--json"]


def _log_steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r.get("event") == "train"]


def test_prepare_train_resume_eval_export(tmp_path, capsys, lm_eval_tasks):
    transformers = pytest.importorskip("transformers")
    from moremoe.tasks.text import open_tokens, stdlib_corpus
    corpus, data, run = tmp_path / "corpus", tmp_path / "data", tmp_path / "run"
    stdlib_corpus(corpus)
    assert main(["data", "prepare", str(corpus), "--out", str(data), "--seq-len", "64",
                 "--val-sequences", "64", "--workers", "2", "--no-progress", "--json"]) == 0
    assert open_tokens(data, "val", verify=True).shape == (64, 64)

    # stopped half way (as a kill or a time budget would), then resumed to the end
    assert main(["train", "--data", str(data), "--out", str(run), "--stop-step", "40",
                 *TRAIN]) == 75                          # stopped by a budget, resumable
    capsys.readouterr()
    assert main(["train", "--data", str(data), "--out", str(run), "--resume", *TRAIN]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 80
    steps = _log_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 80   # no step logged twice
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r.get("event") == "train"]
    assert losses[-1] < losses[0] - 2.0                          # it learns the prose

    report = tmp_path / "eval.json"
    assert main(["eval", str(run), "--data", str(data), "--val-batches", "2", "--tasks",
                 "hellaswag_fixture,sciq_fixture", "--include-path", str(lm_eval_tasks), "--limit", "2",
                 "--device", "cpu", "--out", str(report)]) == 0
    got = json.loads(report.read_text())
    assert math.isfinite(got["perplexity"]["perplexity"])
    assert got["perplexity"]["perplexity"] < math.exp(losses[0])
    for task in ("hellaswag_fixture", "sciq_fixture"):
        assert 0.0 <= got["tasks"][task]["metrics"]["acc_norm"]["value"] <= 1.0

    from moremoe.hf import register
    from moremoe.model.checkpoint import load_model
    hf = tmp_path / "hf"
    assert main(["hf", "export", str(run), str(hf)]) == 0
    register()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    model = load_model(run).eval()
    want = model.state_dict()                       # the weights exactly ...
    got = reloaded.to_transformer().state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    tokens = torch.as_tensor(open_tokens(data, "val")[:2].astype("int64"))
    with torch.no_grad():      # ... the logits to rounding: the copies may feed BLAS from
        torch.testing.assert_close(   # other alignments, which changes the summation order
            reloaded(tokens).logits, model(tokens).logits,
            **reduction_tol(torch.float32, model_reduction_length(model.config)))
