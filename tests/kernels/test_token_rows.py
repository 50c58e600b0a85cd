"""The sum of a token's rows (ops/token_rows.py): the kernel against the reference
(Triton's interpreter on CPU) in fp32 and half precision, tokens with no row, rows read from
two sources (the rows back from other ranks and the kept rows, where they lie), either one
empty."""
import pytest
import torch

from moremoe.ops import reference as ref
from moremoe.ops.token_rows import sum_rows
from numerics import reduction_tol

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def plan(N, E, seed=0):
    """pos of rows in the order (rank, token): token n has a row for rank d where a coin says
    so (some tokens none, some every rank)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(N, E, generator=g) < 0.5
    mask[:1] = True
    if N > 2:
        mask[2] = False
    d, n = mask.T.nonzero(as_tuple=True)
    pos = torch.full((N, E), -1, dtype=torch.long)
    pos[n, d] = torch.arange(n.numel())
    return n.numel(), pos.to(DEV)


@pytest.mark.parametrize("N,E,h", [(1, 1, 16), (37, 2, 40), (70, 4, 24), (5, 8, 128),
                                   (0, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_row_sum_kernel_equals_the_reference(N, E, h, dtype):
    R, pos = plan(N, E)
    rows = torch.randn(R, h, device=DEV).to(dtype)
    got = sum_rows(rows, pos, impl="triton")
    want = ref.sum_rows_ref(rows, pos)
    assert got.dtype == dtype and got.shape == (N, h)
    torch.testing.assert_close(got.float(), want.float(), **reduction_tol(dtype, E))
    if N > 2:
        assert torch.equal(got[2], torch.zeros_like(got[2]))        # a token with no row
    exact = ref.sum_rows_ref(rows.double(), pos)
    torch.testing.assert_close(got.double(), exact, **reduction_tol(dtype, E))


@pytest.mark.parametrize("split", ["middle", "all kept", "none kept"])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_kept_rows_are_read_where_they_lie(split, impl):
    """Rows [0, R) from one tensor and [R, R + S) from another sum as the rows of one
    tensor, bit for bit (the same fp32 sums in the same order), with either side empty."""
    R_all, pos = plan(41, 3, seed=2)
    rows = torch.randn(R_all, 24, device=DEV)
    R = {"middle": R_all // 3, "all kept": 0, "none kept": R_all}[split]
    got = sum_rows(rows[:R].clone(), pos, rows[R:].clone(), impl=impl)
    assert torch.equal(got, sum_rows(rows, pos, impl=impl))
    assert torch.equal(sum_rows(rows[:0], pos[:0], rows[:0], impl=impl), rows[:0])
    with pytest.raises(ValueError, match="kept rows are torch.float16, expected rows' "
                                         "torch.float32"):
        sum_rows(rows[:R], pos, rows[R:].half(), impl=impl)
