"""The next-token choice on hand-built logits: top-k and top-p keep exactly the tokens they
name, the draws follow the kept probabilities, a generator makes them reproducible."""
import math

import pytest
import torch

from moremoe.model.sampling import Sampling, restrict, sample

# probabilities 0.5, 0.3, 0.15, 0.05 and then tokens of probability 0
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
LOGITS = torch.log(PROBS)


def _support(sampling: Sampling, rows: int = 4000) -> dict:
    g = torch.Generator().manual_seed(0)
    drawn = sample(LOGITS.expand(rows, -1), sampling, g)
    return {int(t): int(n) / rows for t, n in zip(*torch.unique(drawn, return_counts=True))}


@pytest.mark.parametrize("top_k,top_p,kept", [(None, None, [0, 1, 2, 3]), (2, None, [0, 1]),
                                              (3, None, [0, 1, 2]), (None, 0.5, [0]),
                                              (None, 0.7, [0, 1]), (None, 0.79, [0, 1]),
                                              (None, 0.81, [0, 1, 2]), (3, 0.99, [0, 1, 2]),
                                              (1, 1.0, [0])])
def test_top_k_and_top_p_keep_exactly_their_tokens(top_k, top_p, kept):
    out = restrict(LOGITS[None], top_k, top_p)[0]
    assert torch.isfinite(out).nonzero()[:, 0].tolist() == kept
    assert torch.equal(out[kept], LOGITS[kept])
    assert sorted(_support(Sampling(1.0, top_k, top_p))) == kept


def test_draws_follow_the_kept_probabilities():
    freq = _support(Sampling(1.0), rows=20000)
    for t, p in enumerate(PROBS[:4].tolist()):
        assert abs(freq[t] - p) < 0.02, (t, freq[t], p)
    freq = _support(Sampling(1.0, top_p=0.7), rows=20000)       # 0.5 : 0.3 renormalised
    assert abs(freq[0] - 0.625) < 0.02 and abs(freq[1] - 0.375) < 0.02


def test_temperature_zero_is_the_argmax_and_a_generator_repeats_its_draws():
    logits = torch.randn(5, 30)
    assert torch.equal(sample(logits), logits.argmax(-1))
    draws = [sample(logits, Sampling(0.8, 10, 0.9), torch.Generator().manual_seed(4))
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(sample(logits, Sampling(1e-6)), logits.argmax(-1))   # tiny T: greedy


def test_a_temperature_or_top_p_below_float32s_range_still_keeps_the_likeliest():
    """logits / 1e-40 overflows and top_p = 1e-300 rounds to 0 in float32: neither may turn
    the row into NaN (whose argmax is token 0); both leave the argmax."""
    logits = torch.randn(6, 50) * 3
    logits[:, 0] = -10.0                          # token 0 is never the answer
    best = logits.argmax(-1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, Sampling(1e-40), g), best)
    assert torch.equal(sample(logits, Sampling(1.0, top_p=1e-300), g), best)
    assert torch.isfinite(restrict(logits, None, 1e-300)).sum(-1).tolist() == [1] * 6


@pytest.mark.parametrize("kw,match", [({"temperature": -1.0}, "temperature"),
                                      ({"temperature": math.nan}, "temperature"),
                                      ({"top_k": 0}, "top_k must be >= 1"),
                                      ({"top_p": 0.0}, "top_p"),
                                      ({"top_p": 1.5}, r"top_p must be in \(0, 1\]")])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)
