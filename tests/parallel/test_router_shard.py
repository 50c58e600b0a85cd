"""The sharded router's collective-free pieces (ops/router_shard.py) in one process: the
merge of local top-k lists is select_topk of the whole row (ties, NaN and ±inf logits,
rows short of k finite logits), the global log-sum-exp, the chunked backward against
autograd, the fused kernels (Triton's interpreter on CPU) against the reference, and the
one-line error of a mesh that does not divide the experts."""
import pytest
import torch

from moremoe.ops import reference as ref
from moremoe.ops import router_shard as rs
from moremoe.parallel.sharded_router import expert_range
from numerics import reduction_tol


def shard_lists(logits_NM, E, k):
    """Each shard's select_topk (values, global indices), stacked (E, N, k_e)."""
    N, M = logits_NM.shape
    vals, idxs = [], []
    for lo in range(0, M, M // E):
        v, i = ref.select_topk(logits_NM[:, lo:lo + M // E], min(k, M // E))
        vals.append(v)
        idxs.append(i + lo)
    return torch.stack(vals), torch.stack(idxs)


def split_topk(logits_NM, E, k, impl="reference"):
    """Each shard's select_topk (global indices), merged."""
    return rs.merge_topk(*shard_lists(logits_NM, E, k), k, impl=impl)


def spoiled_logits(N=40, M=12, seed=0):
    """Small integers (ties everywhere, across shards too), a few NaN and ±inf, one row
    with a single finite logit and one with none."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 3, (N, M), generator=g).float()
    spots = torch.rand(N, M, generator=g)
    logits[spots < 0.06] = float("nan")
    logits[(spots >= 0.06) & (spots < 0.1)] = float("inf")
    logits[(spots >= 0.1) & (spots < 0.14)] = float("-inf")
    logits[0] = float("nan")
    logits[0, 7] = 1.0
    logits[1] = float("-inf")
    return logits


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("E", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_merge_of_shard_lists_is_the_whole_row_selection(E, k, impl):
    """The torch merge and the merge kernel (Triton's interpreter here)."""
    logits = spoiled_logits()
    val, idx = split_topk(logits, E, k, impl)
    want_val, want_idx = ref.select_topk(logits, k)
    assert idx.dtype == torch.int32 and torch.equal(idx, want_idx)
    torch.testing.assert_close(val, want_val, equal_nan=True, rtol=0, atol=0)


def test_the_merge_kernels_gradient_reaches_the_chosen_candidates():
    g = torch.Generator().manual_seed(3)
    val, idx = shard_lists(torch.randn(33, 12, generator=g), 3, 3)
    dval = torch.randn(33, 3, generator=g)
    grads = []
    for impl in ("reference", "triton"):
        v = val.clone().requires_grad_()
        out, _ = rs.merge_topk(v, idx, 3, impl=impl)
        grads.append(torch.autograd.grad((out * dval).sum(), v)[0])
    assert torch.equal(grads[0], grads[1])


def test_combine_lse_is_the_logsumexp_of_the_row_and_its_gradient_finite():
    logits = spoiled_logits()
    finite = torch.where(torch.isfinite(logits), logits, float("-inf"))
    lse_EN = torch.stack([torch.logsumexp(finite[:, lo:lo + 3], 1) for lo in range(0, 12, 3)])
    lse_EN.requires_grad_()
    got = rs.combine_lse(lse_EN)
    torch.testing.assert_close(got, torch.logsumexp(finite, 1), **reduction_tol(torch.float32, 12))
    got[torch.isfinite(got)].sum().backward()
    assert torch.isfinite(lse_EN.grad).all() and lse_EN.grad[:, 1].abs().sum() == 0


def dense_grads(a, w, lse, v, u, pbar, k):
    """Autograd of the same quantities through the (N, M_e) logits."""
    a, w, lse = (t.detach().clone().requires_grad_() for t in (a, w, lse))
    logits = a @ w.T
    val, idx = ref.select_topk(logits, k)
    topk = (logits.gather(1, idx.long()) * v).sum() + (torch.logsumexp(logits, 1) * u).sum()
    psum = (torch.exp(logits - lse[:, None]).sum(0) * pbar).sum()
    return (torch.autograd.grad(topk, (a, w), retain_graph=True),
            torch.autograd.grad(psum, (a, w, lse)))


@pytest.mark.parametrize("lowrank", [True, False])
def test_chunked_backward_equals_autograd_of_the_logits(lowrank):
    g = torch.Generator().manual_seed(1)
    N, R, Me, k = 23, 6 if lowrank else 16, 5, 3
    a, w = torch.randn(N, R, generator=g), torch.randn(Me, R, generator=g)
    lse = torch.randn(N, generator=g) + 3.0
    v, u, pbar = torch.randn(N, k, generator=g), torch.randn(N, generator=g), \
        torch.randn(Me, generator=g)
    want_topk, want_psum = dense_grads(a, w, lse, v, u, pbar, k)
    tol = reduction_tol(torch.float32, N + R + Me)
    aa, ww = a.clone().requires_grad_(), w.clone().requires_grad_()
    val, idx, lse_e = rs.shard_topk(aa, ww, k, lowrank=lowrank)
    got = torch.autograd.grad((val * v).sum() + (lse_e * u).sum(), (aa, ww))
    for x, y in zip(got, want_topk):
        torch.testing.assert_close(x, y, **tol)
    ll = lse.clone().requires_grad_()
    psum = rs.shard_psum(aa, ww, ll, lowrank=lowrank)
    for x, y in zip(torch.autograd.grad((psum * pbar).sum(), (aa, ww, ll)), want_psum):
        torch.testing.assert_close(x, y, **tol)
    whole = rs._contract(a, w, lse, col_M=pbar)
    chunked = rs._contract(a, w, lse, col_M=pbar, rows_per_chunk=4)
    for x, y in zip(whole, chunked):
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("lowrank", [True, False])
def test_fused_shard_kernels_equal_the_reference(lowrank):
    """The CUDA path (Triton's interpreter here): local top-k, lse and psum with the global
    lse handed in, a row whose global lse is −inf contributing nothing."""
    g = torch.Generator().manual_seed(2)
    N, R, Me, k = 21, 8 if lowrank else 32, 10, 3
    a, w = torch.randn(N, R, generator=g), torch.randn(Me, R, generator=g)
    lse = torch.logsumexp(a @ w.T, 1) + torch.rand(N, generator=g)    # other shards' mass
    lse[4] = float("-inf")
    fused = [rs._topk_forward(a, w, k, lowrank, "triton"),
             rs._psum_forward(a, w, lse, lowrank, "triton")]
    plain = [rs._topk_forward(a, w, k, lowrank, "reference"),
             rs._psum_forward(a, w, lse, lowrank, "reference")]
    tol = reduction_tol(torch.float32, N + R + Me)
    assert torch.equal(fused[0][1], plain[0][1])
    for x, y in [(fused[0][0], plain[0][0]), (fused[0][2], plain[0][2]), (fused[1], plain[1])]:
        torch.testing.assert_close(x, y, **tol)


def test_a_mesh_that_does_not_divide_the_experts_is_one_line():
    assert expert_range(8, 4, 3) == (6, 8)
    with pytest.raises(ValueError, match=r"^experts M=10 must be divisible by the "
                                         r"expert-parallel size E=4[^\n]*$"):
        expert_range(10, 4, 0)


def test_the_overlap_keeps_a_block_of_rows_per_expert_in_each_chunk():
    """auto_chunks at the paper's point (N = 262,144, k = 4): 4 chunks at M = 2,048 (512 rows
    an expert), 2 at 8,192 (128), 1 at 16,384 (64: one block each already); chunk_bounds
    cover the tokens in near-equal runs."""
    from moremoe.parallel.collectives import auto_chunks
    from moremoe.parallel.expert import chunk_bounds
    assert [auto_chunks(262144, 4, M) for M in (2048, 8192, 16384)] == [4, 2, 1]
    assert auto_chunks(10, 2, 8) == 1 and auto_chunks(10 ** 9, 8, 8, most=2) == 2
    assert chunk_bounds(10, 4) == (0, 2, 5, 7, 10) and chunk_bounds(0, 2) == (0, 0, 0)


@pytest.mark.parametrize("lowrank", [True, False])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_inference_selects_as_training_does(lowrank, impl):
    """shard_select (the routers' inference kernels, z formed on chip) picks the training
    sweep's experts with its values: the sharded router routes alike in eval and train."""
    g = torch.Generator().manual_seed(4)
    N, h, r, Me, k = 19, 32, 8, 10, 3
    x, w = torch.randn(N, h, generator=g), torch.randn(Me, r if lowrank else h, generator=g)
    R2 = torch.randn(r, h, generator=g) if lowrank else None
    val, idx = rs.shard_select(x, w, R2, k, impl=impl)
    a = x @ R2.T if lowrank else x
    want_val, want_idx, _ = rs._topk_forward(a, w, k, lowrank, "reference")
    assert idx.dtype == torch.int32 and torch.equal(idx, want_idx)
    torch.testing.assert_close(val, want_val, **reduction_tol(torch.float32, h + r))
