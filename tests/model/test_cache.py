"""Decoding with the key/value cache equals the uncached forward; generate() stops where asked."""
import pytest
import torch

from moremoe.model import KVCache, Transformer, TransformerConfig, generate
from moremoe.nn import MoEConfig

V = 50


def tiny(moe, kv_heads=None, max_seq_len=24):
    cfg = TransformerConfig(vocab=V, layers=2, heads=4, moe=moe, kv_heads=kv_heads,
                            max_seq_len=max_seq_len)
    return Transformer(cfg).eval()


MODELS = [pytest.param(MoEConfig.moe(8, 2, 32, 8), None, id="moe-mha"),
          pytest.param(MoEConfig.more(12, 2, 32, 8, 4), 2, id="more-gqa"),
          pytest.param(MoEConfig.more(12, 3, 32, 8, 4), 1, id="more-mqa")]


@pytest.mark.parametrize("moe,kv", MODELS)
def test_prefill_then_steps_equal_full_forward(moe, kv):
    model = tiny(moe, kv)
    tokens = torch.randint(0, V, (3, 13))
    full = model(tokens).logits
    cache = KVCache(13)
    # a prefill, a multi-token chunk (needs the offset causal mask), then single tokens
    chunks = [tokens[:, :5], tokens[:, 5:9]] + [tokens[:, t:t + 1] for t in range(9, 13)]
    got = torch.cat([model(c, cache=cache).logits for c in chunks], dim=1)
    assert cache.get_seq_length() == 13
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_cache_changes_the_result_when_it_holds_a_prefix():
    """The cached keys are used: a token after a prefix is not scored as if alone."""
    model = tiny(MoEConfig.more(12, 2, 32, 8, 4), 2)
    tokens = torch.randint(0, V, (2, 6))
    cache = KVCache(6)
    model(tokens[:, :5], cache=cache)
    with_prefix = model(tokens[:, 5:], cache=cache).logits
    alone = model(tokens[:, 5:]).logits
    assert not torch.allclose(with_prefix, alone, atol=1e-3)


def test_cache_past_max_len_or_max_seq_len_is_an_error():
    model = tiny(MoEConfig.moe(8, 2, 32, 8), max_seq_len=8)
    cache = KVCache(6)
    model(torch.randint(0, V, (1, 5)), cache=cache)
    with pytest.raises(ValueError, match="max_len=6"):
        model(torch.randint(0, V, (1, 2)), cache=cache)
    cache = KVCache(16)
    model(torch.randint(0, V, (1, 7)), cache=cache)
    with pytest.raises(ValueError, match="7 cached plus 2, expected <= max_seq_len=8"):
        model(torch.randint(0, V, (1, 2)), cache=cache)
    with pytest.raises(ValueError, match="do not fit the cache"):
        cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 0)


@pytest.mark.parametrize("moe,kv", MODELS[:2])
def test_generate_with_cache_equals_without(moe, kv):
    model = tiny(moe, kv)
    prompt = torch.randint(0, V, (2, 6))
    cached = generate(model, prompt, 10)
    uncached = generate(model, prompt, 10, use_cache=False)
    assert cached == uncached
    assert [len(r) for r in cached] == [10, 10]
    # greedy by hand: each new token is the argmax after the prompt and the ones before it
    seq = prompt
    for t in range(10):
        nxt = model(seq).logits[:, -1].argmax(-1)
        assert nxt.tolist() == [r[t] for r in cached]
        seq = torch.cat([seq, nxt[:, None]], 1)


def test_generate_stops_per_row_at_eos_and_stop_sequences():
    model = tiny(MoEConfig.moe(8, 2, 32, 8))
    prompt = torch.randint(0, V, (2, 4))
    free = generate(model, prompt, 8)
    eos = free[0][2]                       # row 0 emits it at step 3 (or earlier)
    rows = generate(model, prompt, 8, eos_id=eos)
    assert rows[0] == free[0][:free[0].index(eos) + 1]
    assert rows[1] == (free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1])
    stop = free[1][1:3]
    rows = generate(model, prompt, 8, stop_sequences=[stop])
    assert rows[1][-2:] == stop and len(rows[1]) <= 3
    rows = generate(model, prompt, 8, stop_fn=lambda row: len(row) == 2)
    assert [len(r) for r in rows] == [2, 2]


def test_generate_checks_its_arguments_and_keeps_the_mode():
    model = tiny(MoEConfig.moe(8, 2, 32, 8), max_seq_len=8).train()
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        generate(model, torch.zeros(1, 5, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1.0)
    sampled = generate(model, torch.zeros(2, 2, dtype=torch.long), 3, temperature=1.0,
                       generator=torch.Generator().manual_seed(0))
    assert model.training and all(len(r) == 3 and all(0 <= t < V for t in r) for r in sampled)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((torch.tensor([[3, 50]]), 2), {}, ValueError,
     r"prompt holds token ids from 3 to 50; they must be in \[0, 50\)"),
    ((torch.tensor([[-1, 3]]), 2), {}, ValueError, r"token ids from -1 to 3"),
    ((torch.zeros(0, 3, dtype=torch.long), 2), {}, ValueError, r"got shape \(0, 3\)"),
    ((torch.zeros(1, 2, dtype=torch.long), 2), {"temperature": float("nan")}, ValueError,
     r"temperature must be a finite number >= 0, got nan"),
    ((torch.zeros(1, 2, dtype=torch.long), 2), {"temperature": "0.7"}, TypeError,
     r"temperature must be a number, got str"),
    ((torch.zeros(1, 2, dtype=torch.long), 2), {"eos_id": "7"}, TypeError,
     r"eos_id must be an int, got str"),
    ((torch.zeros(1, 2, dtype=torch.long), 2), {"stop_sequences": [5]}, TypeError,
     r"stop_sequences must be a list of token-id lists, got \[5\]"),
    ((torch.zeros(1, 2, dtype=torch.long), 2), {"temperature": 1.0, "generator": 3}, TypeError,
     r"generator must be a torch.Generator or None, got int"),
])
def test_generate_names_a_bad_argument(args, kwargs, error, match):
    model = tiny(MoEConfig.moe(8, 2, 32, 8), max_seq_len=8)
    with pytest.raises(error, match=match):
        generate(model, *args, **kwargs)
    with pytest.raises(TypeError, match="model must be a moremoe Transformer, got str"):
        generate("gpt2", torch.zeros(1, 2, dtype=torch.long), 2)
