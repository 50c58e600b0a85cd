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
    val, idx, lse_e, _ = rs.shard_topk(aa, ww, k, lowrank=lowrank)
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


@pytest.mark.parametrize("lowrank", [True, False])
def test_fused_shard_backward_equals_the_reference(lowrank):
    """The backward of shard_topk (local lse) and of shard_psum (the global lse handed in,
    its own g returned through d lse) on the routers' fused kernels with g given (the
    interpreter here) against the plain fp32 recomputation, with a row whose global lse is
    −inf and odd sizes."""
    g = torch.Generator().manual_seed(4)
    N, R, Me, k = 37, 8 if lowrank else 24, 13, 3
    a, w = torch.randn(N, R, generator=g), torch.randn(Me, R, generator=g)
    lse = torch.logsumexp(a @ w.T, 1) + torch.rand(N, generator=g)
    lse[5] = float("-inf")
    v, u, pbar = torch.randn(N, k, generator=g), torch.randn(N, generator=g), \
        torch.randn(Me, generator=g)
    got = {}
    for impl in ("triton", "reference"):
        aa, ww, ll = (t.clone().requires_grad_() for t in (a, w, lse))
        val, _, lse_e, _ = rs.shard_topk(aa, ww, k, lowrank=lowrank, impl=impl)
        topk = torch.autograd.grad((val * v).sum() + (lse_e * u).sum(), (aa, ww))
        psum = rs.shard_psum(aa, ww, ll, lowrank=lowrank, impl=impl)
        dpsum = torch.autograd.grad((psum * pbar).sum(), (aa, ww, ll))
        got[impl] = (*topk, *dpsum)
    tol = reduction_tol(torch.float32, N + R + Me)
    assert got["triton"][4][5] == 0
    for x, y in zip(got["triton"], got["reference"]):
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
    val, idx, _ = rs.shard_select(x, w, R2, k, impl=impl)
    a = x @ R2.T if lowrank else x
    want_val, want_idx, _, _ = rs._topk_forward(a, w, k, lowrank, "reference")
    assert idx.dtype == torch.int32 and torch.equal(idx, want_idx)
    torch.testing.assert_close(val, want_val, **reduction_tol(torch.float32, h + r))


def _tied_across_shards(dtype, N=256, h=64, M=48, r=16):
    """Experts 3 and 30 (shards 0 and 1 of 2) identical and the strongest for most rows: an
    exact tie across the shard boundary that fp32 sums in another order split either way."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(N, h, generator=g) + 0.5).to(dtype)
    W = (torch.randn(M, h, generator=g) * 0.02).to(dtype)
    W[3] = W[30] = 0.05
    R2 = (torch.randn(r, h, generator=g) * 0.1).to(dtype)
    R2[0] = 0.1
    R1 = (torch.randn(M, r, generator=g) * 0.02).to(dtype)
    R1[3] = R1[30] = 0.5
    return x, W, R1, R2


@pytest.mark.parametrize("router", ["lowrank", "linear"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_route_as_one_process_whatever_the_summation_order(router, dtype, seed,
                                                                   monkeypatch):
    """The reference path's shards decide what fp32 cannot on fp64 (each shard's doubtful
    rows, and the merge on the winners' fp64 logits): with every fp32 sum moved in its
    last bits as another BLAS might, the two shards' merge picks expert 3 before its
    identical twin 30 in the other shard, as the one-process reference and the exact top-k
    do; in training (shard_topk) and in inference (shard_select) alike."""
    from numerics import another_blas
    x, W, R1, R2 = _tied_across_shards(dtype)
    lowrank = router == "lowrank"
    w, E, k = (R1 if lowrank else W), 2, 2
    one = (ref.router_lowrank_ref(x, R1, R2, k) if lowrank else ref.router_linear_ref(x, W, k))
    assert (one[1] == torch.tensor([3, 30], dtype=torch.int32)).all(1).float().mean() > 0.8
    another_blas(monkeypatch, seed)
    for train in (True, False):
        vals, idxs, keys = [], [], []
        for e in range(E):
            lo, hi = expert_range(48, E, e)
            if train:
                a, exact = rs.exact_inputs(x, R2 if lowrank else None)
                v, i, _, key = rs.shard_topk(a, w[lo:hi], k, lowrank=lowrank, exact=exact)
            else:
                v, i, key = rs.shard_select(x, w[lo:hi], R2 if lowrank else None, k)
            vals.append(v), idxs.append(i + lo), keys.append(key)
        val, idx = rs.merge_topk(torch.stack(vals), torch.stack(idxs), k,
                                 keys_ENK=torch.stack(keys))
        assert torch.equal(idx, one[1]), (train, (idx != one[1]).any(1).sum())
        torch.testing.assert_close(val, one[0], rtol=1e-5, atol=1e-6)
