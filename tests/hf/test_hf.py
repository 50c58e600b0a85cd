"""transformers interop: exact save/load round trip, generate() with the cache, shared weights."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from moremoe.hf import MoremoeConfig, MoremoeForCausalLM, export, register  # noqa: E402
from moremoe.hf.modeling_moremoe import CACHE_FIELD  # noqa: E402
from moremoe.model import Transformer, TransformerConfig, generate  # noqa: E402
from moremoe.nn import MoEConfig, PEERConfig  # noqa: E402
from numerics import model_reduction_length, reduction_tol  # noqa: E402

V = 64
MODELS = [pytest.param(MoEConfig.moe(8, 2, 32, 8), None, id="moe-mha"),
          pytest.param(MoEConfig.more(12, 2, 32, 8, 4), 2, id="more-gqa")]
PEER = pytest.param(PEERConfig(experts=49, hidden=32, heads=2, d_q=8, kappa=3), None,
                    id="peer")


def tiny(moe, kv_heads=None):
    cfg = TransformerConfig(vocab=V, layers=2, heads=4, kv_heads=kv_heads, moe=moe,
                            max_seq_len=32)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("moe,kv", [*MODELS, PEER])
def test_save_and_auto_load_round_trip_exactly(tmp_path, moe, kv):
    register()
    model = tiny(moe, kv)
    export(model, tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors" in files and "config.json" in files
    assert not any(f.endswith((".bin", ".pt")) for f in files)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(loaded, MoremoeForCausalLM)
    assert loaded.config.to_transformer_config() == model.config
    want, got = model.state_dict(), loaded.to_transformer().state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    tokens = torch.randint(0, V, (2, 11))
    torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits,
                               **reduction_tol(torch.float32,
                                               model_reduction_length(model.config)))
    # the rotary tables are never saved: loading must rebuild them, not leave them empty
    assert torch.equal(loaded.to_transformer().rope_cos, model.rope_cos)


def _loaded(model, tmp_path, how):
    """The model exported, then loaded back as users load it: through register() and the
    Auto classes, or by trust_remote_code without register()."""
    export(model, tmp_path / how)
    if how == "register":
        register()
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / how).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / how,
                                                             trust_remote_code=True).eval()


@pytest.mark.parametrize("how", ["register", "remote_code"])
@pytest.mark.parametrize("moe,kv", MODELS)
def test_generate_with_cache_equals_uncached_greedy(tmp_path, monkeypatch, moe, kv, how):
    """An exported model's generate() on the installed transformers, whichever name it
    gives the cache (past_key_values, cache): the cache is used, and the same greedy tokens
    come with it, without it and from moremoe's own generate."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = tiny(moe, kv)
    hf = _loaded(model, tmp_path, how)
    prompt = torch.randint(0, V, (2, 7))
    runs = {}
    for use_cache in (True, False):
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                          do_sample=False, use_cache=use_cache, return_dict_in_generate=True)
        assert torch.equal(out.sequences[:, :7], prompt)
        runs[use_cache] = out.sequences[:, 7:].tolist()
        if use_cache:      # it holds every position but the last token's
            cache = getattr(out, CACHE_FIELD)
            length = (cache.get_seq_length() if hasattr(cache, "get_seq_length")
                      else cache[0][0].shape[-2])        # transformers 4.x: legacy tuples
            assert length == 7 + 12 - 1
    assert runs[True] == runs[False] == generate(model, prompt, 12, use_cache=False)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_past_max_seq_len_fails_alike_with_and_without_the_cache(use_cache):
    """max_seq_len = 32: a prompt of 33 tokens, or 30 tokens and 5 new ones, are refused the
    same way with the cache as without it (a dropped cache used to let them run on)."""
    hf = MoremoeForCausalLM.from_transformer(tiny(MoEConfig.more(12, 2, 32, 8, 4), 2))
    for T, new in ((33, 1), (30, 5)):
        prompt = torch.randint(0, V, (1, T))
        with pytest.raises(ValueError, match="expected <= max_seq_len=32"):
            hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                        do_sample=False, use_cache=use_cache)


def test_forward_with_transformers_cache_equals_full_forward():
    hf = MoremoeForCausalLM.from_transformer(tiny(MoEConfig.more(12, 2, 32, 8, 4), 2))
    tokens = torch.randint(0, V, (2, 9))
    full = hf(tokens, use_cache=False)
    assert getattr(full, CACHE_FIELD) is None
    first = hf(tokens[:, :6], use_cache=True)
    rest = hf(tokens[:, 6:], past_key_values=getattr(first, CACHE_FIELD), use_cache=True)
    assert getattr(rest, CACHE_FIELD).get_seq_length() == 9
    again = hf(tokens[:, 6:], cache=getattr(first, CACHE_FIELD).__class__(), use_cache=True)
    assert getattr(again, CACHE_FIELD).get_seq_length() == 3      # given as `cache`
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full.logits,
                               rtol=1e-5, atol=1e-5)


def test_wrapping_shares_the_weights_and_labels_give_the_shifted_loss():
    model = tiny(MoEConfig.moe(8, 2, 32, 8))
    hf = MoremoeForCausalLM.from_transformer(model)
    assert hf.to_transformer() is model
    assert hf.model.embed.weight.data_ptr() == model.embed.weight.data_ptr()
    tokens = torch.randint(0, V, (2, 8))
    labels = tokens.clone()
    labels[0, 5:] = -100
    out = hf(tokens, labels=labels, use_cache=False)
    logp = torch.log_softmax(model(tokens).logits.float(), -1)
    picked = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(out.loss, -picked[keep].mean())


def test_padding_and_inconsistent_configs_are_refused():
    hf = MoremoeForCausalLM.from_transformer(tiny(MoEConfig.moe(8, 2, 32, 8)))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded inputs"):
        hf(torch.zeros(2, 5, dtype=torch.long), attention_mask=mask)
    with pytest.raises(ValueError, match="hidden_size must equal"):
        MoremoeConfig(moe=MoEConfig.moe(8, 2, 32, 8).to_dict(), hidden_size=64)
    with pytest.raises(ValueError, match="heads must divide"):
        MoremoeConfig(moe=MoEConfig.moe(8, 2, 32, 8).to_dict(), num_attention_heads=5)


def test_gpt2_vocabulary_sets_end_of_text_as_eos_and_bos():
    moe = MoEConfig.more(8, 2, 32, 8, 4)
    gpt2 = MoremoeConfig.from_transformer_config(TransformerConfig(vocab=50257, layers=1,
                                                                   heads=2, moe=moe))
    assert gpt2.eos_token_id == gpt2.bos_token_id == 50256
    other = MoremoeConfig.from_transformer_config(TransformerConfig(vocab=300, layers=1,
                                                                    heads=2, moe=moe))
    assert getattr(other, "eos_token_id", None) is None
    given = MoremoeConfig.from_transformer_config(TransformerConfig(vocab=50257, layers=1,
                                                                    heads=2, moe=moe),
                                                  eos_token_id=7)
    assert given.eos_token_id == 7


def test_remote_code_loads_without_importing_moremoe(tmp_path):
    """config.json's auto_map and the two modules beside the weights: a fresh interpreter
    that never imports moremoe itself loads the model with trust_remote_code=True."""
    import json
    import os
    import subprocess
    import sys
    model = tiny(MoEConfig.more(12, 2, 32, 8, 4), 2)
    export(model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_moremoe.MoremoeForCausalLM"
    tokens = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    code = ("import sys, torch, transformers\n"
            "assert 'moremoe' not in sys.modules\n"
            f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r}, "
            "trust_remote_code=True).eval()\n"
            f"torch.save(m(torch.load({str(tmp_path / 'tokens.pt')!r})).logits, "
            f"{str(tmp_path / 'logits.pt')!r})\n"
            "print(type(m).__name__)\n")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("MoremoeForCausalLM")
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), model(tokens).logits,
                               **reduction_tol(torch.float32,
                                               model_reduction_length(model.config)))


def test_inputs_embeds_equal_the_token_path():
    model = tiny(MoEConfig.moe(8, 2, 32, 8))
    hf = MoremoeForCausalLM.from_transformer(model).eval()
    tokens = torch.randint(0, V, (2, 7))
    by_ids = hf(input_ids=tokens, use_cache=False).logits
    by_embeds = hf(inputs_embeds=model.embed(tokens), use_cache=False).logits
    assert torch.equal(by_ids, by_embeds)
    with pytest.raises(ValueError, match="exactly one of them"):
        hf(input_ids=tokens, inputs_embeds=model.embed(tokens))
    with pytest.raises(ValueError, match="hidden"):
        hf(inputs_embeds=torch.randn(1, 3, 5))


def _static_cache_takes_our_config() -> bool:
    """transformers' StaticCache reads config.head_dim whenever the attribute exists; before
    it fell back on hidden_size // heads for None (transformers 4.46 did not), our config's
    head_dim=None (derived) cannot size it."""
    from transformers.cache_utils import StaticCache
    try:
        StaticCache(config=MoremoeConfig(num_attention_heads=4, moe=MoEConfig.moe(
            4, 1, 16, 8).to_dict()), max_batch_size=1, max_cache_len=4)
    except TypeError as err:             # torch.zeros of a shape holding None
        if "unpack" not in str(err):
            raise
        return False
    return True


static_cache = pytest.mark.skipif(not _static_cache_takes_our_config(),
                                  reason="this transformers' StaticCache needs a set head_dim")


@static_cache
@pytest.mark.parametrize("moe,kv", [*MODELS, PEER])
def test_generate_with_the_static_cache_equals_ours(tmp_path, moe, kv):
    """transformers' StaticCache (positions counted on the device, a 4-D mask it builds):
    the exported model's greedy tokens are moremoe's own."""
    model = tiny(moe, kv)
    hf = _loaded(model, tmp_path, "register")
    prompt = torch.randint(0, V, (2, 7))
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                      do_sample=False, cache_implementation="static",
                      return_dict_in_generate=True)
    assert type(getattr(out, CACHE_FIELD)).__name__ == "StaticCache"
    assert out.sequences[:, 7:].tolist() == generate(model, prompt, 12)


@static_cache
def test_static_cache_refuses_padding_and_lengths_past_max_seq_len(tmp_path):
    hf = _loaded(tiny(MoEConfig.more(12, 2, 32, 8, 4), 2), tmp_path, "register")
    prompt = torch.randint(0, V, (2, 6))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded inputs"):
        hf.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False,
                    cache_implementation="static")
    with pytest.raises(ValueError, match=r"static cache holds 35 positions .* <= "
                                         r"max_seq_len=32"):
        hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30,
                    do_sample=False, cache_implementation="static")


@static_cache
def test_compiled_static_cache_generate_traces_whole_and_equals_ours(tmp_path):
    """The decoding step transformers compiles (fullgraph; aot_eager on the CPU, where it
    would not compile by itself) traces without a break and keeps the tokens."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig
    model = tiny(MoEConfig.more(12, 2, 32, 8, 4), 2)
    hf = _loaded(model, tmp_path, "register")
    prompt = torch.randint(0, V, (2, 5))
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None, dynamic=False)
    config._compile_all_devices = True
    graphs = counters["stats"]["unique_graphs"]
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                      do_sample=False, cache_implementation="static", compile_config=config)
    assert counters["stats"]["unique_graphs"] > graphs
    assert out[:, 5:].tolist() == generate(model, prompt, 6)
