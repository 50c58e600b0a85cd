"""The routers' sparse top-k weight gradient (kernels/router_train.sparse_weight_grad) when
most pairs go to a few experts: an expert's pairs cut into pieces summed by several programs
and added in order give fp64's sums, empty experts zero, the same result every run."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.kernels.router_train import sparse_weight_grad  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("pieces", [4, 32, 2 ** 62])
@pytest.mark.parametrize("R", [16, 40])
def test_hot_experts_in_pieces_sum_as_fp64(pieces, R, monkeypatch):
    from test_router_lowrank import poison      # the output is allocated, not zeroed
    from moremoe.kernels import expert_wgrad
    poison(monkeypatch, True)
    monkeypatch.setattr(expert_wgrad, "KERNEL", R == 40)   # the plan by its GPU launch
    g = torch.Generator().manual_seed(0)
    N, k, M = 90, 3, 7
    rows = []
    for n in range(N):           # expert 1 in every row, expert 4 in two thirds, 6 never
        hot = [1] + [4] * (n % 3 != 0)
        rest = [e for e in torch.randperm(6, generator=g).tolist() if e not in (1, 4)]
        rows.append(hot + rest[:k - len(hot)])
    idx = torch.tensor(rows, dtype=torch.int32, device=DEV)
    a = torch.randn(N, R, generator=g).to(DEV)
    dval = torch.randn(N, k, generator=g).to(DEV)
    got = sparse_weight_grad(a, idx, dval, M, piece_pairs=pieces)
    want = torch.zeros(M, R, dtype=torch.float64, device=DEV)
    want.index_add_(0, idx.reshape(-1).long(),
                     (dval.double()[:, :, None] * a.double()[:, None, :]).reshape(-1, R))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[6], torch.zeros(R, device=DEV))
    assert torch.equal(sparse_weight_grad(a, idx, dval, M, piece_pairs=pieces), got)


def test_the_plan_caps_the_scratch_by_growing_the_pieces():
    """The scratch is allocated whatever the routing: at most MAX_SLOTS slots, the pieces
    growing past their default size for more rows; every piece of an expert accounted for."""
    from moremoe.kernels import expert_wgrad as wgrad
    for total, rows in ((2000, 512), (1 << 20, 2048)):
        counts = torch.tensor([total - 3, 0, 3])              # one hot expert, one empty
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        p = wgrad.plan(offsets, 3, 1, wgrad.PIECE_ROWS, total)
        assert p.rows == rows and p.slots <= wgrad.MAX_SLOTS
        n = -(-(total - 3) // rows)
        assert p.first.tolist() == [0, n, n + 1] and p.count.tolist() == counts.tolist()
        assert p.owner[:n + 2].tolist() == [0] * n + [1, 2]
        assert (p.owner[n + 2:] == 3).all() and p.bound >= n + 2
