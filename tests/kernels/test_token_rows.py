"""The rows of expert parallelism with local tokens (ops/token_rows.py): the row sum kernel
against the reference (Triton's interpreter on CPU) in fp32 and half precision, tokens with
no row, and gather / combine as each other's adjoint (every gradient)."""
import pytest
import torch

from moremoe.ops import reference as ref
from moremoe.ops.token_rows import combine_rows, gather_rows
from numerics import reduction_tol

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def plan(N, E, seed=0):
    """(tok, pos) of rows in the order (rank, token): token n has a row for rank d where a
    coin says so (some tokens none, some every rank)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(N, E, generator=g) < 0.5
    mask[:1] = True
    if N > 2:
        mask[2] = False
    d, n = mask.T.nonzero(as_tuple=True)
    pos = torch.full((N, E), -1, dtype=torch.long)
    pos[n, d] = torch.arange(n.numel())
    return n.to(DEV), pos.to(DEV)


@pytest.mark.parametrize("N,E,h", [(1, 1, 16), (37, 2, 40), (70, 4, 24), (5, 8, 128),
                                   (0, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_row_sum_kernel_equals_the_reference(N, E, h, dtype):
    tok, pos = plan(N, E)
    rows = torch.randn(tok.numel(), h, device=DEV).to(dtype)
    got = combine_rows(rows, pos, tok, impl="triton")
    want = ref.combine_rows_ref(rows, pos)
    assert got.dtype == dtype and got.shape == (N, h)
    torch.testing.assert_close(got.float(), want.float(), **reduction_tol(dtype, E))
    if N > 2:
        assert torch.equal(got[2], torch.zeros_like(got[2]))        # a token with no row
    exact = ref.combine_rows_ref(rows.double(), pos)
    torch.testing.assert_close(got.double(), exact, **reduction_tol(dtype, E))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_gather_and_combine_are_each_others_adjoint(impl):
    tok, pos = plan(23, 3, seed=1)
    x = torch.randn(23, 16, device=DEV, dtype=torch.float64 if impl == "reference"
                    else torch.float32, requires_grad=True)
    rows = gather_rows(x, tok, pos, impl=impl)
    assert torch.equal(rows, x[tok])
    w = torch.randn_like(rows)
    dx, = torch.autograd.grad((rows * w).sum(), x)
    torch.testing.assert_close(dx, ref.combine_rows_ref(w, pos))      # Σ of a token's rows
    r = rows.detach().requires_grad_()
    y = combine_rows(r, pos, tok, impl=impl)
    v = torch.randn_like(y)
    dr, = torch.autograd.grad((y * v).sum(), r)
    assert torch.equal(dr, v[tok])
