"""A prepared token directory of real prose, byte-level (vocab 256), in the format of
`moremoe data prepare`: the standard library's pydoc topics, so it needs nothing offline."""
import json

import numpy as np
import pytest
import torch

from runs import SMALL, quiet


def write_token_dir(path, *, seq_len: int = 128, val_sequences: int = 32):
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<u2")
    rows = tokens[:len(tokens) // seq_len * seq_len].reshape(-1, seq_len)
    val, train = rows[:val_sequences], rows[val_sequences:]
    path.mkdir(parents=True, exist_ok=True)
    train.tofile(path / "train.bin")
    val.tofile(path / "val.bin")
    meta = {"format": "moremoe-tokens", "version": 1, "tokenizer": "bytes", "vocab_size": 256,
            "eot_id": 0, "seq_len": seq_len, "dtype": "uint16",
            "train_sequences": int(train.shape[0]), "val_sequences": int(val.shape[0]),
            "seed": 0, "sources": ["pydoc_data.topics"], "documents": len(topics),
            "tokens": int(rows.size), "sha256": {}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    return write_token_dir(tmp_path_factory.mktemp("tokens"))


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def reference_run(text_data, tmp_path_factory):
    """The uninterrupted tiny-more run every interrupted one is compared with."""
    from moremoe.training.config import build_run_config
    from moremoe.training.lm import train
    out = tmp_path_factory.mktemp("ref") / "run"
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(build_run_config(preset="tiny-more", data=str(text_data), out=str(out),
                               device="cpu", overrides=SMALL), echo=quiet)
    finally:
        torch.set_num_threads(old)
    return out
