"""What `moremoe hf export` writes beside the weights: GPT-2's tokenizer files, built offline,
that tokenize exactly as moremoe's data was; a model card; and a folder that transformers'
text-generation pipeline runs to moremoe's own greedy tokens."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moremoe.cli import main  # noqa: E402
from moremoe.hf import export, register  # noqa: E402
from moremoe.model import Transformer, TransformerConfig  # noqa: E402
from moremoe.nn import MoEConfig  # noqa: E402
from moremoe.tasks.tokenizer import gpt2_encoding  # noqa: E402

TEXTS = ["héllo wörld 日本語 🙂  \n\n  tabs\tand   spaces\r\n", "<|endoftext|>A new document",
         "I'm sure they'd've said it's 12,345.67 -- or 3.14159?", " leading and trailing  ",
         "\x00\x01 control bytes ĠĊ and 'quotes' \"double\"", "a" * 300, ""]


def test_tokenizer_files_tokenize_as_ours(tmp_path):
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    from moremoe.hf.tokenizer import write_gpt2_tokenizer
    written = write_gpt2_tokenizer(tmp_path, 1024)
    assert "tokenizer.json" in written and "tokenizer_config.json" in written
    tok = AutoTokenizer.from_pretrained(tmp_path)
    enc = gpt2_encoding()
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    for text in TEXTS + [topics[k] for k in sorted(topics)[:40]]:
        ids = tok(text)["input_ids"]
        assert ids == enc.encode(text, allowed_special="all"), text[:60]
        assert tok.decode(ids) == text


def test_export_of_a_gpt2_run_has_its_tokenizer_card_and_runs_in_a_pipeline(
        capsys, gpt2_run, tmp_path):
    out = tmp_path / "export"
    assert main(["hf", "export", str(gpt2_run), str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokenizer"] is True
    assert {"tokenizer.json", "tokenizer_config.json", "README.md", "config.json",
            "model.safetensors"} <= set(result["files"])
    card = (out / "README.md").read_text()
    for part in ("pipeline_tag: text-generation", "2 layers, hidden 64", "MoE-8", "step 2",
                 '"preset": "tiny-moe"', '"tokenizer": "gpt2"', '"val_loss"',
                 "GPT-2's byte-level BPE"):
        assert part in card, part
    prompt = "The meaning of"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", prompt, "--max-new-tokens", "8", "--json",
                 "--no-progress"]) == 0
    ours = json.loads(capsys.readouterr().out)["results"][0]
    register()
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    got = pipe(prompt, max_new_tokens=8, do_sample=False, return_tensors=True)
    ids = got[0]["generated_token_ids"]
    ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
    assert ids == ours["prompt_ids"] + ours["token_ids"]


def test_export_of_another_vocabulary_writes_no_tokenizer_and_says_so(tmp_path):
    cfg = TransformerConfig(vocab=64, layers=1, heads=2, moe=MoEConfig.moe(8, 2, 32, 8),
                            max_seq_len=16)
    export(Transformer(cfg), tmp_path / "hf")
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "tokenizer.json" not in names and "README.md" in names
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "None written: the vocabulary has 64 ids, not GPT-2's 50,257" in card
    assert "Not known (the run's files were not found" in card
