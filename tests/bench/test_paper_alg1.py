"""The paper's Algorithm 1 baseline of `moremoe bench router` selects what torch.topk does
(CPU: Triton interpreter), at odd sizes and k that is not a power of two."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.bench.paper_alg1 import route  # noqa: E402


@pytest.mark.parametrize("N,h,M,r,k", [(5, 24, 70, 8, 3), (33, 16, 64, 16, 4), (7, 40, 45, 12, 1)])
def test_algorithm_1_matches_torch_topk(N, h, M, r, k):
    g = torch.Generator().manual_seed(N)
    x, R1, R2 = (torch.randn(*s, generator=g) for s in ((N, h), (M, r), (r, h)))
    val, idx, gates = route(x, R1, R2, k)
    want = torch.topk((x @ R2.T) @ R1.T, k, dim=1)
    assert torch.equal(idx.long(), want.indices)
    torch.testing.assert_close(val, want.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gates, torch.softmax(want.values, 1), rtol=1e-5, atol=1e-5)
