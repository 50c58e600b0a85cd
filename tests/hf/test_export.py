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


@pytest.mark.parametrize("context, new", [(16, 15), (33, 32), (1024, 32)])
def test_the_cards_example_fits_the_context(tmp_path, context, new):
    from moremoe.hf.card import model_card
    cfg = TransformerConfig(vocab=50257, layers=1, heads=2, moe=MoEConfig.moe(8, 2, 32, 8),
                            max_seq_len=context)
    assert f"max_new_tokens={new})" in model_card(cfg, {}, name="x")


def test_export_of_another_vocabulary_writes_no_tokenizer_and_says_so(tmp_path):
    cfg = TransformerConfig(vocab=64, layers=1, heads=2, moe=MoEConfig.moe(8, 2, 32, 8),
                            max_seq_len=16)
    export(Transformer(cfg), tmp_path / "hf")
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "tokenizer.json" not in names and "README.md" in names
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "None written: the vocabulary has 64 ids, not GPT-2's 50,257" in card
    assert "Not known (the run's files were not found" in card


def test_nothing_a_run_made_is_written_into_even_with_force(capsys, gpt2_run, tmp_path):
    """hf export, convert-router --write-model and --out, the phonebook commands and the
    demo never write into a run or a checkpoint, a weights-only one included (export
    replaced its config.json and weights; convert-router a run's config.json; a phonebook
    --force would have deleted a checkpoints folder)."""
    import shutil
    from cli_checks import fails
    weights_only = tmp_path / "weights"
    shutil.copytree(gpt2_run / "checkpoints" / "step_00000002", weights_only)
    (weights_only / "state.pt").unlink()
    before = {p.name: p.read_bytes() for p in weights_only.iterdir()}
    run_files = {p: p.read_bytes() for p in gpt2_run.iterdir() if p.is_file()}
    never = r"holds a {} of moremoe; it is never written into \(not even with --force\)"
    fails(capsys, ["hf", "export", str(gpt2_run), str(weights_only), "--force"],
          rf"OUT_DIR {weights_only} " + never.format("checkpoint"))
    for target, what in ((weights_only, "checkpoint"), (gpt2_run, "run")):
        for flag in ("--out", "--write-model"):
            argv = ["convert-router", str(tmp_path / "src"), "--rank", "2", "--out",
                    str(tmp_path / "conv"), "--force"]
            argv = [*argv[:5], str(target), *argv[6:]] if flag == "--out" else \
                [*argv, "--write-model", str(target)]
            fails(capsys, argv, rf"{flag} {target} " + never.format(what))
        fails(capsys, ["demo", "--out", str(target), "--force", "--steps", "1"],
              rf"--out {target} " + never.format(what))
        fails(capsys, ["phonebook", "train", "--size", "40", "--out", str(target), "--force",
                       "--device", "cpu"], rf"--out {target} " + never.format(what))
    assert {p.name: p.read_bytes() for p in weights_only.iterdir()} == before
    assert (gpt2_run / "checkpoints" / "step_00000002" / "state.pt").is_file()
    # the run's own files (config.json among them) byte for byte: it still resumes
    assert {p: p.read_bytes() for p in gpt2_run.iterdir() if p.is_file()} == run_files
    assert (gpt2_run / "config.json") in run_files


def test_a_forced_export_of_another_vocabulary_drops_the_old_tokenizer(capsys, gpt2_run,
                                                                        tmp_path):
    from safetensors.torch import save_file
    out = tmp_path / "export"
    assert main(["hf", "export", str(gpt2_run), str(out)]) == 0
    assert (out / "tokenizer.json").is_file()
    cfg = TransformerConfig(vocab=64, layers=1, heads=2, moe=MoEConfig.moe(8, 2, 32, 8),
                            max_seq_len=16)
    ckpt = tmp_path / "small"
    ckpt.mkdir()
    save_file(Transformer(cfg).state_dict(), str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "train": {}}))
    capsys.readouterr()
    assert main(["hf", "export", str(ckpt), str(out), "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] is False
    names = {p.name for p in out.iterdir()}
    assert not names & {"tokenizer.json", "tokenizer_config.json"}, names


def test_the_exported_tokenizer_loads_without_the_folders_code(gpt2_run, tmp_path,
                                                               monkeypatch):
    """transformers 5's AutoTokenizer reads the model's config first, whose class is the
    folder's code, and asks at a terminal whether to run it: PreTrainedTokenizerFast never
    does, AutoTokenizer not after register() (the card and the README say so)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    def asked(*a, **kw):
        raise AssertionError("transformers asked whether to run the folder's code")
    monkeypatch.setattr("builtins.input", asked)
    out = tmp_path / "export"
    assert main(["hf", "export", str(gpt2_run), str(out)]) == 0
    ids = gpt2_encoding().encode("The meaning of")
    assert PreTrainedTokenizerFast.from_pretrained(out)("The meaning of")["input_ids"] == ids
    register()
    assert AutoTokenizer.from_pretrained(out)("The meaning of")["input_ids"] == ids
    assert "moremoe.hf.register()" in (out / "README.md").read_text()
