"""PEER (the paper's Appendix B baseline): product-key retrieval equals the naive top-k over
all M scores, every parameter gets a gradient, the accounting matches the module."""
import math

import pytest
import torch

from moremoe.accounting import peer_params
from moremoe.nn.peer import PEERConfig, PEERLayer, peer_reference
from moremoe.ops.peer_retrieval import peer_retrieval_ref


def _layer(M=64, h=24, heads=3, d_q=10, kappa=4, seed=0):
    torch.manual_seed(seed)
    layer = PEERLayer(PEERConfig(experts=M, hidden=h, heads=heads, d_q=d_q, kappa=kappa,
                                 init_std=0.3)).double()
    return layer


def test_product_keys_find_the_top_kappa_of_all_m_scores():
    torch.manual_seed(1)
    q, keys = torch.randn(50, 3, 12, dtype=torch.float64), torch.randn(2, 9, 6,
                                                                       dtype=torch.float64)
    scores, ids = peer_retrieval_ref(q, keys, 5)
    full = ((q[..., :6] @ keys[0].T)[..., :, None] + (q[..., 6:] @ keys[1].T)[..., None, :])
    want = full.reshape(50, 3, 81).topk(5, dim=-1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(scores, want.values)


@pytest.mark.parametrize("kappa", [1, 2, 9])
def test_pruned_grid_keeps_the_top_kappa_at_every_kappa(kappa):
    """Only grid candidates with (i+1)(j+1) <= kappa are scored: the top kappa is still
    that of all M scores, from kappa = 1 to kappa = sqrt(M)."""
    torch.manual_seed(kappa)
    q, keys = torch.randn(40, 2, 8, dtype=torch.float64), torch.randn(2, 9, 4,
                                                                      dtype=torch.float64)
    scores, ids = peer_retrieval_ref(q, keys, kappa)
    full = ((q[..., :4] @ keys[0].T)[..., :, None] + (q[..., 4:] @ keys[1].T)[..., None, :])
    want = full.reshape(40, 2, 81).topk(kappa, dim=-1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(scores, want.values)


def test_fused_experts_equal_the_torch_path():
    """impl="triton" (the interpreter on CPU) against impl="reference" on one layer: y and
    every gradient, with an expert retrieved by two heads of a token allowed."""
    pytest.importorskip("triton")
    from dataclasses import replace
    from moremoe import kernels
    if not kernels.usable_on(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    torch.manual_seed(0)
    layer = PEERLayer(PEERConfig(experts=49, hidden=24, heads=3, d_q=8, kappa=3)).train()
    x = torch.randn(2, 9, 24)
    runs = []
    for impl in ("triton", "reference"):
        layer.config = replace(layer.config, impl=impl)
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = layer(xg).y
        y.square().sum().backward()
        runs.append([y.detach(), xg.grad, *(p.grad for p in layer.parameters())])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_layer_equals_the_naive_reference(activation):
    layer = _layer()
    layer.config = PEERConfig.from_dict({**layer.config.to_dict(), "activation": activation})
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    got = layer.eval()(x).y
    want = peer_reference(x.reshape(-1, 24), layer.query.weight, layer.keys, layer.u, layer.v,
                          3, 4, activation).reshape(x.shape)
    torch.testing.assert_close(got, want)


def test_every_parameter_has_a_gradient_and_counts_add_up():
    layer = _layer().train()
    x = torch.randn(13, 24, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    out.y.square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0
    assert out.counts.shape == (64,) and int(out.counts.sum()) == 13 * 3 * 4
    assert float(out.aux_loss) == 0.0 and out.switch_loss is None


def test_config_checks_and_accounting():
    c = PEERConfig(experts=388 ** 2, hidden=512, heads=8, d_q=32, kappa=56)
    assert c.top_k == 448 and c.flops == 4_134_912                    # the paper's match
    layer = PEERLayer(PEERConfig(experts=64, hidden=24, heads=3, d_q=10, kappa=4))
    experts, router = peer_params(64, 24, 3, 10)
    assert layer.u.numel() + layer.v.numel() == experts
    assert layer.query.weight.numel() + layer.keys.numel() == router
    with pytest.raises(ValueError, match="perfect-square"):
        PEERConfig(experts=60, hidden=8)
    with pytest.raises(ValueError, match="d_q must be even"):
        PEERConfig(experts=64, hidden=8, d_q=7)
    with pytest.raises(ValueError, match=r"kappa must be in \[1, sqrt\(M\) = 8\], got 9"):
        PEERConfig(experts=64, hidden=8, kappa=9)
    with pytest.raises(ValueError, match="impl must be one of"):
        PEERConfig(experts=64, hidden=8, kappa=4, impl="cuda")
    assert math.isqrt(c.experts) == 388


def test_transformer_with_peer_layers_counts_trains_and_round_trips(tmp_path):
    from moremoe.model import Transformer, TransformerConfig
    cfg = TransformerConfig(vocab=40, layers=2, heads=2, max_seq_len=16,
                            moe=PEERConfig(experts=49, hidden=16, heads=2, d_q=8, kappa=3))
    model = Transformer(cfg)
    assert cfg.total_params() == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 40, (3, 12))
    out = model.train()(tokens[:, :-1], tokens[:, 1:])
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert [int(c.sum()) for c in out.expert_counts] == [3 * 11 * 6] * 2
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.training_flops_per_token(16) > 0


def test_phonebook_peer_is_matched_to_the_more(capsys, tmp_path):
    import json
    from moremoe.cli import main
    argv = ["phonebook", "train", "--arch", "peer", "--size", "48", "--hidden", "32", "--width",
            "8", "--rank", "4", "--layers", "1", "--batch-size", "16", "--lr", "3e-3",
            "--max-steps", "4", "--eval-every", "4", "--eval-entries", "20", "--device", "cpu",
            "--no-progress", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    run, more = out["runs"][0], out["plan"]["more"]
    assert run["model"]["moe"]["kind"] == "peer"
    assert run["model"]["moe"]["experts"] == math.isqrt(run["model"]["moe"]["experts"]) ** 2
    assert abs(run["flops_inference"] - more["flops"]) / more["flops"] < 0.05


def test_inference_in_chunks_of_tokens_equals_one_pass(monkeypatch):
    """Without autograd the gathered rows are made a few tokens at a time (bounded memory);
    the output is the one pass's, and N = 0 gives an empty output."""
    import moremoe.nn.peer as peer
    torch.manual_seed(0)
    layer = PEERLayer(PEERConfig(experts=64, hidden=16, heads=2, d_q=8, kappa=3)).eval()
    x = torch.randn(37, 16)
    whole = layer(x).y.detach()
    monkeypatch.setattr(peer, "CHUNK_BYTES", 5 * 6 * 16 * 4)         # 5 tokens a chunk
    with torch.no_grad():
        chunked = layer(x).y
        assert layer(x[:0]).y.shape == (0, 16)
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize("field, value, error, match", [
    ("heads", 0, ValueError, r"heads must be >= 1, got 0"),
    ("hidden", 0, ValueError, r"hidden must be >= 1, got 0"),
    ("d_q", 0, ValueError, r"d_q must be >= 2, got 0"),
    ("experts", 16.0, TypeError, r"experts must be an int, got float 16.0"),
    ("kappa", 2.0, TypeError, r"kappa must be an int, got float 2.0"),
    ("init_std", -1, ValueError, r"init_std must be a finite number > 0, got -1"),
    ("init_std", float("nan"), ValueError, r"init_std must be a finite number > 0, got nan"),
    ("init_std", "0.02", TypeError, r"init_std must be a number, got str '0.02'"),
])
def test_config_fields_are_checked_at_construction(field, value, error, match):
    args = dict(experts=16, hidden=8, heads=2, d_q=4, kappa=2)
    with pytest.raises(error, match=match):
        PEERConfig(**{**args, field: value})


def test_layer_refuses_a_config_of_another_kind():
    from moremoe.nn import MoEConfig
    with pytest.raises(TypeError, match="config must be a PEERConfig, got MoEConfig"):
        PEERLayer(MoEConfig.moe(4, 2, 8, 4))


def _forward_backward(layer, x):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = layer(x).y
    (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y, x.grad, [p.grad for p in layer.parameters()]


def _same_experts(retrieval):
    """peer_retrieval that keeps the experts its first call picked and scores them in q's
    dtype: a lower precision may swap near-tied experts, which is rounding, not a fault of
    the dtype path."""
    picked = []

    def pinned(q, keys, kappa, *, impl):
        if not picked:
            picked.append(retrieval(q, keys, kappa, impl=impl)[1])
        ids, R, half = picked[0], keys.shape[1], q.shape[-1] // 2
        s0, s1 = q[..., :half] @ keys[0].T, q[..., half:] @ keys[1].T
        return s0.gather(-1, ids // R) + s1.gather(-1, ids % R), ids
    return pinned


@pytest.mark.parametrize("dtype, tol", [(torch.float64, dict(rtol=1e-5, atol=1e-6)),
                                        (torch.bfloat16, dict(rtol=4e-2, atol=4e-2))])
def test_inputs_in_fp64_and_bf16_as_the_moe_layer_takes_them(dtype, tol, monkeypatch):
    """fp32 parameters, inputs in another dtype (MoELayer takes both): y and x's gradient in
    x's dtype, fp32 parameter gradients; with the same experts retrieved, all within the
    dtype's tolerance of the fp32 path."""
    import moremoe.nn.peer as peer
    torch.manual_seed(0)
    layer = PEERLayer(PEERConfig(experts=49, hidden=16, heads=2, d_q=8, kappa=3,
                                 init_std=0.3, impl="reference")).train()
    x = torch.randn(2, 5, 16)
    y, dx, grads = _forward_backward(layer, x.to(dtype))
    assert y.dtype == dtype and dx.dtype == dtype
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads)
    monkeypatch.setattr(peer, "peer_retrieval", _same_experts(peer.peer_retrieval))
    y32, dx32, grads32 = _forward_backward(layer, x)
    y, dx, grads = _forward_backward(layer, x.to(dtype))
    torch.testing.assert_close(y.float(), y32, **tol)
    torch.testing.assert_close(dx.float(), dx32, **tol)
    for g, g32 in zip(grads, grads32):
        torch.testing.assert_close(g, g32, **tol)
