"""The static cache and the static decode step give the tokens of the reference generate():
greedy, batched, at prompt lengths on both sides of a prefill bucket's edge, for MoE, MoRE
and PEER, eagerly and under torch.compile (fullgraph: a step with a host sync or a shape
that depends on the data would not trace). The CUDA-graph capture is tests/model/
test_static_gpu.py."""
import pytest
import torch

from moremoe.model import (StaticDecoder, StaticKVCache, Transformer, TransformerConfig,
                           generate, generate_static)
from moremoe.model import transformer
from moremoe.model.static import bucket, cache_length
from moremoe.nn import MoEConfig, PEERConfig

V = 50
MODELS = [pytest.param(MoEConfig.moe(8, 2, 32, 8), None, id="moe"),
          pytest.param(MoEConfig.more(12, 2, 32, 8, 4), 2, id="more-gqa"),
          pytest.param(PEERConfig(experts=49, hidden=32, heads=2, d_q=8, kappa=3), None,
                       id="peer")]


def tiny(moe, kv_heads=None, max_seq_len=64):
    cfg = TransformerConfig(vocab=V, layers=2, heads=4, kv_heads=kv_heads, moe=moe,
                            max_seq_len=max_seq_len)
    return Transformer(cfg).eval()


def test_buckets_and_cache_length():
    assert [bucket(T, 64) for T in (1, 15, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
    assert bucket(40, 48) == 48                   # never past the cache
    assert cache_length(17, 8, 64) == 32          # the bucket, more than 17 + 8 - 1
    assert cache_length(17, 30, 64) == 46


@pytest.mark.parametrize("moe,kv", MODELS)
def test_static_decoder_greedy_equals_generate(moe, kv):
    model = tiny(moe, kv)
    decoder = StaticDecoder(model, 3, 40)
    for T in (5, 16, 17):                         # buckets 16, 16 and 32: across the edge
        prompt = torch.randint(0, V, (3, T))
        assert decoder.generate(prompt, 12) == generate(model, prompt, 12), T
    assert decoder.replays == 0 and decoder.graph is None     # no CUDA graph on the CPU


@pytest.mark.parametrize("moe,kv", MODELS)
def test_compiled_static_decoder_equals_generate(moe, kv):
    """fullgraph torch.compile of the prefill and the step (aot_eager: the traced graphs,
    functionalised, without the minutes inductor's C++ takes on a CPU)."""
    model = tiny(moe, kv)
    decoder = StaticDecoder(model, 2, 40, compile=True, backend="aot_eager")
    for T in (7, 17):
        prompt = torch.randint(0, V, (2, T))
        assert decoder.generate(prompt, 10) == generate(model, prompt, 10), T


def test_generate_static_stops_and_samples_as_generate():
    model = tiny(MoEConfig.more(12, 2, 32, 8, 4), 2)
    prompt = torch.randint(0, V, (2, 6))
    free = generate(model, prompt, 10)
    eos = free[0][3]
    assert generate_static(model, prompt, 10, eos_id=eos) == generate(model, prompt, 10,
                                                                       eos_id=eos)
    stop = [free[1][2:4]]
    assert generate_static(model, prompt, 10, stop_sequences=stop) == generate(
        model, prompt, 10, stop_sequences=stop)
    runs = [generate_static(model, prompt, 10, temperature=1.0,
                            generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert generate_static(model, prompt, 10, temperature=5.0, top_k=1) == free


@pytest.mark.parametrize("moe,kv", MODELS[:2])
def test_transformer_forward_on_a_static_cache_equals_the_full_forward(moe, kv):
    """Transformer.forward with positions: a prefill chunk, then steps, into a cache longer
    than the sequence (the masked tail holds zeros) give the full forward's logits."""
    model = tiny(moe, kv)
    tokens = torch.randint(0, V, (3, 11))
    cfg = model.config
    cache = StaticKVCache.for_model(cfg, 3, 20, dtype=torch.float32, device="cpu")
    chunks = [(0, 6)] + [(t, t + 1) for t in range(6, 11)]
    got = torch.cat([model(tokens[:, a:b], cache=cache, positions_T=torch.arange(a, b)).logits
                     for a, b in chunks], 1)
    torch.testing.assert_close(got, model(tokens).logits, rtol=1e-5, atol=1e-5)
    last = model(tokens[:, :6], cache=cache, positions_T=torch.arange(6),
                 keep_T=torch.tensor([5])).logits
    torch.testing.assert_close(last, model(tokens[:, :6]).logits[:, 5:], rtol=1e-5, atol=1e-5)


def test_static_decoder_refuses_what_does_not_fit():
    model = tiny(MoEConfig.moe(8, 2, 32, 8), max_seq_len=32)
    decoder = StaticDecoder(model, 2, 20)
    with pytest.raises(ValueError, match=r"holds 2 rows of at most max_len=20"):
        decoder.generate(torch.zeros(3, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"needs 23 cache positions; .* max_len=20"):
        decoder.generate(torch.zeros(2, 4, dtype=torch.long), 20)
    with pytest.raises(ValueError, match=r"exceeds max_seq_len=32"):
        generate_static(model, torch.zeros(1, 30, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="max_len must be in"):
        StaticDecoder(model, 1, 33)
    with pytest.raises(ValueError, match="cuda_graph needs the model on a CUDA device"):
        StaticDecoder(model, 1, 8, cuda_graph=True)
    with pytest.raises(ValueError, match="cache_position"):
        StaticKVCache.for_model(model.config, 1, 8, dtype=torch.float32,
                                device="cpu").update(torch.zeros(1, 4, 1, 8),
                                                     torch.zeros(1, 4, 1, 8), 0)


def test_a_decoder_like_another_shares_its_compiled_functions():
    """A new batch size through like= reuses the compiled step (recompiled with the batch
    dynamic) and still gives the reference tokens; a like of other settings is refused."""
    model = tiny(MoEConfig.moe(8, 2, 32, 8))
    first = StaticDecoder(model, 2, 40, compile=True, backend="aot_eager")
    prompt = torch.randint(0, V, (3, 7))
    second = StaticDecoder(model, 3, 40, compile=True, backend="aot_eager", like=first)
    assert second.fns is first.fns
    assert second.generate(prompt, 8) == generate(model, prompt, 8)
    assert first.generate(prompt[:2], 8) == generate(model, prompt[:2], 8)
    with pytest.raises(ValueError, match=r"like was built with .*True, True, 'aot_eager'"):
        StaticDecoder(model, 3, 40, like=first)
    with pytest.raises(ValueError, match="same model"):
        StaticDecoder(tiny(MoEConfig.moe(8, 2, 32, 8)), 3, 40, compile=True,
                      backend="aot_eager", like=first)


def test_static_attention_takes_rows_in_any_memory_order(monkeypatch):
    """CUDA's fused attention returns its (B, G, rep·T, D) rows with (B, rep·T, G, D) strides:
    the heads must come out the same as from a contiguous result (a view fails there)."""
    torch.manual_seed(0)
    B, H, G, T, S, D = 3, 4, 2, 5, 7, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    positions = torch.arange(2, 2 + T)
    want = transformer.attend_static(q, k, v, positions)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs):            # same values, the fused kernels' memory order
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", strided)
    got = transformer.attend_static(q, k, v, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
