"""Fused standard-router kernels against float64 references (CPU: Triton interpreter)."""
import pytest
import torch

from routing_checks import assert_valid_topk, dense_router_grads

pytest.importorskip("triton")
kl = pytest.importorskip("moremoe.kernels.router_linear")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(N, h, M, scale=0.1):
    return torch.randn(N, h, device=DEV), torch.randn(M, h, device=DEV) * scale


@pytest.mark.parametrize("N,h,M,k", [(1, 16, 5, 1), (37, 100, 300, 4), (9, 16, 7, 7),
                                     (20, 200, 129, 16)])
def test_inference_matches_reference(N, h, M, k):
    x, W = make(N, h, M)
    val, idx, gates = kl.infer(x, W, k)
    logits = x.double() @ W.double().T
    assert_valid_topk(val, idx, logits, k, tol=1e-5)
    assert torch.equal(idx.long().sort(1).values, logits.topk(k, 1).indices.sort(1).values)
    assert torch.equal(kl.infer(x, W, k, splits=2)[1], idx)


def test_ties_across_tiles_break_to_the_lower_index():
    x = torch.rand(6, 16, device=DEV) + 0.5
    W = torch.rand(300, 16, device=DEV) * 0.05
    W[[10, 200]] = 1.0
    assert kl.infer(x, W, 1)[1].flatten().tolist() == [10] * 6


@pytest.mark.parametrize("dense", [True, False])
def test_training_forward_and_backward(dense):
    N, h, M, k = 37, 200, 150, 3          # h = 200: two gradient chunks of 128
    x, W = make(N, h, M)
    val, idx, _, m, Z, psum = kl.train_forward(x, W, k, psum_splits=2)
    logits = x.double() @ W.double().T
    assert_valid_topk(val, idx, logits, k, tol=1e-5)
    torch.testing.assert_close(psum.double(), torch.softmax(logits, 1).sum(0), rtol=1e-5,
                               atol=1e-5)
    pbar = torch.randn(M, device=DEV) if dense else None
    dval = torch.randn(N, k, device=DEV)
    dx, dW = kl.train_backward(x, W, m, Z, pbar, idx, dval, splits=2)
    want_dx, want_dW = dense_router_grads(x, W, idx, dval, pbar)
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dW.double(), want_dW, rtol=1e-4, atol=1e-5)


def test_bad_arguments():
    x, W = make(4, 16, 10)
    with pytest.raises(ValueError, match=r"W must have shape \(M, h\) = \(10, 16\)"):
        kl.infer(x, W[:, :8], 2)
    with pytest.raises(ValueError, match=r"k must be in \[1, min\(M=10, 64\)\]"):
        kl.infer(x, W, 0)


def test_chunked_backward_equals_one_chunk():
    """The standard router's backward takes chunks of tokens; several chunks give the same
    gradients as one."""
    from moremoe.kernels.router_train import _linear_backward
    N, h, M, k = 40, 32, 300, 3
    x, W = make(N, h, M)
    _, idx, _, m, Z, _ = kl.train_forward(x, W, k)
    pbar, dval = torch.randn(M, device=DEV), torch.randn(N, k, device=DEV)
    one = _linear_backward(x, W, m, Z, pbar, idx, dval, None)
    three = _linear_backward(x, W, m, Z, pbar, idx, dval, None, chunk_bytes=M * 8 * 13)   # 13 rows a chunk
    for a, b in zip(one, three):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_backward_of_no_rows_is_zeros():
    """No chunk runs: dW is zeros of W's shape (the first chunk's product is dW otherwise,
    with no fill before it), dx is (0, h)."""
    from moremoe.kernels.router_train import _linear_backward
    x, W = make(0, 32, 20)
    e = torch.empty(0, device=DEV)
    dx, dW = _linear_backward(x, W, e, e, torch.randn(20, device=DEV),
                              torch.empty(0, 2, device=DEV, dtype=torch.int32),
                              torch.empty(0, 2, device=DEV), None)
    assert dx.shape == (0, 32) and dW.shape == (20, 32) and not dW.any()
