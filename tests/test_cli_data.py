"""`moremoe data prepare` and `moremoe data verify` from the command line, including a run
killed with SIGKILL and resumed."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_checks import fails
from moremoe.cli import build_parser, main
from moremoe.tasks.text import stdlib_corpus

ARGS = ["--seq-len", "64", "--val-sequences", "20", "--workers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"), format="jsonl")[0]


def test_prepare_and_verify(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "prepare", str(corpus), "--out", str(out), *ARGS, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["documents"] > 50 and s["val_sequences"] == 20 and s["seq_len"] == 64
    assert s["train_sequences"] * 64 + 20 * 64 + s["dropped_tokens"] == s["tokens"]
    assert main(["data", "verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sizes, sha256 and token ids OK" in text and f"{s['train_sequences']:,}" in text
    fails(capsys, ["data", "prepare", str(corpus), "--out", str(out), *ARGS],
          "already holds prepared data .* --force")
    assert main(["data", "prepare", str(corpus), "--out", str(out), *ARGS, "--force",
                 "--seed", "3"]) == 0
    assert "dropped tokens (tail)" in capsys.readouterr().out
    val = out / "val.bin"
    val.write_bytes(val.read_bytes()[:-2])
    fails(capsys, ["data", "verify", str(out), "--json"],
          rf"error: {val} has 2,558 bytes, expected 2,560")


def test_argument_errors(corpus, tmp_path, capsys):
    fails(capsys, ["data", "prepare", str(corpus), "--out", str(tmp_path / "o"),
                   "--no-progress"], "too few sequences: .* --val-sequences 5,000")
    fails(capsys, ["data", "prepare", str(corpus), "--out", str(tmp_path / "o"),
                   "--tokenizer-ranks", str(corpus)], r"sha256 [0-9a-f]{64}, expected 306cd27f")
    parse = build_parser().parse_args
    assert parse(["data", "prepare", "x", "--out", "o"]).restart is False    # resume by default
    assert parse(["data", "prepare", "x", "--out", "o", "--resume"]).restart is False
    assert parse(["data", "prepare", "x", "--out", "o", "--restart"]).restart is True
    with pytest.raises(SystemExit):
        parse(["data", "prepare", "x", "--out", "o", "--resume", "--restart"])
    fails(capsys, ["data", "prepare", str(corpus), "--out", str(tmp_path / "o"), "--seq-len",
                   "1"], "expected an integer >= 2, got 1")


def _wait_gone(pids, timeout=20.0):
    deadline = time.time() + timeout
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.time() < deadline:
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and SIGKILL")
def test_killed_run_resumes_to_the_same_bytes(corpus, tmp_path, capsys):
    big = tmp_path / "big.jsonl"
    big.write_bytes(corpus.read_bytes() * 12)                 # ~1.7M tokens, ~140 shards
    argv = ["data", "prepare", str(big), "--seq-len", "64", "--val-sequences", "20",
            "--workers", "2", "--shard-mb", "0.04", "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "ref")]) == 0
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "moremoe.cli", *argv, "--out", str(out)],
                            env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    shards = out / ".partial" / "shards"
    deadline = time.time() + 120        # bounded: a stuck prepare fails, it does not wait
    while len(list(shards.glob("*.json"))) < 3 and proc.poll() is None:
        if time.time() > deadline:
            proc.kill()
            pytest.fail("data prepare wrote fewer than 3 shards in 120 s")
        time.sleep(0.002)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                             text=True).stdout.split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait_gone(workers)         # orphaned workers finish their shard, then exit
    assert not (out / "meta.json").exists() and not (out / "train.bin").exists()
    capsys.readouterr()
    assert main(argv + ["--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert 3 <= summary["shards_reused"] < summary["shards"]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_corpus_writes_python_docs_and_optionally_its_source(tmp_path, capsys):
    from moremoe.cli import main
    assert main(["data", "corpus", str(tmp_path / "docs"), "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert docs["files"] == len(list((tmp_path / "docs").glob("*.txt"))) > 50
    assert main(["data", "corpus", str(tmp_path / "all"), "--python-source", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["files"] > docs["files"] + 100 and both["bytes"] > 10 * docs["bytes"]
    assert (tmp_path / "all" / "source" / "json" / "decoder.txt").is_file()


# ---------------------------------------------------------------- data mixture

MIX = ["--seq-len", "64", "--val-sequences", "10", "--workers", "2", "--no-progress"]


@pytest.fixture(scope="module")
def mixture_sources(tmp_path_factory):
    pytest.importorskip("datasets")
    from mixture_fixtures import write_sources
    return write_sources(tmp_path_factory.mktemp("mixture_sources"))


def test_mixture_help_and_list_show_the_recipe(capsys):
    with pytest.raises(SystemExit):
        main(["data", "mixture", "--help"])
    help_text = capsys.readouterr().out
    for part in ("--recipe paper", "37B tokens x1", "HuggingFaceTB/smollm-corpus:cosmopedia-v2",
                 "4B tokens x3", "ComplexWebQuestions", "Winogrande", "whole, x3 each",
                 "--source NAME=PATH", "--scale F or --tokens N"):
        assert part in help_text, part
    assert main(["data", "mixture", "--list"]) == 0
    text = capsys.readouterr().out
    assert "63,000,000,000 tokens" in text and "mandarjoshi/trivia_qa:rc.nocontext" in text
    assert main(["data", "mixture", "--list", "--tokens", "630e6", "--source", "sciq=/x",
                 "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    by = {s["name"]: s for s in listed["sources"]}
    assert len(by) == 15 and listed["scale"] == pytest.approx(0.01)
    assert by["fineweb_edu"]["budget_tokens"] == 370_000_000 and by["wikipedia"]["repeats"] == 3
    assert by["sciq"]["local"] == "/x" and by["sciq"]["fraction"] == pytest.approx(0.01)
    assert by["cwq"]["revision"] == "refs/convert/parquet"


def test_mixture_from_local_copies(mixture_sources, tmp_path, capsys):
    from mixture_fixtures import source_args
    out = tmp_path / "mix"
    argv = ["data", "mixture", "--recipe", "paper", "--out", str(out), "--tokens", "90000",
            *source_args(mixture_sources), *MIX]
    assert main(argv + ["--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    by = {r["name"]: r for r in s["sources"]}
    assert by["cosmopedia"]["tokens_taken"] == round(14e9 * 90000 / 63e9) == 20_000
    assert by["wikipedia"]["tokens_written"] == \
        (by["wikipedia"]["train_sequences"] + by["wikipedia"]["val_sequences"]) * 64
    assert s["val_sequences"] == 10 and s["tokens_written"] == sum(
        r["tokens_written"] for r in s["sources"])
    assert main(["data", "verify", str(out)]) == 0
    assert "token ids OK" in capsys.readouterr().out
    fails(capsys, argv, r"already holds prepared data .* pass --force to replace it")
    assert main(argv + ["--force", "--seed", "2"]) == 0
    text = capsys.readouterr().out
    assert "paper mixture at scale 1.43e-06" in text and "fineweb_edu" in text


def test_mixture_errors(mixture_sources, tmp_path, capsys):
    out = ["--out", str(tmp_path / "o")]
    fails(capsys, ["data", "mixture", *out, *MIX],            # tests run with HF_HUB_OFFLINE=1
          r"the Hugging Face Hub is out of reach \(HF_HUB_OFFLINE is set\) and 15 sources have "
          r"no local copy: fineweb_edu=HuggingFaceTB/smollm-corpus:fineweb-edu-dedup, .*"
          r"winogrande=allenai/winogrande:winogrande_xl; download them .* --source NAME=PATH")
    fails(capsys, ["data", "mixture", "--no-progress"], "--out is required")
    fails(capsys, ["data", "mixture", *out, "--source", "fineweb"],
          "expected NAME=PATH like fineweb_edu=/data/fineweb, got 'fineweb'")
    fails(capsys, ["data", "mixture", *out, "--source", "web=/x"],
          r"--source web=/x: 'web' is not in the recipe; expected one of fineweb_edu,")
    fails(capsys, ["data", "mixture", *out, "--scale", "2"], r"--scale must be in \(0, 1\]")
    fails(capsys, ["data", "mixture", *out, "--scale", "0.5", "--tokens", "9"],
          "not allowed with argument")
    fails(capsys, ["data", "mixture", *out, "--skip", "wiki"], "--skip wiki: not a source")
    fails(capsys, ["data", "mixture", *out, "--recipe", "gpt3"], "invalid choice: 'gpt3'")
