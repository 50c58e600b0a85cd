"""evaluate_perplexity: the token-weighted mean next-token loss, in any batch size."""
import math

import numpy as np
import pytest
import torch

from moremoe.eval.perplexity import evaluate_perplexity
from moremoe.model import Transformer, TransformerConfig
from moremoe.nn.moe import MoEConfig


def test_matches_the_models_own_loss_in_any_batch_size():
    cfg = TransformerConfig(vocab=40, layers=1, heads=2, max_seq_len=16,
                            moe=MoEConfig.moe(4, 2, 16, 8))
    model = Transformer(cfg).train()
    seqs = np.random.default_rng(0).integers(0, 40, size=(7, 12)).astype(np.uint16)
    t = torch.from_numpy(seqs.astype(np.int64))
    with torch.no_grad():
        model.eval()
        expected = model(t[:, :-1], t[:, 1:]).lm_loss.item()
        model.train()
    for bs in (1, 3, 7, 100):
        r = evaluate_perplexity(model, seqs, batch_size=bs)
        assert r["loss"] == pytest.approx(expected, rel=1e-6)
        assert r["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
        assert r["tokens"] == 7 * 11
    assert model.training                                    # mode restored
    part = evaluate_perplexity(model, t, batch_size=2, max_batches=2, return_counts=True)
    assert part["tokens"] == 4 * 11
    assert [int(c.sum()) for c in part["expert_counts"]] == [4 * 11 * 2]
    with pytest.raises(ValueError, match="seqs_NT must be"):
        evaluate_perplexity(model, seqs[:, :1])


def test_the_loss_in_chunks_of_logits_is_the_whole_batchs(monkeypatch):
    """The cross-entropy over chunks of a few rows (each cast to fp32 alone) sums to the
    loss of the whole batch at once."""
    import moremoe.eval.perplexity as perplexity
    cfg = TransformerConfig(vocab=40, layers=1, heads=2, max_seq_len=16,
                            moe=MoEConfig.moe(4, 2, 16, 8))
    model = Transformer(cfg)
    seqs = np.random.default_rng(1).integers(0, 40, size=(5, 12)).astype(np.uint16)
    whole = evaluate_perplexity(model, seqs, batch_size=5)
    calls = []
    real = perplexity.F.cross_entropy
    monkeypatch.setattr(perplexity, "CE_CHUNK", 3 * 40)          # 3 rows a chunk
    monkeypatch.setattr(perplexity.F, "cross_entropy",
                        lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    chunked = evaluate_perplexity(model, seqs, batch_size=5)
    assert calls == [3] * 18 + [1]                              # 55 rows in chunks of 3
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-6)
