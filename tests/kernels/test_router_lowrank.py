"""Fused low-rank router kernels against float64 references (CPU: Triton interpreter).

Inference, training forward (m, Z, psum) and backward (dz, dR1), odd sizes, k = 1 and
k = M, ties, NaN / -inf rows, N = 0, expert splits, strides.
"""
import pytest
import torch

from numerics import reduction_tol
from routing_checks import assert_valid_topk, dense_router_grads, hostile, logits_lowrank

triton = pytest.importorskip("triton")
kr = pytest.importorskip("moremoe.kernels.router_lowrank")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(N, h, M, r, dtype=torch.float32, scale=0.3):
    x = torch.randn(N, h, device=DEV)
    R1 = torch.randn(M, r, device=DEV) * scale
    R2 = torch.randn(r, h, device=DEV) * scale
    return x.to(dtype), R1.to(dtype), R2.to(dtype)


@pytest.mark.parametrize("N,h,M,r,k", [(1, 16, 5, 8, 1), (5, 48, 37, 12, 3),
                                       (123, 32, 300, 16, 4), (17, 24, 130, 8, 16),
                                       (9, 16, 6, 8, 6), (40, 20, 129, 9, 5)])
def test_inference_matches_reference(N, h, M, r, k):
    x, R1, R2 = make(N, h, M, r)
    val, idx, gates = kr.infer(x, R1, R2, k)
    logits = logits_lowrank(x, R1, R2)
    assert_valid_topk(val, idx, logits, k, tol=1e-5)
    # random logits have no near-ties: the selection is torch.topk's exactly
    ref_idx = logits.topk(k, dim=1).indices
    assert torch.equal(idx.long().sort(1).values, ref_idx.sort(1).values)
    torch.testing.assert_close(gates, torch.softmax(val, dim=1))


def test_fp16_inputs_within_fp16_error():
    x, R1, R2 = make(64, 32, 200, 16, torch.float16)
    val, idx, _ = kr.infer(x, R1, R2, 4)
    logits = logits_lowrank(x, R1, R2, z_dtype=torch.float16)
    assert_valid_topk(val, idx, logits, 4, tol=2e-2)


@pytest.mark.parametrize("splits", [2, 3])
def test_expert_splits_agree_with_one_sweep(splits):
    x, R1, R2 = make(70, 32, 700, 16)
    one = kr.infer(x, R1, R2, 5, splits=1)
    many = kr.infer(x, R1, R2, 5, splits=splits)
    for a, b in zip(one, many):
        assert torch.equal(a, b)
    # few rows: the exact sweep split over the experts and merged (the small-batch path)
    small = kr.infer(x, R1, R2, 5, splits=splits, config={"small": True})
    assert torch.equal(small[1], one[1])
    tol = reduction_tol(torch.float32, 32 + 16)
    torch.testing.assert_close(small[0], one[0], **tol)
    torch.testing.assert_close(small[2], one[2], **tol)


def test_a_near_tie_across_splits_routes_as_one_sweep():
    """Experts 10 and 200 (in different tiles and splits) give every row logits 2^-18
    apart, below what the selection keys resolve: the candidates' pick queues those rows
    (the k-th key ties the best one left out) and the exact sweep takes the larger, expert
    200, in every row; the small-batch path (split over the experts, then merged) must take
    the same one, or a row's experts would depend on how many rows were routed with it.
    (Before, keys decided: the lower expert won in most rows.)"""
    N, r, M = 24, 8, 300
    x = torch.rand(N, r, device=DEV) + 0.5
    R2 = torch.eye(r, device=DEV)                         # z = x exactly
    R1 = torch.randn(M, r, device=DEV) * 0.05
    R1[10] = 3.0
    R1[200] = 3.0 * (1 + 2 ** -18)                        # larger by less than a key step
    one = kr.infer(x, R1, R2, 1, splits=1)
    assert (one[1][:, 0] == 200).all()
    exact = kr.infer(x, R1, R2, 1, config={"C": 0})       # the exact sweep for every row
    assert torch.equal(exact[1], one[1])
    small = kr.infer(x, R1, R2, 1, splits=3, config={"small": True})
    assert torch.equal(small[1], one[1])
    tol = reduction_tol(torch.float32, r)        # values by another path: within fp32's sum
    torch.testing.assert_close(small[0], one[0], **tol)
    torch.testing.assert_close(small[2], one[2], **tol)


@pytest.mark.parametrize("lo, hi", [(10, 200), (3, 7)])   # across tiles, in one tile
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("k", [1, 3])
def test_the_larger_of_two_logits_a_key_step_apart_wins_on_every_path(lo, hi, sign, k):
    """The higher expert's logit is larger by 2^-18 relative (the keys keep 15 bits), the
    two the best (sign 1) or the best of all-negative logits (sign -1): it is chosen first
    on every path (one sweep, the candidates and their pick, the exact sweep for every
    row, the small-batch split), for k = 1 and as the first of k = 3."""
    N, r, M = 40, 8, 300
    x = torch.rand(N, r, device=DEV) + 0.5
    R2 = torch.eye(r, device=DEV)
    R1 = torch.randn(M, r, device=DEV) * 0.05 - (0.0 if sign > 0 else 10.0)
    R1[lo] = 3.0 * sign
    R1[hi] = 3.0 * sign * (1 + sign * 2 ** -18)           # larger either way
    want = torch.tensor([hi, lo], dtype=torch.int32, device=DEV)
    for kw in ({}, {"splits": 1}, {"config": {"C": 0}}, {"splits": 3, "config": {"small": True}},
               {"config": {"C": 1}}):
        got = kr.infer(x, R1, R2, k, **kw)[1]
        assert (got[:, :min(k, 2)] == want[:min(k, 2)]).all(), kw


def test_strided_inputs():
    x, R1, R2 = make(33, 40, 150, 16)
    expect = kr.infer(x, R1, R2, 3)
    x_t = x.T.contiguous().T                      # column-major x
    R1_wide = torch.zeros(150, 32, device=DEV)
    R1_wide[:, ::2] = R1                          # every other column
    R1_s = R1_wide[:, ::2]
    got = kr.infer(x_t, R1_s, R2, 3)
    assert not x_t.is_contiguous() and not R1_s.is_contiguous()
    for a, b in zip(expect, got):
        torch.testing.assert_close(a, b)


def test_empty_batch():
    x, R1, R2 = make(0, 16, 10, 8)
    val, idx, gates = kr.infer(x, R1, R2, 2)
    assert val.shape == idx.shape == gates.shape == (0, 2)


def _tie_setup(sign: float):
    """Exact ties: z = x[:, :8] > 0 and experts 3, 140 and 141 share one row of R1 that gives
    the largest logits, all positive (sign > 0) or all logits negative (sign < 0)."""
    x = torch.rand(8, 16, device=DEV) + 0.5
    R2 = torch.zeros(8, 16, device=DEV)
    R2[:, :8] = torch.eye(8, device=DEV)
    R1 = torch.rand(200, 8, device=DEV) * 0.05
    tied = torch.ones(8, device=DEV)
    if sign < 0:
        R1 = -(R1 + 0.5)
        tied = -0.01 * tied
    R1[[3, 140, 141]] = tied
    return x, R1, R2


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("k", [1, 2])
def test_ties_break_to_the_lower_index(sign, k):
    x, R1, R2 = _tie_setup(sign)
    val, idx, _ = kr.infer(x, R1, R2, k)
    logits = logits_lowrank(x, R1, R2)
    assert torch.all(logits[:, 3] == logits[:, 140])
    assert idx[:, 0].tolist() == [3] * 8                   # across tiles: 3 beats 140, 141
    if k == 2:
        assert idx[:, 1].tolist() == [140] * 8             # within a tile: 140 beats 141
    for S in (2, 4):
        assert torch.equal(kr.infer(x, R1, R2, k, splits=S)[1], idx)


def test_the_candidates_select_as_the_exact_sweep_on_hostile_logits():
    """The candidates and their queued rows' sweep give the exact sweep's experts and
    values on negative logits with exact ties across and within tiles, NaN and -inf among
    them, at k = 6 over 700 experts."""
    x, R1, R2 = hostile(*make(150, 32, 700, 16), ties=(5, 50, 333), nan=9, inf=600)
    two = kr.infer(x, R1, R2, 6, config={"BM": 32, "C": 0})
    one = kr.infer(x, R1, R2, 6, config={"BM": 32, "C": 2, "tuple": False})
    assert torch.equal(one[1], two[1])
    # the values of the same experts, by two compiled kernels: within an r- and an h-term sum
    torch.testing.assert_close(one[0], two[0], **reduction_tol(torch.float32, 16 + 32))


def test_nan_and_inf_logits_are_never_selected():
    x, R1, R2 = make(20, 16, 150, 8)
    R1[5] = float("nan")
    R1[77] = float("inf")           # ±inf or NaN logits for every token
    val, idx, _ = kr.infer(x, R1, R2, 4)
    assert not (idx == 5).any() and not (idx == 77).any()
    logits = logits_lowrank(x, R1, R2)
    logits[:, [5, 77]] = float("-inf")
    assert_valid_topk(val, idx, logits, 4, tol=1e-5)


def test_all_nan_row_returns_lowest_indices_with_their_logits():
    x, R1, R2 = make(6, 16, 150, 8)
    x[2] = float("nan")
    val, idx, gates = kr.infer(x, R1, R2, 3)
    assert idx[2].tolist() == [0, 1, 2] and torch.isnan(val[2]).all()
    assert torch.isnan(gates[2]).all()
    rest = [0, 1, 3, 4, 5]
    assert_valid_topk(val[rest], idx[rest], logits_lowrank(x, R1, R2)[rest], 3, tol=1e-5)


def test_all_minus_inf_row():
    x, R1, R2 = make(4, 16, 150, 8)
    x[1] = float("-inf")
    R2.copy_(R2.abs())
    R1.copy_(R1.abs() + 0.01)       # z = -inf everywhere, logits -inf
    val, idx, _ = kr.infer(x, R1, R2, 2)
    assert idx[1].tolist() == [0, 1] and torch.isneginf(val[1]).all()


def test_partly_selectable_row_fills_after_the_finite_ones():
    x, R1, R2 = make(3, 16, 6, 8)
    R1[[0, 2, 3, 5]] = float("nan")  # only experts 1 and 4 are selectable
    val, idx, _ = kr.infer(x, R1, R2, 4)
    for row in idx.tolist():
        assert sorted(row[:2]) == [1, 4] and row[2:] == [0, 2]


def test_k_equals_m_returns_every_expert_sorted():
    x, R1, R2 = make(11, 16, 7, 8)
    val, idx, _ = kr.infer(x, R1, R2, 7)
    assert all(sorted(row) == list(range(7)) for row in idx.tolist())
    assert_valid_topk(val, idx, logits_lowrank(x, R1, R2), 7, tol=1e-5)


class _Poisoned:
    """torch, with torch.empty's memory filled with NaN (integers: -7): an output a kernel
    leaves unwritten shows."""
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kw):
        t = torch.empty(*args, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)


def poison(monkeypatch, on: bool, module=None) -> None:
    """With on, the training sweeps' torch.empty memory is NaN-filled: their partial outputs
    (psum's, dR1's, g, the sparse dW's scratch) are allocated, not zeroed, so every element
    must be written. module: another kernel module's (default router_train)."""
    if on:
        if module is None:
            from moremoe.kernels import router_train as module
        monkeypatch.setattr(module, "torch", _Poisoned())


@pytest.mark.parametrize("N,M,k", [(37, 300, 4), (5, 9, 9), (64, 130, 1)])
@pytest.mark.parametrize("poisoned", [False, True])
def test_training_forward_statistics(N, M, k, poisoned, monkeypatch):
    poison(monkeypatch, poisoned)
    x, R1, R2 = make(N, 32, M, 12)
    z = x @ R2.T
    val, idx, gates, m, Z, psum = kr.train_forward(z, R1, k, psum_splits=2)
    logits = z.double() @ R1.double().T
    assert_valid_topk(val, idx, logits, k, tol=1e-5)
    torch.testing.assert_close(m.double() + Z.double().log(), torch.logsumexp(logits, 1),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(psum.double(), torch.softmax(logits, 1).sum(0), rtol=1e-5,
                               atol=1e-5)
    again = kr.train_forward(z, R1, k, psum_splits=2)[5]
    assert torch.equal(psum, again)                          # deterministic run to run


@pytest.mark.parametrize("N,M,k,dense", [(37, 300, 4, True), (20, 50, 1, True),
                                         (9, 9, 9, True), (37, 300, 4, False),
                                         (100, 5, 2, True), (100, 5, 2, False)])
@pytest.mark.parametrize("poisoned", [False, True])
def test_backward_matches_float64_autograd(N, M, k, dense, poisoned, monkeypatch):
    poison(monkeypatch, poisoned)
    x, R1, R2 = make(N, 32, M, 12)
    z = x @ R2.T
    val, idx, _, m, Z, _ = kr.train_forward(z, R1, k)
    pbar = torch.randn(M, device=DEV) if dense else None
    dval = torch.randn(N, k, device=DEV)
    dz, dR1 = kr.train_backward(z, R1, m, Z, pbar, idx, dval, splits=3)
    want_dz, want_dR1 = dense_router_grads(z, R1, idx, dval, pbar)
    torch.testing.assert_close(dz.double(), want_dz, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dR1.double(), want_dR1, rtol=1e-4, atol=1e-5)
    again = kr.train_backward(z, R1, m, Z, pbar, idx, dval, splits=3)[1]
    assert torch.equal(dR1, again)        # deterministic, the sparse part included


def test_bad_arguments():
    x, R1, R2 = make(4, 16, 10, 8)
    with pytest.raises(ValueError, match=r"k must be in \[1, min\(M=10, 64\)\]"):
        kr.infer(x, R1, R2, 11)
    with pytest.raises(ValueError, match=r"R2 must have shape \(r, h\) = \(8, 16\)"):
        kr.infer(x, R1, R2[:, :15], 2)
    with pytest.raises(TypeError, match="share one dtype"):
        kr.infer(x, R1.double(), R2, 2)


@pytest.mark.parametrize("C,tuple_reduce", [(1, False), (2, False), (3, False), (4, False),
                                           (2, True), (4, True)])
@pytest.mark.parametrize("negative", [False, True])
def test_candidates_with_exact_redo_equal_the_exact_sweep(C, tuple_reduce, negative):
    """C keys per tile plus the exact sweep of the queued rows (C of a tile selected, a
    negative key selected) select exactly what the exact sweep selects, also when most
    logits are negative and some exactly tied (those rows are queued). tuple_reduce runs the
    GPU's one-pass C-tuple reduction (slow in the interpreter: small tiles). The queued rows'
    z and values are recomputed in another block of rows, so values agree to the rounding of
    an h-term and an r-term sum, not bit for bit."""
    N, M, BM = (24, 96, 16) if tuple_reduce else (150, 700, 32)
    x, R1, R2 = make(N, 32, M, 16)
    if negative:
        R1 = R1 - 3.0 * R1.abs().max()
        R1[[5, 50]] = R1[7].clone()
        x = x.abs() + 0.1
        R2 = R2.abs()
    cfg = {"BM": BM, "C": C, "tuple": tuple_reduce}
    exact = kr.infer(x, R1, R2, 6, config={"BM": BM, "C": 0})
    cands = kr.infer(x, R1, R2, 6, config=cfg)
    assert torch.equal(exact[1], cands[1])
    tol = reduction_tol(torch.float32, 32 + 16)
    torch.testing.assert_close(cands[0], exact[0], **tol)
    torch.testing.assert_close(cands[2], exact[2], **tol)
    logits = logits_lowrank(x, R1, R2)
    assert_valid_topk(exact[0], exact[1], logits, 6, tol=1e-6 * logits.abs().max().item())
    split = kr.infer(x, R1, R2, 6, splits=3, config=cfg)
    assert torch.equal(split[1], cands[1])


@pytest.mark.parametrize("negative, queue", [
    (False, {}), (True, {}),                          # 13 splits, one program, 2 blocks
    (False, {"queue_cap": 32}),                       # the split pass's 32, then unsplit
    (True, {"queue_splits": 4, "queue_cap": 32}),
    (False, {"queue_splits": 1}),                     # unsplit: a wave walking the blocks
    (True, {"queue_cap": 32, "queue_programs": 1}),   # one program a part walks them all
    (False, {"queue_programs": 1000}),                # a program a possible block
    (True, {"BN": 16, "queue_cap": 32}),              # two split blocks, two of the rest,
    (False, {"BN": 16, "queue_splits": 1}),           # each part's two programs striding
    (True, {"BN": 16, "queue_cap": 16, "queue_programs": 1})])
def test_the_queued_rows_sweep_returns_the_exact_sweeps_answer(negative, queue):
    """One key in tiles of 16 queues most rows (a NaN row among them); the exact sweep of
    the queued rows returns what the exact sweep of every row returns, in inference and in
    the training forward, split over the experts or not, the queue past the split pass's
    scratch swept unsplit, by one program a block or a few walking the blocks (the
    interpreter's default: two a part). negative: all logits negative, some exactly tied."""
    from moremoe.kernels import router_candidates as rc, router_topk as rt
    from moremoe.kernels._common import LOWRANK
    N, M, BM, k, r = 60, 200, 16, 4, 16
    x, R1, R2 = make(N, 32, M, r)
    if negative:
        R1 = R1 - 3.0 * R1.abs().max()
        R1[[5, 50]] = R1[7].clone()
        x, R2 = x.abs() + 0.1, R2.abs()
    x[3, 0] = float("nan")
    cfg = rt.sweep_config(LOWRANK, r, 32, k, M, {"BM": BM, "C": 1, "tuple": False})
    out = (torch.empty(N, k, device=DEV), torch.empty(N, k, device=DEV, dtype=torch.int32),
           torch.empty(N, k, device=DEV))
    cand, z = rc.launch_candidates(x, R1, R2, k, mode=LOWRANK, cfg=cfg)
    rows, rows_n = rc.launch_pick(cand, z, x, R1, k, mode=LOWRANK, cfg=cfg, out=out)
    queued = rows[:int(rows_n.item())].long()
    assert len(queued) > N // 2 and 3 in queued.tolist()
    got = kr.infer(x, R1, R2, k, config={"BM": BM, "C": 1, "tuple": False, **queue})
    whole = kr.infer(x, R1, R2, k, config={"BM": BM, "C": 0})
    assert torch.equal(got[1], whole[1])
    # the values of the same experts by two kernels' z: within an h- and an r-term sum
    torch.testing.assert_close(got[0], whole[0], equal_nan=True,
                               **reduction_tol(torch.float32, 32 + r))
    zz = x @ R2.T
    got = kr.train_forward(zz, R1, k, config={"BM": BM, "C": 1, **queue}, with_psum=True)
    whole = kr.train_forward(zz, R1, k, config={"BM": BM, "C": 0}, with_psum=True)
    assert torch.equal(got[1], whole[1])
    torch.testing.assert_close(got[0], whole[0], equal_nan=True,
                               **reduction_tol(torch.float32, r))
    # the softmax statistics by two passes: (m, Z) may differ in m, m + log Z may not, nor
    # the probabilities summed over the rows (N terms, each over M)
    lse = [t[3] + t[4].log() for t in (got, whole)]
    torch.testing.assert_close(*lse, equal_nan=True, **reduction_tol(torch.float32, M))
    assert got[5] is not None and got[5].shape == (M,)
    torch.testing.assert_close(got[5], whole[5], equal_nan=True,
                               **reduction_tol(torch.float32, N + M))


def test_rows_with_c_keys_in_one_tile_are_redone():
    """Expert tiles of 16 with the top-4 of every row in tile 2: one key per tile cannot
    find them, so every row is queued and the exact sweep must produce the answer."""
    x, R1, R2 = make(10, 16, 64, 8)
    z = x @ R2.T
    z[:, 0] = z[:, 0].abs() + 1.0
    R2[0] = torch.linalg.lstsq(x, z[:, :1]).solution[:, 0]   # z0 > 0 for every row
    big = torch.zeros(4, 8)
    big[:, 0] = 40.0 * torch.tensor([1.0, 0.9, 0.8, 0.7])
    R1[32:36] = big
    logits = logits_lowrank(x, R1, R2)
    want = torch.topk(logits, 4, dim=1).indices
    assert (want.sort(1).values == torch.arange(32, 36, device=want.device)).all()
    got = kr.infer(x, R1, R2, 4, config={"BM": 16, "C": 1})[1]
    assert torch.equal(got.long(), want)


def test_pick_candidates_follows_the_cost_model():
    from moremoe.kernels.router_topk import pick_candidates
    # k = 1: one key a tile would redo every row (the tile's next key may tie the winner
    # after truncation): two; k = 2 keeps two (both winners in one tile: 1.6 % redone)
    assert pick_candidates(1, 64) == 2 and pick_candidates(2, 64) == 2
    assert pick_candidates(4, 64) == 2          # 9 % of rows redone beats a third key
    assert pick_candidates(8, 64) == 3          # 1.4 % redone
    assert pick_candidates(16, 1) == 0          # one tile: every row would be redone


def test_training_forward_candidates_equal_the_exact_sweep():
    x, R1, R2 = make(90, 32, 600, 16)
    z = x @ R2.T
    exact = kr.train_forward(z, R1, 5, config={"C": 0})
    cands = kr.train_forward(z, R1, 5, config={"C": 2, "BM": 32})
    assert torch.equal(exact[1], cands[1])                      # the same experts
    tol = reduction_tol(torch.float32, 16)
    for j in (0, 2, 5):                                         # values, gates, psum
        torch.testing.assert_close(cands[j], exact[j], **tol)
    # m is a shift (a key of the tile size's code), m + log Z the row's log-normaliser
    lse = [out[3] + out[4].log() for out in (exact, cands)]
    torch.testing.assert_close(lse[1], lse[0], **tol)


def test_the_training_sweeps_of_no_rows_give_zeros(monkeypatch):
    """No rows: no kernel runs, and psum and dR1 are zeros, not the NaN-filled memory."""
    poison(monkeypatch, True)
    _, R1, _ = make(1, 32, 9, 12)
    z = torch.empty(0, 12, device=DEV)
    val, idx, _, m, Z, psum = kr.train_forward(z, R1, 2, psum_splits=3)
    assert psum.shape == (9,) and not psum.any()
    dz, dR1 = kr.train_backward(z, R1, m, Z, torch.randn(9, device=DEV), idx,
                                torch.empty(0, 2, device=DEV), splits=3)
    assert dz.shape == (0, 12) and dR1.shape == (9, 12) and not dR1.any()


def test_every_low_rank_path_takes_one_tile_width():
    """At 256 < M <= 512, at k = 4 for 2,048 < M <= 4,096 and at k = 8 for 7,168 < M <=
    8,192, the one pass takes 64-expert tiles (faster there), and so do the candidates and
    the exact sweep: a tile's width can change how the MMA rounds a logit, and the inference
    paths must select the same experts. Elsewhere, and for the standard router, every path
    keeps 128 (bf16; fp32 takes 64 everywhere)."""
    from moremoe.kernels import router_topk as rt
    from moremoe.kernels._common import LINEAR, LOWRANK
    for M, width in ((96, 128), (256, 128), (257, 64), (512, 64), (513, 128)):
        widths = {rt.sweep_config(LOWRANK, 64, 512, k, M, over)["BM"]
                  for k in (1, 4, 8, 16) for over in (None, {"C": 0}, {"C": 2})}
        assert widths == {width}, M
    for M, k, width in ((8192, 8, 64), (7169, 8, 64), (7168, 8, 128), (4096, 8, 128),
                        (8192, 4, 128), (16384, 8, 128), (2048, 8, 128), (8192, 7, 128),
                        (2049, 4, 64), (4096, 4, 64), (2048, 4, 128), (4097, 4, 128),
                        (3072, 3, 128), (3072, 5, 128)):   # crowded two-key tiles
        widths = {rt.sweep_config(LOWRANK, 64, 512, k, M, over)["BM"]
                  for over in (None, {"C": 0}, {"C": 2})}
        assert widths == {width}, (M, k)
    assert rt.sweep_config(LOWRANK, 64, 512, 4, 96, fp32=True)["BM"] == 64
    assert rt.sweep_config(LOWRANK, 64, 512, 4, 512, {"BM": 128})["BM"] == 128
    assert rt.sweep_config(LINEAR, 512, 512, 4, 512)["BM"] == 256
