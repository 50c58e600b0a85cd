"""`moremoe generate` on a tiny run trained here on GPT-2 tokens: greedy equals the model's
generate(), prompts of a file batch by length and keep their order, a seed makes sampling
reproducible, --json is strict, and every mistake is one line."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_checks import fails
from moremoe.cli import main
from moremoe.model import generate
from moremoe.model.checkpoint import load_model
from moremoe.tasks.tokenizer import EOT_ID, gpt2_encoding
from prepared import train_tiny_run


def _json(capsys, argv):
    capsys.readouterr()
    assert main(argv + ["--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out,
                      parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))


def test_greedy_equals_the_models_generate_and_streams_the_text(capsys, gpt2_run):
    prompt = "The quick brown fox"
    out = _json(capsys, ["generate", str(gpt2_run), "--prompt", prompt, "--max-new-tokens", "12"])
    ids = gpt2_encoding().encode(prompt)
    want = generate(load_model(gpt2_run), torch.tensor([ids]), 12, eos_id=EOT_ID)[0]
    row = out["results"][0]
    assert row["prompt_ids"] == ids and row["token_ids"] == want
    assert row["prefill_ms"] > 0 and out["dtype"] == "float32" and out["temperature"] == 0
    assert row["stopped"] in ("eos", "length") and len(want) <= 12
    assert main(["generate", str(gpt2_run), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == prompt + row["text"] + "\n"


def test_a_prompt_file_batches_equal_lengths_and_keeps_the_order(capsys, gpt2_run, tmp_path):
    enc = gpt2_encoding()
    lines = ["Hello there", "", "One two three four", "Good morning"]
    assert len(enc.encode(lines[0])) == len(enc.encode(lines[3])) != len(enc.encode(lines[2]))
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    out = _json(capsys, ["generate", str(gpt2_run), "--prompt-file", str(path),
                         "--max-new-tokens", "6", "--ignore-eos"])
    rows = out["results"]
    assert [r["line"] for r in rows] == [1, 3, 4] and [r["batch"] for r in rows] == [2, 1, 2]
    model = load_model(gpt2_run)
    for r in rows:
        assert r["token_ids"] == generate(model, torch.tensor([r["prompt_ids"]]), 6)[0]
        assert len(r["token_ids"]) == 6 and r["stopped"] == "length"
    assert main(["generate", str(gpt2_run), "--prompt-file", str(path), "--max-new-tokens", "6",
                 "--ignore-eos", "--no-progress"]) == 0
    text = capsys.readouterr().out
    for r in rows:
        assert f"--- line {r['line']}\n{r['prompt']}{r['text']}\n" in text


def test_a_seed_makes_sampling_reproducible(capsys, gpt2_run):
    argv = ["generate", str(gpt2_run), "--prompt", "Once upon a time", "--max-new-tokens", "5",
            "--temperature", "1.5", "--top-k", "1000", "--ignore-eos"]
    a = _json(capsys, argv + ["--seed", "5"])["results"][0]["token_ids"]
    b = _json(capsys, argv + ["--seed", "5"])["results"][0]["token_ids"]
    c = _json(capsys, argv + ["--seed", "6"])["results"][0]["token_ids"]
    assert a == b and a != c
    unseeded = _json(capsys, argv)
    assert isinstance(unseeded["seed"], int)
    again = _json(capsys, argv + ["--seed", str(unseeded["seed"])])
    assert again["results"][0]["token_ids"] == unseeded["results"][0]["token_ids"]


def test_mistakes_are_one_line(capsys, gpt2_run, text_data, tmp_path):
    g = ["generate", str(gpt2_run)]
    fails(capsys, ["generate", str(tmp_path / "nope"), "--prompt", "a"], r"does not exist")
    fails(capsys, g + ["--prompt", ""], r"--prompt is empty")
    fails(capsys, g + ["--prompt-file", str(tmp_path / "p.txt")], r"--prompt-file .*no such "
                                                                  r"file; give a text file")
    fails(capsys, g + ["--prompt-file", str(tmp_path)], rf"--prompt-file {tmp_path}: is a "
                                                        r"folder, not a file; give a text file")
    (tmp_path / "blank.txt").write_text("\n \n")
    fails(capsys, g + ["--prompt-file", str(tmp_path / "blank.txt")], r"holds no prompt")
    fails(capsys, g + ["--prompt", "a", "--max-new-tokens", "40"],
          r"--prompt has 1 tokens; with --max-new-tokens 40 that is more than the model's "
          r"max_seq_len=32")
    fails(capsys, g + ["--prompt", "a", "--top-p", "1.5", "--temperature", "1"],
          r"--top-p must be in \(0, 1\], got 1.5")
    fails(capsys, g + ["--prompt", "a", "--top-k", "5"], r"give --temperature > 0 with them")
    fails(capsys, g + ["--prompt", "a", "--temperature", "-1"], r"--temperature must be >= 0")
    fails(capsys, g + ["--prompt", "a", "--top-k", "0"], r"expected a positive integer")
    fails(capsys, g + ["--prompt", "a", "--prompt-file", "x"], r"not allowed with")
    broken = Path(shutil.copytree(gpt2_run, tmp_path / "broken"))
    weights = broken / "checkpoints" / "step_00000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    fails(capsys, ["generate", str(broken), "--prompt", "a"],
          r"has no complete checkpoint; incomplete: .*step_00000002 \(model.safetensors")
    fails(capsys, ["generate", str(weights.parent), "--prompt", "a"],
          r"checkpoint .*step_00000002 is incomplete: model.safetensors has .* \(truncated\)")
    byte_run = train_tiny_run(text_data, tmp_path / "bytes")
    fails(capsys, ["generate", str(byte_run), "--prompt", "a"],
          r"has a vocabulary of 256 tokens, not GPT-2's 50,257: generate reads the prompt "
          r"with the GPT-2 tokenizer")


def test_weights_that_are_not_finite_are_named_not_decoded(capsys, gpt2_run, tmp_path):
    """A diverged checkpoint decoded to "!!!!" (every logit NaN, argmax 0) with exit 0."""
    from safetensors.torch import load_file, save_file
    ckpt = Path(shutil.copytree(gpt2_run / "checkpoints" / "step_00000002", tmp_path / "nan"))
    weights = load_file(str(ckpt / "model.safetensors"))
    name = sorted(weights)[3]
    weights[name][0] = float("nan")
    save_file(weights, str(ckpt / "model.safetensors"))
    fails(capsys, ["generate", str(ckpt), "--prompt", "a"],
          rf"MODEL {ckpt}: its weights are not finite \(1 of \d+ tensors hold NaN or infinity, "
          rf"\S+ first\): the run that wrote them diverged; use an earlier checkpoint")


@pytest.mark.parametrize("report,command", [("demo.json", "demo"),
                                            ("phonebook_train.json", "phonebook"),
                                            ("sweep.json", "phonebook")])
def test_a_folder_of_the_demo_or_phonebook_is_named_as_no_language_model(capsys, tmp_path,
                                                                       report, command):
    """`moremoe demo` writes a report and a plot, and keeps no model: generate says so and
    what it needs, rather than 'not a checkpoint'."""
    (tmp_path / report).write_text(json.dumps({"command": command}))
    (tmp_path / report.replace(".json", ".png")).write_bytes(b"")
    fails(capsys, ["generate", str(tmp_path), "--prompt", "a"],
          rf"holds the report of `moremoe {command}` \({report}\) and no checkpoint: its "
          rf"phonebook models are not kept.*generate needs a language model of `moremoe train`")
