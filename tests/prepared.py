"""A prepared token directory of real prose in the format of `moremoe data prepare`: the
standard library's pydoc topics, so it needs nothing offline; byte-level (vocab 256), or
through the GPT-2 tokenizer (the vocabulary `moremoe generate` reads); and a tiny run
trained on such data."""
import json

import numpy as np


def write_token_dir(path, *, seq_len: int = 128, val_sequences: int = 32,
                    gpt2: bool = False):
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    if gpt2:
        from moremoe.tasks.tokenizer import gpt2_encoding
        tokens = np.array(gpt2_encoding().encode_ordinary(text[:400_000]), dtype="<u2")
    else:
        tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<u2")
    rows = tokens[:len(tokens) // seq_len * seq_len].reshape(-1, seq_len)
    val, train = rows[:val_sequences], rows[val_sequences:]
    path.mkdir(parents=True, exist_ok=True)
    train.tofile(path / "train.bin")
    val.tofile(path / "val.bin")
    vocab, eot = (50257, 50256) if gpt2 else (256, 0)
    meta = {"format": "moremoe-tokens", "version": 1, "tokenizer": "gpt2" if gpt2 else "bytes",
            "vocab_size": vocab, "eot_id": eot, "seq_len": seq_len, "dtype": "uint16",
            "train_sequences": int(train.shape[0]), "val_sequences": int(val.shape[0]),
            "seed": 0, "sources": ["pydoc_data.topics"], "documents": len(topics),
            "tokens": int(rows.size), "sha256": {}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


# a tiny run's arguments: the tiny-moe preset on the CPU, one checkpoint after 2 steps
TINY_RUN = ["--preset", "tiny-moe", "--device", "cpu", "--set", "model.seq_len=32",
            "--set", "train.batch_size=2", "--set", "train.log_every=1",
            "--set", "train.eval_batches=1", "--set", "train.ckpt_every=2",
            "--set", "train.max_steps=2"]


def train_tiny_run(data, out):
    """A 2-step run of tiny-moe on prepared data (of its vocabulary)."""
    from moremoe.cli import main
    assert main(["train", "--data", str(data), "--out", str(out), *TINY_RUN, "--json"]) == 0
    return out
