"""PEER (the paper's Appendix B baseline): product-key retrieval equals the naive top-k over
all M scores, every parameter gets a gradient, the accounting matches the module."""
import math

import pytest
import torch

from moremoe.accounting import peer_params
from moremoe.nn.peer import PEERConfig, PEERLayer, peer_reference, peer_retrieve


def _layer(M=64, h=24, heads=3, d_q=10, kappa=4, seed=0):
    torch.manual_seed(seed)
    layer = PEERLayer(PEERConfig(experts=M, hidden=h, heads=heads, d_q=d_q, kappa=kappa,
                                 init_std=0.3)).double()
    return layer


def test_product_keys_find_the_top_kappa_of_all_m_scores():
    torch.manual_seed(1)
    q, keys = torch.randn(50, 3, 12, dtype=torch.float64), torch.randn(2, 9, 6,
                                                                       dtype=torch.float64)
    scores, ids = peer_retrieve(q, keys, 5)
    full = ((q[..., :6] @ keys[0].T)[..., :, None] + (q[..., 6:] @ keys[1].T)[..., None, :])
    want = full.reshape(50, 3, 81).topk(5, dim=-1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(scores, want.values)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_layer_equals_the_naive_reference(activation):
    layer = _layer()
    layer.config = PEERConfig(**{**layer.config.to_dict(), "activation": activation})
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
    assert math.isqrt(c.experts) == 388
