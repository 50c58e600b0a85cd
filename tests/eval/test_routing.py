"""H_norm and per-layer counts over a data set."""
import math

import pytest
import torch

from moremoe.eval.routing import layer_expert_counts, normalized_entropy, routing_hnorm
from moremoe.model import Transformer, TransformerConfig
from moremoe.nn import MoEConfig


def test_normalized_entropy_extremes_and_value():
    assert normalized_entropy(torch.tensor([5, 5, 5, 5])) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([0, 9, 0, 0])) == pytest.approx(0.0)
    p = torch.tensor([1.0, 3.0]) / 4
    assert normalized_entropy(torch.tensor([1, 3])) == pytest.approx(
        float(-(p * p.log()).sum() / math.log(2)))
    assert normalized_entropy(torch.zeros(4)) == 0.0


def test_counts_accumulate_over_batches():
    cfg = TransformerConfig(vocab=20, layers=3, heads=2, max_seq_len=8,
                            moe=MoEConfig.more(10, 2, 16, 4, 4))
    model = Transformer(cfg).train()
    tokens = torch.randint(0, 20, (37, 8))
    whole = layer_expert_counts(model, tokens, batch_size=100)
    split = layer_expert_counts(model, tokens, batch_size=5)
    assert model.training                      # mode restored
    assert len(whole) == 3
    for a, b in zip(whole, split):
        assert torch.equal(a, b) and int(a.sum()) == 37 * 8 * 2
    hn = routing_hnorm(model, tokens)
    assert len(hn) == 3 and all(0 < v <= 1 for v in hn)
