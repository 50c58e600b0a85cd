"""`moremoe generate` on each device, from a checkpoint written here (no training): greedy
tokens equal the reference generate() on the same device in fp32; on a GPU every token after
the prefill is one replay of the captured step, and the default dtype there is bf16
(`pytest -m gpu` for the GPU case)."""
import json

import pytest
import torch

pytest.importorskip("tiktoken")

from moremoe.cli import main  # noqa: E402
from moremoe.model import Transformer, TransformerConfig, generate  # noqa: E402
from moremoe.nn import MoEConfig  # noqa: E402
from moremoe.tasks.tokenizer import VOCAB_SIZE, gpt2_encoding  # noqa: E402
from moremoe.training.checkpoint import save_checkpoint  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])]


def _run(capsys, argv) -> dict:
    capsys.readouterr()
    assert main(argv + ["--json", "--no-progress", "--ignore-eos"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("device", DEVICES)
def test_generate_on_a_device_equals_the_reference(capsys, tmp_path, device):
    cfg = TransformerConfig(vocab=VOCAB_SIZE, layers=2, heads=4, kv_heads=2, max_seq_len=64,
                            moe=MoEConfig.more(64, 4, 64, 16, 8))
    model = Transformer(cfg).eval()
    ckpt = save_checkpoint(tmp_path / "run", 1, model.state_dict(), model_config=cfg,
                           run_config={}, state={}, keep=1)
    prompt = "The quick brown fox"
    argv = ["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "10",
            "--device", device]
    out = _run(capsys, argv + ["--dtype", "float32"])
    ids = gpt2_encoding().encode(prompt)
    model = model.to(device)
    want = generate(model, torch.tensor([ids], device=device), 10)[0]
    row = out["results"][0]
    assert row["token_ids"] == want and out["dtype"] == "float32"
    assert row["replays"] == (9 if device == "cuda" else 0)
    assert row["prefill_ms"] > 0 and row["ms_per_token"] > 0
    default = _run(capsys, argv)
    assert default["dtype"] == ("bfloat16" if device == "cuda" else "float32")
    assert len(default["results"][0]["token_ids"]) == 10
