"""The transformer: parameter count equals the accounting, causality, GQA, losses."""
import pytest
import torch

from moremoe.model import IGNORE_INDEX, Transformer, TransformerConfig
from moremoe.model.transformer import apply_rotary, padded_linear, repeat_kv, rotary_tables
from moremoe.nn import MoEConfig


def tiny(moe=None, **kw):
    moe = moe or MoEConfig.more(12, 2, 32, 8, 4)
    return TransformerConfig(vocab=50, layers=2, heads=4, moe=moe, max_seq_len=20, **kw)


@pytest.mark.parametrize("moe,kv", [(MoEConfig.moe(8, 2, 32, 8), None),
                                    (MoEConfig.more(12, 2, 32, 8, 4), 2),
                                    (MoEConfig.more(12, 2, 32, 8, 4), 1)])
def test_parameter_count_equals_accounting(moe, kv):
    cfg = tiny(moe, kv_heads=kv)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.total_params()


def test_causal_future_tokens_do_not_change_past_logits():
    model = Transformer(tiny(kv_heads=2)).eval()
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50
    a, b = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_losses_and_their_sum():
    model = Transformer(tiny()).train()
    tokens = torch.randint(0, 50, (3, 10))
    targets = tokens.roll(-1, 1)
    targets[:, -1] = IGNORE_INDEX
    out = model(tokens, targets)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 50), targets.reshape(-1),
                                           ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.lm_loss, ce)
    assert len(out.switch_losses) == 2
    torch.testing.assert_close(out.aux_loss, 0.001 * sum(out.switch_losses))
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name


@pytest.mark.parametrize("moe", [MoEConfig.moe(8, 2, 32, 8), MoEConfig.more(12, 2, 32, 8, 4)])
def test_a_block_returns_a_gradient_only_where_the_model_takes_one(moe):
    """A compiled block gives each returned tensor that requires grad a tangent, zeros where
    none arrives: past the residual add its MoE output carries a gradient in aux_loss
    only (y, the Switch loss and the router's tensors are detached)."""
    model = Transformer(tiny(moe)).train()
    x = model.embed(torch.randint(0, 50, (2, 6)))
    y, out = model.blocks[0](x, model.rope_cos[:6], model.rope_sin[:6], True)
    assert y.requires_grad and out.aux_loss.requires_grad
    r = out.router
    assert not any(t.requires_grad for t in (out.y, out.switch_loss, r.topk_val, r.gates,
                                             r.psum))


def test_eval_mode_has_no_aux_and_counts_on_request():
    model = Transformer(tiny()).eval()
    out = model(torch.randint(0, 50, (2, 6)), return_counts=True)
    assert out.aux_loss is None and out.loss is None
    assert [int(c.sum()) for c in out.expert_counts] == [2 * 6 * 2] * 2


def test_rotary_preserves_norm_and_encodes_relative_position():
    cos, sin = rotary_tables(16, 8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    dots = []
    for shift in (0, 5):
        qm = apply_rotary(q.expand(1, 1, 16, 8).contiguous(), cos, sin)
        km = apply_rotary(k.expand(1, 1, 16, 8).contiguous(), cos, sin)
        dots.append((qm[0, 0, 3 + shift] * km[0, 0, 1 + shift]).sum())
        torch.testing.assert_close(qm.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 16))
    torch.testing.assert_close(dots[0], dots[1])


def test_config_errors():
    with pytest.raises(ValueError, match="kv_heads must divide heads=4, got 3"):
        tiny(kv_heads=3)
    with pytest.raises(ValueError, match=r"kv_heads must be in \[1, 4\], got 8"):
        tiny(kv_heads=8)
    with pytest.raises(ValueError, match="heads must divide hidden=32"):
        TransformerConfig(vocab=50, layers=1, heads=5, moe=MoEConfig.moe(4, 2, 32, 8))
    model = Transformer(tiny())
    with pytest.raises(ValueError, match="sequence length 21, expected <= max_seq_len=20"):
        model(torch.zeros(1, 21, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        model(torch.zeros(1, 4))


def test_config_round_trips_through_dict():
    cfg = tiny(kv_heads=2)
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("V,multiple", [(37, 8), (40, 8), (1, 64)])
def test_padded_linear_equals_linear_in_values_and_gradients(V, multiple):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 16, dtype=torch.float64, requires_grad=True)
    out = padded_linear(x, w, multiple)
    ref = torch.nn.functional.linear(x, w)
    assert out.shape == ref.shape
    assert out.stride(-2) == V + (-V % multiple)          # rows of the padded product
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(dx, rx)
    torch.testing.assert_close(dw, rw)
    assert dw.shape == w.shape


@pytest.mark.parametrize("rep", [1, 2, 3])
def test_repeat_kv_is_repeat_interleave_in_values_and_gradients(rep):
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    got, want = repeat_kv(x, rep), x.repeat_interleave(rep, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0],
                               torch.autograd.grad(want, x, g)[0])


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_native_gqa_maps_heads_as_repeat_kv(device, monkeypatch):
    """SDPA's enable_gqa (taken on capable GPUs) and the repeated heads (everywhere else)
    give the same attention and gradients: query head g·rep + r reads key/value head g in
    both. On the CPU the native path is forced (SDPA's math kernel honours it)."""
    import moremoe.model.transformer as tr
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    torch.manual_seed(0)
    attn = tr.Attention(TransformerConfig(vocab=50, layers=1, heads=8, kv_heads=2,
                                          moe=MoEConfig.moe(4, 2, 64, 8), max_seq_len=40),
                        ).to(device, dtype)
    x = torch.randn(3, 37, 64, device=device, dtype=dtype)
    cos, sin = (t.to(device) for t in rotary_tables(37, attn.head_dim, 10000.0))
    outs = []
    for native in (True, False):
        if device == "cpu":
            monkeypatch.setattr(tr, "_native_gqa", lambda q, kw, native=native: native)
        elif not native:
            monkeypatch.setattr(tr, "_native_gqa", lambda q, kw: False)
        else:
            assert tr._native_gqa(x[:, None], {"is_causal": True})
        attn.zero_grad()
        y = attn(x, cos, sin)
        y.float().square().sum().backward()
        outs.append([y.detach().float()] + [p.grad.float() for p in attn.parameters()])
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, **tol)
    assert not tr._native_gqa(torch.zeros(1, 1, 1, 1), {"is_causal": True})


def test_compiled_blocks_and_loss_match_eager():
    torch.manual_seed(0)
    model = Transformer(tiny(kv_heads=2))
    tokens = torch.randint(0, 50, (2, 9))
    targets = tokens.clone()
    targets[0, :3] = IGNORE_INDEX

    def run():
        out = model(tokens, targets)
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        return out, grads
    want, want_g = run()
    names = [n for n, _ in model.named_parameters()]
    model.compile_blocks(backend="aot_eager")
    got, got_g = run()
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("full", [False, True])
def test_checkpointed_blocks_keep_less_and_give_the_same_loss_and_gradients(full):
    """Activation checkpointing (train.activation_checkpointing): the blocks keep only their
    inputs for the backward; what it computes is the same (the same kernels run again:
    within a few float32 ulps)."""
    torch.manual_seed(0)
    model = Transformer(tiny(kv_heads=2)).train()
    tokens = torch.randint(0, 50, (2, 9))

    def run():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = model(tokens, tokens.roll(-1, 1))
        return out, torch.autograd.grad(out.loss, list(model.parameters())), len(saved)
    want, want_g, want_n = run()
    names = [n for n, _ in model.named_parameters()]
    model.checkpoint_blocks(full=full)
    got, got_g, got_n = run()
    assert [n for n, _ in model.named_parameters()] == names
    assert got_n < want_n / 2
    close = dict(rtol=4 * 2 ** -23, atol=1e-7)
    torch.testing.assert_close(got.loss, want.loss, **close)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **close)
    with torch.no_grad():                         # inference: no recomputation to arrange
        torch.testing.assert_close(model(tokens).logits, want.logits.detach(), **close)


def test_compiled_blocks_without_the_moe_layers_leave_them_eager():
    model = Transformer(tiny())
    model.compile_blocks(backend="aot_eager", moe=False)
    block = model.blocks[0]
    assert all(hasattr(m, "_compiled_call_impl") and m._compiled_call_impl is not None
               for m in (block.attn_norm, block.attn, block.moe_norm))
    assert getattr(block, "_compiled_call_impl", None) is None
    assert getattr(block.moe, "_compiled_call_impl", None) is None


def test_compile_options_reach_every_compiled_part(monkeypatch):
    """compile_blocks(options=...) hands inductor's settings to each block and to the loss,
    in place of the mode (torch.compile refuses both); without options the mode goes."""
    import moremoe.model.transformer as tr
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: seen.append((type(self).__name__, kw)))
    monkeypatch.setattr(tr.torch, "compile", lambda fn, **kw: seen.append(("loss", kw)) or fn)
    model = Transformer(tiny())
    model.compile_blocks(options={"combo_kernels": True})
    assert len(seen) == len(model.blocks) + 1
    assert all(kw == {"backend": "inductor", "options": {"combo_kernels": True}}
               for _, kw in seen), seen
    seen.clear()
    model.compile_blocks(mode="max-autotune")
    assert seen[0][1] == {"backend": "inductor", "mode": "max-autotune"}
    assert seen[-1] == ("loss", {"backend": "inductor"})
