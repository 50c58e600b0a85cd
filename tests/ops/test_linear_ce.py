"""The head and the loss in chunks (ops/linear_ce.py) against the unfused path: the same loss
and gradients, in fp32 to fp32's reduction tolerance and in bf16 to bf16's, at odd sizes
(a vocabulary padded to 64 rows, or not), with ignored targets, chunks of a few rows, and
under autocast."""
import pytest
import torch

from moremoe.ops.linear_ce import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_ref
from numerics import reduction_tol


def _inputs(N=37, H=24, V=53, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype)
    W = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = IGNORE_INDEX
    return x, W, t


def _loss_and_grads(fn, x, W, t, **kw):
    x, W = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = fn(x, W, t, **kw)
    loss.backward()
    return loss.detach(), x.grad, W.grad


def _assert_unfused(x, W, t, chunk_rows):
    """The op's loss and gradients are the unfused path's: a row's loss sums H products and
    V exponentials; dW also sums over the N rows."""
    want = _loss_and_grads(linear_cross_entropy_ref, x, W, t)
    got = _loss_and_grads(linear_cross_entropy, x, W, t, chunk_rows=chunk_rows)
    tol = reduction_tol(x.dtype, x.shape[1] + W.shape[0] + x.shape[0])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 16])
@pytest.mark.parametrize("V", [53, 64])         # W padded to 64 rows, or already a multiple
def test_chunks_give_the_unfused_loss_and_gradients(dtype, chunk_rows, V):
    x, W, t = _inputs(V=V, dtype=dtype)
    _assert_unfused(x, W, t, chunk_rows)


def test_every_target_ignored_gives_nan_as_cross_entropy_does():
    x, W, t = _inputs()
    t[:] = IGNORE_INDEX
    assert torch.isnan(linear_cross_entropy(x, W, t))
    assert torch.isnan(linear_cross_entropy_ref(x, W, t))


def test_autocast_forms_bf16_logits_as_the_head_does():
    x, W, t = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(linear_cross_entropy_ref, x, W, t)
        got = _loss_and_grads(linear_cross_entropy, x, W, t, chunk_rows=5)
    tol = reduction_tol(torch.bfloat16, x.shape[1] + W.shape[0] + x.shape[0])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32      # the leaves' dtype, as autograd gives
        torch.testing.assert_close(a, b, **tol)


def test_mixed_dtypes_and_shapes_are_one_line():
    x, W, t = _inputs()
    with pytest.raises(ValueError, match="one dtype"):
        linear_cross_entropy(x, W.double(), t)
    with pytest.raises(ValueError, match=r"x \(N, H\), W \(V, H\) and targets \(N,\)"):
        linear_cross_entropy(x, W[:, :5], t)


def test_the_model_fuses_its_head_and_loss_in_training_only():
    from moremoe.model import Transformer, TransformerConfig
    from moremoe.nn import MoEConfig
    cfg = TransformerConfig(vocab=97, layers=1, heads=2, max_seq_len=16,
                            moe=MoEConfig.more(12, 2, 32, 8, 4))
    model = Transformer(cfg)
    tokens = torch.randint(0, 97, (3, 16))
    targets = tokens.roll(-1, 1)
    targets[:, -1] = IGNORE_INDEX
    want = model(tokens, targets)
    model.fuse_head_and_loss()
    got = model(tokens, targets)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.lm_loss, want.lm_loss, **reduction_tol(torch.float32, 97 + 32))
    torch.testing.assert_close(got.loss, want.loss, **reduction_tol(torch.float32, 97 + 32))
    model.eval()                                    # evaluation keeps the logits
    assert model(tokens, targets).logits.shape == (3, 16, 97)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_the_compiled_chunks_on_the_gpu_give_the_unfused_loss_and_gradients(dtype,
                                                                             chunk_rows):
    """On CUDA each chunk's loss and gradient are torch.compile'd (one pass over the
    chunk's logits): the same loss and gradients as the unfused path, a GPT-2 vocabulary."""
    _assert_unfused(*(a.cuda() for a in _inputs(N=301, H=64, V=50_257, dtype=dtype)),
                    chunk_rows)
