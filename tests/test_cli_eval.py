"""`moremoe eval` and `moremoe hf export` end to end on tiny models and local fixtures."""
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_checks import fails
from moremoe.cli import main
from moremoe.model import Transformer, TransformerConfig
from moremoe.nn import MoEConfig



def tiny_gpt2_model():
    cfg = TransformerConfig(vocab=50257, layers=1, heads=2, max_seq_len=32,
                            moe=MoEConfig.more(8, 2, 32, 8, 4))
    return Transformer(cfg).eval()


def hf_dir(tmp_path, model) -> Path:
    pytest.importorskip("transformers")
    from moremoe.hf import export
    return Path(export(model, tmp_path / "hf"))


def test_eval_runs_tasks_and_writes_the_table_and_json(tmp_path, capsys, lm_eval_tasks):
    out = tmp_path / "report.json"
    rc = main(["eval", str(hf_dir(tmp_path, tiny_gpt2_model())), "--tasks",
               "sciq_fixture,nq_open_fixture", "--include-path", str(lm_eval_tasks), "--limit", "2",
               "--device", "cpu", "--max-gen-toks", "4", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "sciq_fixture" in text and "acc_norm" in text and "±" in text
    report = json.loads(out.read_text())
    assert report["perplexity"] is None
    assert report["tasks"]["sciq_fixture"]["n"] == 2
    assert set(report["tasks"]["nq_open_fixture"]["metrics"]) == {"exact_match", "f1"}


def test_no_progress_silences_every_bar_and_line_of_the_libraries(tmp_path, capfd,
                                                                   lm_eval_tasks, monkeypatch):
    """--no-progress: nothing on stderr from lm-eval, datasets or transformers ("Building
    contexts", "Loading weights"), nor lm-eval's `git describe` failing outside a repository
    ("fatal: not a git repository"); generate of an export likewise."""
    export = hf_dir(tmp_path, tiny_gpt2_model())
    capfd.readouterr()
    monkeypatch.chdir(tmp_path)                           # no git repository here
    assert main(["eval", str(export), "--tasks", "sciq_fixture", "--include-path",
                 str(lm_eval_tasks), "--limit", "2", "--device", "cpu", "--json",
                 "--no-progress"]) == 0
    err = capfd.readouterr().err
    assert "fatal" not in err and "%|" not in err and "Loading" not in err, err[-2000:]
    assert main(["generate", str(export), "--prompt", "The", "--max-new-tokens", "2",
                 "--device", "cpu", "--no-progress", "--json"]) == 0
    err = capfd.readouterr().err
    assert "Loading" not in err and "%|" not in err, err[-2000:]


def write_data_dir(path: Path, val_NT: np.ndarray) -> Path:
    """A prepared directory in the documented format (contract of `moremoe data prepare`)."""
    path.mkdir()
    val = val_NT.astype("<u2")
    train = val[:1]
    digests = {}
    for name, arr in (("train.bin", train), ("val.bin", val)):
        (path / name).write_bytes(arr.tobytes())
        digests[name] = hashlib.sha256(arr.tobytes()).hexdigest()
    meta = {"format": "moremoe-tokens", "version": 1, "tokenizer": "gpt2", "vocab_size": 50257,
            "eot_id": 50256, "seq_len": val.shape[1], "dtype": "uint16",
            "train_sequences": 1, "val_sequences": val.shape[0], "seed": 0, "sources": [],
            "documents": val.shape[0], "tokens": int(val.size + train.size), "sha256": digests}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_eval_validation_perplexity(tmp_path, capsys):
    pytest.importorskip("moremoe.eval.perplexity")
    pytest.importorskip("moremoe.tasks.text")
    model = tiny_gpt2_model()
    val = np.random.default_rng(0).integers(0, 50257, size=(5, 16))
    data = write_data_dir(tmp_path / "data", val)
    rc = main(["eval", str(hf_dir(tmp_path, model)), "--data", str(data), "--tasks", "none",
               "--val-batches", "2", "--batch-size", "2", "--device", "cpu", "--json"])
    assert rc == 0
    ppl = json.loads(capsys.readouterr().out)["perplexity"]
    tokens = torch.as_tensor(val[:4])                     # 2 batches of 2
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50257), tokens[:, 1:].reshape(-1))
    assert ppl["tokens"] == 4 * 15
    assert ppl["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert ppl["perplexity"] == pytest.approx(math.exp(ppl["loss"]))


def test_eval_cuts_longer_rows_to_the_models_length(tmp_path, capsys):
    model = tiny_gpt2_model()                                   # max_seq_len 32
    val = np.random.default_rng(1).integers(0, 50257, size=(3, 64))
    data = write_data_dir(tmp_path / "data", val)
    rc = main(["eval", str(hf_dir(tmp_path, model)), "--data", str(data), "--tasks", "none",
               "--batch-size", "4", "--device", "cpu", "--json"])
    assert rc == 0
    ppl = json.loads(capsys.readouterr().out)["perplexity"]
    rows = torch.as_tensor(val.reshape(6, 32))                 # as training reads them
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50257), rows[:, 1:].reshape(-1))
    assert ppl["tokens"] == 6 * 31
    assert ppl["loss"] == pytest.approx(float(loss), rel=1e-5)


def test_hf_export_of_a_checkpoint_loads_with_auto_classes(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from moremoe.hf import register
    model = tiny_gpt2_model()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model": model.config.to_dict(),
                                                  "train": {}}))
    assert main(["hf", "export", str(ckpt), str(tmp_path / "out")]) == 0
    register()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.eos_token_id == 50256
    got = loaded.to_transformer().state_dict()
    assert all(torch.equal(v, got[k]) for k, v in model.state_dict().items())


def test_eval_errors_name_the_problem(tmp_path, capsys):
    fails(capsys, ["eval", str(tmp_path), "--tasks", "none"], "nothing to evaluate")
    fails(capsys, ["eval", str(tmp_path / "missing"), "--tasks", "sciq"], "does not exist")
    small = Transformer(TransformerConfig(vocab=1000, layers=1, heads=2, max_seq_len=32,
                                          moe=MoEConfig.more(8, 2, 32, 8, 4))).eval()
    data = write_data_dir(tmp_path / "data", np.zeros((2, 16), dtype=np.int64))
    fails(capsys, ["eval", str(hf_dir(tmp_path, small)), "--data", str(data), "--tasks", "none",
                   "--device", "cpu"], "vocab_size=50257 exceeds the model's vocab=1000")


def test_eval_of_weights_that_are_not_finite_is_one_line(tmp_path, capsys):
    """A diverged model's perplexity was reported as null with exit 0: eval names the
    weights that are not finite instead, as generate does."""
    pytest.importorskip("moremoe.eval.perplexity")
    pytest.importorskip("moremoe.tasks.text")
    model = tiny_gpt2_model()
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    val = np.random.default_rng(0).integers(0, 50257, size=(5, 16))
    data = write_data_dir(tmp_path / "data", val)
    folder = hf_dir(tmp_path, model)
    fails(capsys, ["eval", str(folder), "--data", str(data), "--tasks", "none",
                   "--val-batches", "2", "--batch-size", "2", "--device", "cpu"],
          r"its weights are not finite \(1 of \d+ tensors hold NaN or infinity, \S+ first\)")
