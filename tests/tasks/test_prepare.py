"""`moremoe data prepare` as a library: the stream, the split, determinism, resume, inputs."""
import gzip
import json

import numpy as np
import pytest

from moremoe.tasks.prepare import PrepareConfig, prepare
from moremoe.tasks.sources import discover_sources, encode
from moremoe.tasks.text import open_tokens, read_meta, stdlib_corpus
from moremoe.tasks.tokenizer import EOT_ID, gpt2_encoding

T, VAL = 64, 100
SHARD_MB = 0.05         # the 465K-character corpus -> 7 shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return {"txt": root / "txt", "jsonl": stdlib_corpus(root / "jsonl", format="jsonl")[0],
            "files": stdlib_corpus(root / "txt")}


def run(inputs, out, **kw):
    kw = {"seq_len": T, "val_sequences": VAL, "workers": 1, "shard_mb": SHARD_MB, **kw}
    return prepare(PrepareConfig(inputs=tuple(map(str, inputs)), out=str(out), **kw),
                   progress=False)


def outputs(out):
    return {name: (out / name).read_bytes() for name in ("train.bin", "val.bin")}


def run_bytes(inputs, out, **kw):
    run(inputs, out, **kw)
    return outputs(out)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    return out, run([corpus["txt"]], out)


def test_stream_split_and_meta(corpus, reference):
    out, summary = reference
    enc = gpt2_encoding()
    stream = np.concatenate([np.append(enc.encode_ordinary(p.read_text()), EOT_ID)
                             for p in sorted(corpus["files"])]).astype(np.uint16)
    n = len(stream) // T
    rows = stream[:n * T].reshape(n, T)
    train, val = open_tokens(out, "train", verify=True), open_tokens(out, "val", verify=True)
    # the documented rule: a seeded draw without replacement, both splits in stream order
    val_idx = np.sort(np.random.default_rng(0).choice(n, size=VAL, replace=False))
    mask = np.zeros(n, bool)
    mask[val_idx] = True
    assert np.array_equal(val, rows[mask]) and len(val) == VAL
    assert val_idx[-1] - val_idx[0] > n // 2                            # spread, not the tail
    assert np.array_equal(train, rows[~mask])                          # disjoint, the rest
    meta = read_meta(out)
    assert meta["documents"] == len(corpus["files"]) == summary["documents"]
    assert meta["tokens"] == len(stream) and meta["dropped_tokens"] == len(stream) - n * T
    assert (meta["train_sequences"], meta["val_sequences"]) == (n - VAL, VAL)
    assert (meta["seq_len"], meta["tokenizer"], meta["vocab_size"]) == (T, "gpt2", 50257)
    assert meta["sources"] == [str(corpus["txt"])] and meta["input_files"] == len(corpus["files"])
    assert summary["shards"] == 7 and summary["shards_reused"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_same_bytes_for_any_workers_and_shard_size(corpus, reference, tmp_path):
    ref, _ = reference
    assert run_bytes([corpus["txt"]], tmp_path / "a", workers=2) == outputs(ref)
    assert run_bytes([corpus["txt"]], tmp_path / "b", shard_mb=10) == outputs(ref)
    assert run_bytes([corpus["txt"]], tmp_path / "c", seed=1) != outputs(ref)


def test_jsonl_gzip_and_datasets_inputs_agree(corpus, tmp_path):
    whole = run([corpus["jsonl"]], tmp_path / "whole", shard_mb=10)
    assert whole["documents"] == len(corpus["files"]) and whole["shards"] == 1
    ref = outputs(tmp_path / "whole")
    assert run_bytes([corpus["jsonl"]], tmp_path / "cut", workers=2) == ref  # cut at lines
    gz = tmp_path / "topics.jsonl.gz"
    gz.write_bytes(gzip.compress(corpus["jsonl"].read_bytes()))
    assert run_bytes([gz], tmp_path / "gz") == ref
    datasets = pytest.importorskip("datasets")
    texts = [json.loads(line)["text"] for line in corpus["jsonl"].read_text().splitlines()]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "ds"))
    assert run_bytes([tmp_path / "ds"], tmp_path / "dso", text_field="body", workers=2) == ref
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\]; give one split's"
                                         r" folder, e.g. .*dd/train"):
        run([tmp_path / "dd"], tmp_path / "ddo")
    with pytest.raises(ValueError, match="has no column 'text' \\(columns: body\\); choose one "
                                         "with --text-field"):
        run([tmp_path / "ds"], tmp_path / "dso2")


def test_interrupted_run_resumes_to_the_same_bytes(corpus, reference, tmp_path):
    out = tmp_path / "out"

    def stop_after_3(done, total):
        if done == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(inputs=(str(corpus["txt"]),), out=str(out), seq_len=T,
                              val_sequences=VAL, workers=2, shard_mb=SHARD_MB),
                progress=False, on_shard=stop_after_3)
    assert sorted(p.name for p in out.iterdir()) == [".partial"]       # nothing final yet
    shards = sorted((out / ".partial" / "shards").glob("*.json"))
    assert 3 <= len(shards) < 7
    data = bytearray(shards[0].with_suffix(".bin").read_bytes())     # a damaged finished shard
    data[0] ^= 0xFF
    shards[0].with_suffix(".bin").write_bytes(bytes(data))
    (out / ".partial" / "shards" / "000006.bin.123.tmp").write_bytes(b"torn")
    summary = run([corpus["txt"]], out)
    assert summary["shards_reused"] == len(shards) - 1
    assert outputs(out) == outputs(reference[0])
    assert read_meta(out)["sha256"] == read_meta(reference[0])["sha256"]
    assert not (out / ".partial").exists()


def test_other_inputs_need_restart_and_output_needs_force(corpus, reference, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(inputs=(str(corpus["txt"]),), out=str(out), seq_len=T,
                              val_sequences=VAL, workers=1, shard_mb=SHARD_MB), progress=False,
                on_shard=lambda done, total: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(ValueError, match=r"\.partial holds an unfinished run with other "
                                         r"sources, shards; pass --restart"):
        run([corpus["jsonl"]], out)
    assert run([corpus["jsonl"]], out, restart=True)["shards_reused"] == 0
    with pytest.raises(ValueError, match="already holds prepared data .*pass --force"):
        run([corpus["txt"]], out)
    with pytest.raises(ValueError, match=r"too few sequences: .* = 2,17\d sequences of --seq-len"
                                         r" 64, and --val-sequences 5,000 leaves none"):
        run([corpus["txt"]], out, force=True, val_sequences=5000)
    assert read_meta(out)["sources"] == [str(corpus["jsonl"])]     # the old output survives
    run([corpus["txt"]], out, force=True)
    assert outputs(out) == outputs(reference[0])


def test_input_discovery_and_errors(corpus, tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.txt", "a.jsonl", "sub/c.txt", ".hidden.txt", "notes.md"):
        (tmp_path / name).write_text('{"text": "x"}\n' if name.endswith("l") else "x")
    found = [s.path for s in discover_sources([tmp_path / "sub", tmp_path, str(tmp_path / "*.txt"),
                                               tmp_path / ".hidden.txt"])]
    assert found == [str(tmp_path / n) for n in ("sub/c.txt", "a.jsonl", "b.txt", ".hidden.txt")]
    for inputs, message in [
            ([tmp_path / "missing.txt"], "input .*missing.txt does not exist"),
            ([tmp_path / "notes.md"], "notes.md: unsupported file type; expected .txt, .jsonl"),
            ([str(tmp_path / "*.csv")], r"input pattern '.*\*.csv' matches nothing"),
            ([tmp_path / "sub" / "empty"], "holds no .txt, .jsonl, .jsonl.gz files")]:
        (tmp_path / "sub" / "empty").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match=message):
            discover_sources(inputs)


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "cut', r"bad.jsonl, line 2 \(byte 15\): not a JSON line"),
    ("field.jsonl", b'{"body": "x"}\n', r"field.jsonl, line 1 \(byte 0\): no field 'text' \(has: body\); "
                                         r"choose the text field with --text-field"),
    ("num.jsonl", b'{"text": "a"}\n{"text": 3}\n', r"line 2 \(byte 14\): 'text' is int, expected a string"),
    ("latin.txt", b"caf\xe9", r"latin.txt: not UTF-8 at byte 3 of the file"),
    # mtime=0: the same bytes (and test id) in every process (pytest-xdist's workers)
    ("cut.jsonl.gz", gzip.compress(b'{"text": "x"}\n' * 200, mtime=0)[:-12],
     r"cut.jsonl.gz: corrupt or truncated gzip file"),
], ids=["bad-json", "no-field", "not-a-string", "not-utf8", "cut-gzip"])
def test_corrupt_inputs_are_named(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        run([tmp_path / name], tmp_path / "out", val_sequences=0, seq_len=2)


def test_long_documents_encode_in_pieces_to_the_same_ids(corpus):
    enc = gpt2_encoding()
    text = "\n".join(p.read_text() for p in sorted(corpus["files"])[:20])
    text += "\n\nend  \n \nx\ny\n\n"
    assert encode(enc, text, piece_chars=997).tolist() == enc.encode_ordinary(text)
