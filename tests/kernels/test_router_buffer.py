"""The one-pass selection (kernels/router_buffer.py, config path="buffer") against the exact
sweep (C = 0) and float64 logits (CPU: Triton interpreter).

Every k the buffer keeps (1-8) with odd sizes, the crowded tiles it examines again (top-k
packed into one tile), near ties it must queue (logits a key step apart, across and within
tiles, both signs), exact ties, NaN / ±inf / -inf rows, the standard router, and the rows it
queues on random logits (none: the exact sweep is not doing its work).
"""
import pytest
import torch

from numerics import reduction_tol
from routing_checks import assert_valid_topk, hostile, logits_lowrank

triton = pytest.importorskip("triton")
kr = pytest.importorskip("moremoe.kernels.router_lowrank")
kl = pytest.importorskip("moremoe.kernels.router_linear")

from moremoe.kernels import router_buffer as rb, router_topk as rt   # noqa: E402
from moremoe.kernels._common import LINEAR, LOWRANK                  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BUFFER = {"path": "buffer"}


def make(N, h, M, r, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, h, generator=g)
    R1 = torch.randn(M, r, generator=g) * scale
    R2 = torch.randn(r, h, generator=g) * scale
    return x.to(DEV), R1.to(DEV), R2.to(DEV)


def one_pass(x, R1, R2, k, cfg):
    """(val, idx, gates) of the buffer kernel alone, and the rows it queued."""
    N = x.shape[0]
    c = rt.sweep_config(LOWRANK, R2.shape[0], x.shape[1], k, R1.shape[0], {**BUFFER, **cfg},
                        fp32=x.dtype == torch.float32)
    out = (torch.empty(N, k, device=DEV), torch.empty(N, k, device=DEV, dtype=torch.int32),
           torch.empty(N, k, device=DEV))
    rows, rows_n = rb.launch_buffer(x, R1, R2, k, mode=LOWRANK, cfg=c, out=out)
    return out, sorted(rows[:int(rows_n.item())].tolist())


def assert_as_exact_sweep(x, R1, R2, k, cfg, *, h_r):
    """Experts equal to the exact sweep's; values and gates within an h- and r-term sum."""
    exact = kr.infer(x, R1, R2, k, config={"BM": cfg.get("BM", 64), "C": 0})
    got = kr.infer(x, R1, R2, k, config={**BUFFER, **cfg})
    assert torch.equal(got[1], exact[1])
    tol = reduction_tol(torch.float32, h_r)
    torch.testing.assert_close(got[0], exact[0], equal_nan=True, **tol)
    torch.testing.assert_close(got[2], exact[2], equal_nan=True, **tol)
    return got


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("rounds, tile_keys, negative", [
    ("lazy", 2, False), ("lazy", 2, True), ("eager", 2, False), ("lazy", 4, True),
    ("eager", 4, False)])
def test_every_k_selects_the_top_k_without_queueing_random_rows(k, rounds, tile_keys,
                                                                negative):
    """Random logits over 19 tiles of 16 (the last partial), or all negative, two or four
    keys a tile, the crowded tiles examined after the sweep or in rounds after each: the
    experts are torch.topk's, no row is queued (the buffer itself found them), the outputs
    equal the whole path's."""
    if tile_keys == 4 and k < 3:
        pytest.skip("four keys a tile need k >= 3")
    x, R1, R2 = make(33, 24, 300, 12, seed=k)
    if negative:
        x, R2, R1 = x.abs(), R2.abs(), R1 - 2.0 * R1.abs().max()
    cfg = {"BM": 16, "tuple": False, "rounds": rounds, "tile_keys": tile_keys}
    (val, idx, gates), queued = one_pass(x, R1, R2, k, cfg)
    assert queued == []
    logits = logits_lowrank(x, R1, R2)
    assert_valid_topk(val, idx, logits, k, tol=1e-6 * logits.abs().max().item())
    assert torch.equal(idx.long().sort(1).values, logits.topk(k, dim=1).indices.sort(1).values)
    torch.testing.assert_close(gates, torch.softmax(val, dim=1))
    if (rounds, tile_keys) == ("lazy", 2):     # the whole path once a k
        assert_as_exact_sweep(x, R1, R2, k, cfg, h_r=24 + 12)


@pytest.mark.parametrize("k, packed", [(4, 4), (4, 3), (8, 5), (3, 2), (2, 2), (8, 8)])
@pytest.mark.parametrize("rounds", ["lazy", "eager"])
@pytest.mark.parametrize("tile_keys", [2, 4])
def test_crowded_tiles_are_examined_again_not_queued(k, packed, rounds, tile_keys):
    """Every row's `packed` best logits lie in one tile of 16 (tile 2), the rest spread:
    the tile's third key is not among its first two, so the buffer examines the tile again
    (after the sweep, or in rounds at once); no row is queued, the experts are torch.topk's.
    Where four keys a tile meet k = 4 after the sweep, a row whose top four are one tile's
    is queued instead (the tile's fifth could tie the fourth) and the whole path is the
    exact sweep's."""
    x, R1, R2 = make(20, 16, 96, 8, seed=1)
    R2 = torch.zeros_like(R2)
    R2[0, 0] = 1.0
    x[:, 0] = x[:, 0].abs() + 1.0                       # z0 > 0: logits follow R1[:, 0]
    R1[:, 0] = torch.rand(96) * 0.5
    R1[32:32 + packed, 0] = 10.0 + torch.arange(packed, 0, -1, dtype=torch.float32)
    if tile_keys == 4 and k < 3:
        pytest.skip("four keys a tile need k >= 3")
    cfg = {"BM": 16, "tuple": False, "rounds": rounds, "tile_keys": tile_keys}
    (val, idx, _), queued = one_pass(x, R1, R2, k, cfg)
    logits = logits_lowrank(x, R1, R2)
    assert torch.equal(idx.long(), logits.topk(k, dim=1).indices)
    if (k, tile_keys, rounds) == (4, 4, "lazy") and packed >= 4:
        assert queued == list(range(20))
        assert_as_exact_sweep(x, R1, R2, k, cfg, h_r=16 + 8)
    else:
        assert queued == []


@pytest.mark.parametrize("lo, hi", [(10, 200), (3, 7)])   # across tiles, in one tile
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("k", [1, 3])
def test_a_key_step_apart_is_queued_and_the_larger_wins(lo, hi, sign, k):
    """The higher expert's logit is larger by 2^-18 relative (below what keys resolve), the
    two the best (sign 1) or the best of all-negative logits (sign -1): the rows are queued
    and the exact sweep takes the larger first."""
    N, r, M = 24, 8, 300
    g = torch.Generator().manual_seed(8)
    x = (torch.rand(N, r, generator=g) + 0.5).to(DEV)
    R2 = torch.eye(r, device=DEV)
    R1 = (torch.randn(M, r, generator=g) * 0.05 - (0.0 if sign > 0 else 10.0)).to(DEV)
    R1[lo] = 3.0 * sign
    R1[hi] = 3.0 * sign * (1 + sign * 2 ** -18)
    cfg = {"BM": 32, "tuple": False}
    if k == 1:     # keys keep 17 bits at BM = 32: some rows' two keys tie (3 of 24 here)
        assert len(one_pass(x, R1, R2, k, cfg)[1]) >= 1
    got = kr.infer(x, R1, R2, k, config={**BUFFER, **cfg})[1]
    want = torch.tensor([hi, lo], dtype=torch.int32, device=DEV)
    assert (got[:, :min(k, 2)] == want[:min(k, 2)]).all()


@pytest.mark.parametrize("tuple_reduce", [False, True])
def test_hostile_logits_as_the_exact_sweep(tuple_reduce):
    """Negative logits with exact ties across and within tiles, a NaN and a -inf expert,
    at k = 6 and 4: the exact sweep's experts and values. tuple_reduce runs the GPU's
    one-pass pair reduction (slow in the interpreter: small sizes)."""
    N, M, BM = (16, 80, 16) if tuple_reduce else (90, 500, 32)
    x, R1, R2 = hostile(*make(N, 32, M, 16, seed=3), ties=(5, 50, 33), nan=9, inf=60)
    for k, tile_keys in ((6, 2), (4, 4)):
        assert_as_exact_sweep(x, R1, R2, k, {"BM": BM, "tuple": tuple_reduce,
                                             "tile_keys": tile_keys}, h_r=32 + 16)


def test_exact_ties_break_to_the_lower_index():
    """Experts 3, 140 and 141 tie exactly for every row (140, 141 in one tile): 3 first,
    then 140."""
    x = torch.rand(8, 16, device=DEV) + 0.5
    R2 = torch.zeros(8, 16, device=DEV)
    R2[:, :8] = torch.eye(8, device=DEV)
    R1 = torch.rand(200, 8, device=DEV) * 0.05
    R1[[3, 140, 141]] = 1.0
    idx = kr.infer(x, R1, R2, 2, config={**BUFFER, "BM": 32, "tuple": False})[1]
    assert idx[:, 0].tolist() == [3] * 8 and idx[:, 1].tolist() == [140] * 8


def test_non_finite_rows_fill_as_the_exact_sweep():
    """A NaN and an inf expert for every row, a NaN row, a -inf row, and k larger than the
    selectable experts of a small layer: the exact sweep's answer, fillers included."""
    x, R1, R2 = make(12, 16, 150, 8, seed=4)
    R1[5] = float("nan")
    R1[77] = float("inf")
    x[2] = float("nan")
    x[7] = float("-inf")
    R2.abs_()
    R1[:, :] = R1.abs() + 0.01
    R1[5] = float("nan")
    R1[77] = float("inf")
    got = assert_as_exact_sweep(x, R1, R2, 4, {"BM": 32, "tuple": False}, h_r=16 + 8)
    assert not ((got[1] == 5) | (got[1] == 77))[[0, 1, 3]].any()
    x, R1, R2 = make(3, 16, 6, 8, seed=5)
    R1[[0, 2, 3, 5]] = float("nan")                        # only 1 and 4 selectable
    idx = kr.infer(x, R1, R2, 4, config={**BUFFER, "BM": 16, "tuple": False})[1]
    for row in idx.tolist():
        assert sorted(row[:2]) == [1, 4] and row[2:] == [0, 2]


def test_the_standard_router_takes_the_buffer_too():
    """The standard router (x Wᵀ tiles) through the buffer: torch.topk's experts."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 40, generator=g).to(DEV)
    W = (torch.randn(260, 40, generator=g) * 0.1).to(DEV)
    for k in (1, 4, 8):
        val, idx, _ = kl.infer(x, W, k, config={**BUFFER, "BM": 32})
        logits = x.double() @ W.double().T
        assert_valid_topk(val, idx, logits, k, tol=1e-5)
        assert torch.equal(idx.long().sort(1).values,
                           logits.topk(k, dim=1).indices.sort(1).values)


def test_k_past_the_buffer_takes_the_candidates_and_bad_settings_are_named():
    x, R1, R2 = make(20, 16, 200, 8, seed=7)
    assert_as_exact_sweep(x, R1, R2, 9, {"BM": 32}, h_r=16 + 8)
    with pytest.raises(ValueError, match=r"k in \[1, 8\], got k=9"):
        c = rt.sweep_config(LINEAR, 16, 16, 9, 200)
        rb.launch_buffer(x, R1, None, 9, mode=LINEAR, cfg=c, out=())
    with pytest.raises(ValueError, match=r"tile_keys must be 2, or 4 for k >= 3; got 4 at k=2"):
        kr.infer(x, R1, R2, 2, config={**BUFFER, "tile_keys": 4})
    # named also where the batch takes the exact sweep (too few blocks to fill a GPU)
    with pytest.raises(ValueError, match=r"tile_keys must be 2, or 4 for k >= 3; got 3 at k=4"):
        kr.infer(x, R1, R2, 4, config={**BUFFER, "tile_keys": 3, "small": True})
    with pytest.raises(ValueError, match=r"rounds must be 'lazy' or 'eager'; got 'late'"):
        kr.infer(x, R1, R2, 4, config={**BUFFER, "rounds": "late", "small": True})
    # a good setting for k = 4 is not judged against the training sweeps' own k (psum's 1)
    z = (x @ R2.T).contiguous()
    assert kr.train_forward(z, R1, 4, config={"tile_keys": 4})[5].shape == (R1.shape[0],)


@pytest.mark.parametrize("h, r", [(64, 16), (40, 12), (96, 16), (64, 12)])
def test_z_loads_without_masks_where_full_select_as_the_masked_ones(h, r):
    """Where H % BH == 0 and r == BR the z projection's loads leave the h and rank masks
    out (config z_even, the default); elsewhere, or with z_even False, they keep them: the
    same z, so the same experts, values and queued rows."""
    x, R1, R2 = make(130, h, 200, r, seed=h + r)
    for k in (1, 4):
        (val, idx, gate), rows = one_pass(x, R1, R2, k, {})
        (val_m, idx_m, gate_m), rows_m = one_pass(x, R1, R2, k, {"z_even": False})
        assert torch.equal(idx, idx_m) and rows == rows_m
        tol = reduction_tol(torch.float32, h + r)
        torch.testing.assert_close(val, val_m, **tol)
        torch.testing.assert_close(gate, gate_m, **tol)
        assert torch.equal(idx, kr.infer(x, R1, R2, k, config={"C": 0})[1])


def test_the_schedule_follows_the_measurements():
    """Up to 16 tiles: four keys a tile for k >= 3 (crowding then needs four of the top k in
    one tile), up to 56 at k = 8; more tiles, or k < 3: two; the crowded tiles always
    examined after the sweep (eager rounds were slower at every shape timed)."""
    assert rb.schedule(4, 4) == (4, "lazy") and rb.schedule(4, 16) == (4, "lazy")
    assert rb.schedule(4, 17) == (2, "lazy") and rb.schedule(8, 64) == (2, "lazy")
    assert rb.schedule(8, 56) == (4, "lazy") and rb.schedule(8, 57) == (2, "lazy")
    assert rb.schedule(7, 32) == (2, "lazy") and rb.schedule(8, 128) == (2, "lazy")
    assert rb.schedule(1, 4) == (2, "lazy") and rb.schedule(2, 2) == (2, "lazy")
    assert rb.schedule(3, 2) == (4, "lazy")


def test_the_one_pass_is_the_low_rank_inference_default_where_it_was_timed():
    """sweep_config: path buffer for the low-rank router in bf16 / fp16 at k <= 8; the
    candidates for fp32, k > 8, the standard router, and where the overrides give C (C = 0
    is the exact sweep alone, whatever the default)."""
    assert rt.sweep_config(LOWRANK, 64, 512, 4, 8192)["path"] == "buffer"
    assert rt.sweep_config(LOWRANK, 64, 512, 8, 8192)["path"] == "buffer"
    assert rt.sweep_config(LOWRANK, 64, 512, 9, 8192)["path"] == "candidates"
    assert rt.sweep_config(LOWRANK, 64, 512, 4, 8192, fp32=True)["path"] == "candidates"
    assert rt.sweep_config(LINEAR, 512, 512, 4, 8192)["path"] == "candidates"
    assert rt.sweep_config(LOWRANK, 64, 512, 4, 8192, {"C": 0})["path"] == "candidates"
    assert rt.sweep_config(LOWRANK, 64, 512, 4, 8192, {"C": 0, "path": "buffer"})["path"] \
        == "buffer"


def test_strided_inputs_route_as_contiguous_ones():
    """Column-major x and every other column of a wider R1: R1's tiles are addressed from
    tile 0's offsets plus one per tile, which must follow any strides."""
    x, R1, R2 = make(33, 40, 150, 16, seed=9)
    cfg = {**BUFFER, "BM": 32, "tuple": False}
    expect = kr.infer(x, R1, R2, 3, config=cfg)
    x_t = x.T.contiguous().T
    R1_wide = torch.zeros(150, 32, device=DEV)
    R1_wide[:, ::2] = R1
    got = kr.infer(x_t, R1_wide[:, ::2], R2, 3, config=cfg)
    assert not x_t.is_contiguous() and not R1_wide[:, ::2].is_contiguous()
    for a, b in zip(expect, got):
        torch.testing.assert_close(a, b)


def test_the_32_bit_tile_offsets_check_spans_what_the_tile_reads():
    """logit_tile's in-tile offsets are 32-bit: BM rows by r for R1, by the whole h for the
    standard router's W (its chunks span h). A column-major W of 2^20 experts (stride (1,
    2^20) seen as (M, h)) overflows them at h = 4,096; a contiguous one does not."""
    from moremoe.kernels._common import w_offsets_fit

    class Strided:                         # the strides alone: no 16 GB tensor needed
        def __init__(self, *strides):
            self.strides = strides

        def stride(self, d):
            return self.strides[d]
    assert not w_offsets_fit(Strided(1, 2 ** 20), 256, 4096)
    assert w_offsets_fit(Strided(1, 2 ** 20), 256, 64)       # an r-wide R1 tile fits
    assert w_offsets_fit(Strided(4096, 1), 256, 4096)
