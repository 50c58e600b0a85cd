"""The prepared-text reader: format checks, truncation, corruption, ids out of range."""
import hashlib
import json

import numpy as np
import pytest

from moremoe.tasks.text import open_tokens, read_meta, stdlib_corpus, verify_tokens

T = 8


def write_dir(path, train_NT, val_NT, **meta_overrides):
    """A prepared directory written directly (the format in tasks/text.py)."""
    path.mkdir(parents=True, exist_ok=True)
    sha = {}
    for split, arr in (("train", train_NT), ("val", val_NT)):
        data = np.ascontiguousarray(arr, dtype="<u2").tobytes()
        (path / f"{split}.bin").write_bytes(data)
        sha[f"{split}.bin"] = hashlib.sha256(data).hexdigest()
    n_tokens = (len(train_NT) + len(val_NT)) * T
    meta = {"format": "moremoe-tokens", "version": 1, "tokenizer": "gpt2", "vocab_size": 50257,
            "eot_id": 50256, "seq_len": T, "dtype": "uint16", "train_sequences": len(train_NT),
            "val_sequences": len(val_NT), "seed": 0, "sources": [], "documents": 1,
            "tokens": n_tokens, "dropped_tokens": 0, "sha256": sha, **meta_overrides}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture
def prepared(tmp_path):
    rng = np.random.default_rng(0)
    return write_dir(tmp_path / "d", rng.integers(0, 50257, (5, T)), rng.integers(0, 50257, (2, T)))


def test_open_tokens_reads_both_splits(prepared):
    train = open_tokens(prepared, "train", verify=True)
    assert isinstance(train, np.memmap) and train.shape == (5, T) and train.dtype == np.uint16
    assert np.array_equal(train, np.fromfile(prepared / "train.bin", "<u2").reshape(5, T))
    assert open_tokens(prepared, "val").shape == (2, T)
    report = verify_tokens(prepared)
    assert report["ok"] and report["splits"]["val"]["sequences"] == 2
    with pytest.raises(ValueError, match="split must be one of .*got 'test'"):
        open_tokens(prepared, "test")


def test_truncated_file_names_file_and_sizes(prepared):
    path = prepared / "train.bin"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=rf"{path} has 77 bytes, expected 80 \(5 sequences x 8 "
                                         r"tokens x 2 bytes\): the file is truncated"):
        open_tokens(prepared, "train")
    (prepared / "val.bin").unlink()
    with pytest.raises(ValueError, match=r"val.bin is missing \(meta.json expects 32 bytes\)"):
        open_tokens(prepared, "val")


def test_bit_flip_found_only_by_verify(prepared):
    path = prepared / "val.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    assert open_tokens(prepared, "val").shape == (2, T)      # the size still matches
    with pytest.raises(ValueError, match=rf"{path} has sha256 [0-9a-f]{{64}}, expected .* the "
                                         r"file is corrupt"):
        open_tokens(prepared, "val", verify=True)
    with pytest.raises(ValueError, match="sha256"):
        verify_tokens(prepared)


def test_ids_outside_the_vocabulary(tmp_path):
    bad = write_dir(tmp_path / "bad", np.full((3, T), 7), np.array([[1] * (T - 1) + [50257]]))
    assert open_tokens(bad, "train", verify=True).max() == 7
    with pytest.raises(ValueError, match=r"val.bin holds token id 50257, not below vocab_size "
                                         r"50257"):
        open_tokens(bad, "val", verify=True)


def test_meta_problems(tmp_path, prepared):
    with pytest.raises(ValueError, match="meta.json is missing: .* not a prepared data directory"):
        read_meta(tmp_path)
    (prepared / "meta.json").write_text('{"format": "moremoe-tokens", "vers')
    with pytest.raises(ValueError, match="not valid JSON .* corrupt"):
        read_meta(prepared)
    write_dir(prepared, np.zeros((1, T)), np.zeros((0, T)), version=2)
    with pytest.raises(ValueError, match="format version 2; this moremoe reads version 1"):
        read_meta(prepared)
    write_dir(prepared, np.zeros((1, T)), np.zeros((0, T)), format="npy")
    with pytest.raises(ValueError, match="is not a 'moremoe-tokens' metadata file"):
        read_meta(prepared)
    write_dir(prepared, np.zeros((1, T)), np.zeros((0, T)), tokens=99)
    with pytest.raises(ValueError, match="train \\+ val \\+ dropped tokens = 8, but tokens = 99"):
        verify_tokens(prepared)
    # a digest map that lost its entries: meta.json lacks them, the token files are intact
    write_dir(prepared, np.zeros((1, T)), np.zeros((0, T)), sha256={})
    with pytest.raises(ValueError, match=r"meta.json: its sha256 map holds no digest of "
                                         r"train.bin or val.bin \(64 hex digits each\), so the "
                                         r"files cannot be verified; prepare the data again"):
        verify_tokens(prepared)
    write_dir(prepared, np.zeros((1, T)), np.zeros((0, T)), sha256={"train.bin": "ab"})
    with pytest.raises(ValueError, match=r"no digest of train.bin or val.bin"):
        verify_tokens(prepared)
    assert read_meta(prepared)["seq_len"] == T            # reading needs no digest


def test_empty_split_is_an_empty_array(tmp_path):
    d = write_dir(tmp_path / "d", np.ones((2, T)), np.zeros((0, T)))
    val = open_tokens(d, "val", verify=True)
    assert val.shape == (0, T) and val.dtype == np.uint16


def test_stdlib_corpus(tmp_path):
    txt = stdlib_corpus(tmp_path / "txt")
    assert len(txt) > 50 and all(p.suffix == ".txt" and p.stat().st_size > 0 for p in txt)
    (jsonl,) = stdlib_corpus(tmp_path / "jsonl", format="jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == len(txt)
    assert sum(len(r["text"]) for r in rows) == sum(len(p.read_text()) for p in txt) > 400_000
    with pytest.raises(ValueError, match="format must be 'txt' or 'jsonl', got 'csv'"):
        stdlib_corpus(tmp_path, format="csv")
