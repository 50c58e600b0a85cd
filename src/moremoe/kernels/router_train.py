"""The training half of the fused routers, over the softmax of all M experts: the balancing
statistic psum (forward, after the top-k sweep of router_topk.py) and the backward
(Algorithm 3 of the paper), shared by the low-rank and the standard router.

Legend: P the softmax over all M experts (P_ni), Z its normaliser (norm in code), m the
row max, p̄ the gradient of psum, g_n = Σ_i p̄_i P_ni, c the mean of p̄; SPLITS the token
splits of the column-wise kernels.

Kernels (grid, reads -> writes):
  _psum_kernel         (M/BM, SPLITS) z|x, R1|W, m, Z -> psum partials (SPLITS, M) fp32
  _bwd_rows_kernel     (N/BN,)        z, R1, R1 ⊙ (p̄ − c), m, Z, p̄, idx, dval -> dz (N, r)
                                      fp32, g (N): one sweep, P shared by two MMAs
  _bwd_cols_kernel     (M/BM, SPLITS) z, R1, m, Z, p̄, g -> the dense part of dR1, partials
                                      (SPLITS, M, r)
  _sparse_cols_kernel  (pieces, r/BR) z|x, pairs sorted by expert, dval -> the top-k part of
                                      dR1|dW (M, r), an expert's pairs in pieces of 256
                                      (expert_wgrad.plan), expert_wgrad.add_pieces adding
                                      a split expert's pieces in order
  _dlogits_rows_kernel (Nc/BN,)       ℓ (Nc, M) fp32 from cuBLAS, m, Z, p̄, idx, dval -> dℓ
                                      for a chunk of tokens (the standard router)

P = 2^((ℓ − m) log2 e − log2 Z) costs a subtraction, an FMA and an ex2 per logit. Partials
are summed by torch afterwards and the sparse part in pair order, so psum and the weight
gradients are deterministic (no float atomics). The standard router's rank is h, too wide
for an on-chip accumulator: its backward takes one chunk of tokens at a time, logits, dx and
dW as cuBLAS GEMMs (_linear_backward). The low-rank router's logit tiles are recomputed from
z and R1 and never stored: dℓ = scatter(dval) + P ⊙ (p̄ − g), dz = P (R1 ⊙ (p̄ − c)) −
(g − c) P R1 + Σ_j dval_j R1[idx_j] (centring on c keeps the second term small).
"""
import torch
import triton
import triton.language as tl

from . import DTYPES, MAX_K
from . import expert_wgrad as wgrad
from ._common import (LINEAR, MODE_LINEAR, NEG_INF, dot_precision, fill_splits, load_rows,
                      logit_tile, w_offsets_fit, z_rows)
from .router_topk import launch_sweep, sweep_config
from .routing_meta import pair_order


LOG2E = tl.constexpr(1.4426950408889634)
SPARSE_PIECE_PAIRS = 256   # pairs one program sums in sparse_weight_grad (8 loads of 32)


@triton.jit
def _row_stats(rows64, row_ok, M_ROW, NORM_ROW):
    """(m, log2 Z) of the rows; a masked row gets log2 Z = +inf, so that all its P are 0."""
    m = tl.load(M_ROW + rows64, mask=row_ok, other=0.0)
    lz = tl.log2(tl.load(NORM_ROW + rows64, mask=row_ok, other=float("inf")))
    return tl.where(m == NEG_INF, 0.0, m), lz


@triton.jit
def _probs(logits, m, lz):
    """P = 2^((ℓ − m) log2 e − log2 Z): a subtraction, an FMA and an ex2 per logit (no
    division); 0 where the logit is not finite or the row has no finite logit (P is NaN or
    inf there). Masked columns are left to the caller (their p̄, R1 or z rows are 0, or they
    are not stored)."""
    p = tl.math.exp2((logits - m[:, None]) * LOG2E - lz[:, None])
    return tl.where(p < float("inf"), p, 0.0)


@triton.jit
def _psum_kernel(X, W, M_ROW, NORM_ROW, OUT, N, H, M, R, n_per_split,
                 sx_n, sx_h, sw_m, sw_k, so_s,
                 MODE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
                 BH: tl.constexpr, PREC: tl.constexpr):
    """Column sums over the tokens of split program_id(1) of the softmax over all experts."""
    cols = tl.program_id(0) * BM + tl.arange(0, BM)
    col_ok = cols < M
    pid_s = tl.program_id(1)
    rr = tl.arange(0, BR)
    if MODE != MODE_LINEAR:    # the tile's R1 rows, loaded once for the whole split
        w = load_rows(W, cols.to(tl.int64), col_ok, sw_m, rr, rr < R, sw_k)
    acc = tl.zeros((BN, BM), tl.float32)   # summed over its rows once, after the loop
    n_end = tl.minimum(N, (pid_s + 1) * n_per_split)
    for n0 in range(pid_s * n_per_split, n_end, BN):
        rows = n0 + tl.arange(0, BN)
        row_ok = rows < n_end
        rows64 = rows.to(tl.int64)
        if MODE == MODE_LINEAR:
            logits = logit_tile(z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE, BN, BR), X, W,
                                rows64, row_ok, tl.program_id(0) * BM, cols, col_ok, H, R,
                                sx_n, sx_h, sw_m, sw_k, MODE, BN, BM, BR, BH, PREC)
        else:
            z = load_rows(X, rows64, row_ok, sx_n, rr, rr < R, sx_h)
            logits = tl.dot(z, tl.trans(w), input_precision=PREC)
        m, lz = _row_stats(rows64, row_ok, M_ROW, NORM_ROW)
        acc += _probs(logits, m, lz)
    tl.store(OUT + pid_s * so_s + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _dlogits(logits, rows64, row_ok, cols, col_ok, m, lz, PBAR, g, IDX, DVAL, si_n,
             K: tl.constexpr):
    """dℓ tile = scatter(dval into the selected columns) + P ⊙ (p̄ − g)."""
    pbar = tl.load(PBAR + cols, mask=col_ok, other=0.0)
    d = _probs(logits, m, lz) * (pbar[None, :] - g[:, None])
    if K <= 8:              # unrolled (the loads hoist); a runtime loop beyond, so that the
        for j in tl.static_range(K):        # code, and the compile time, stop growing with k
            d = _scatter_dval(d, cols, rows64, row_ok, IDX, DVAL, si_n, j)
    else:
        for j in range(K):
            d = _scatter_dval(d, cols, rows64, row_ok, IDX, DVAL, si_n, j)
    return d


@triton.jit
def _scatter_dval(d, cols, rows64, row_ok, IDX, DVAL, si_n, j):
    idx_j = tl.load(IDX + rows64 * si_n + j, mask=row_ok, other=-1)
    dv_j = tl.load(DVAL + rows64 * si_n + j, mask=row_ok, other=0.0)
    return d + tl.where(cols[None, :] == idx_j[:, None], dv_j[:, None], 0.0)


@triton.jit
def _bwd_rows_kernel(Z, W, WC, M_ROW, NORM_ROW, PBAR, IDX, DVAL, OUT_DZ, OUT_G, SHIFT, G_IN,
                     N, M, R, sz_n, sz_r, sw_m, sw_r, swc_m, si_n, so_n,
                     K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
                     PREC: tl.constexpr, G_GIVEN: tl.constexpr):
    """dz (BN, r) and g = P p̄ of a token block in one sweep over the expert tiles:
    dz = P (R1 ⊙ (p̄ − c)) − (g − c) P R1 + Σ_j dval_j R1[idx_j], with c = SHIFT[0] and
    WC = R1 ⊙ (p̄ − c). Two MMAs per tile share the P operand (as flash attention's P V);
    centring p̄ on c keeps the second term small, so its rounding costs no more than that of
    dℓ = P (p̄ − g) rounded to the MMA's dtype. G_GIVEN (an expert shard): the g of dℓ is
    G_IN's, summed over all the shards' experts by the caller; OUT_G still gets the
    shard's own P p̄."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    rr = tl.arange(0, BR)
    r_ok = rr < R
    z = load_rows(Z, rows64, row_ok, sz_n, rr, r_ok, sz_r)
    m, lz = _row_stats(rows64, row_ok, M_ROW, NORM_ROW)
    acc_c = tl.zeros((BN, BR), tl.float32)
    acc_p = tl.zeros((BN, BR), tl.float32)
    g = tl.zeros((BN, BM), tl.float32)     # g's terms, summed over the columns at the end
    for m0 in range(0, M, BM):
        cols = m0 + tl.arange(0, BM)
        col_ok = cols < M
        cols64 = cols.to(tl.int64)
        w = load_rows(W, cols64, col_ok, sw_m, rr, r_ok, sw_r)
        wc = load_rows(WC, cols64, col_ok, swc_m, rr, r_ok, sw_r)
        p = _probs(tl.dot(z, tl.trans(w), input_precision=PREC), m, lz)
        pbar = tl.load(PBAR + cols, mask=col_ok, other=0.0)   # 0 past M: no share of g
        g += p * pbar[None, :]
        p16 = p.to(w.dtype)
        acc_c = tl.dot(p16, wc, acc_c, input_precision=PREC)
        acc_p = tl.dot(p16, w, acc_p, input_precision=PREC)
    g = tl.sum(g, axis=1)
    tl.store(OUT_G + rows64, g, mask=row_ok)
    if G_GIVEN:
        g = tl.load(G_IN + rows64, mask=row_ok, other=0.0)
    acc = acc_c - (g - tl.load(SHIFT))[:, None] * acc_p
    for j in range(K):  # the sparse part: Σ_j dval_j R1[idx_j, c]
        idx_j = tl.load(IDX + rows64 * si_n + j, mask=row_ok, other=0)
        dv_j = tl.load(DVAL + rows64 * si_n + j, mask=row_ok, other=0.0)
        w = load_rows(W, idx_j.to(tl.int64), row_ok, sw_m, rr, r_ok, sw_r).to(tl.float32)
        acc += dv_j[:, None] * w
    tl.store(OUT_DZ + rows64[:, None] * so_n + rr[None, :], acc,
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _dlogits_rows_kernel(LG, M_ROW, NORM_ROW, PBAR, IDX, DVAL, OUT, G_IN, OUT_G, n0, nc, M,
                         si_n, K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                         G_GIVEN: tl.constexpr):
    """The standard router's dℓ for the token rows [n0, n0 + nc) from their fp32 logits
    LG (nc, M) (a cuBLAS GEMM), into OUT (nc, M) in x's dtype: g over the whole row first,
    then P ⊙ (p̄ − g) + scatter(dval). G_GIVEN (an expert shard): the row's own g goes to
    OUT_G and dℓ takes G_IN's (all the shards' experts)."""
    local = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = local < nc
    rows64 = (n0 + local).to(tl.int64)
    loc64 = local.to(tl.int64)
    m, lz = _row_stats(rows64, row_ok, M_ROW, NORM_ROW)
    g = tl.zeros((BN,), tl.float32)
    for m0 in range(0, M, BM):
        cols = m0 + tl.arange(0, BM)
        col_ok = cols < M
        lg = tl.load(LG + loc64[:, None] * M + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        pbar = tl.load(PBAR + cols, mask=col_ok, other=0.0)
        g += tl.sum(_probs(lg, m, lz) * pbar[None, :], axis=1)
    if G_GIVEN:
        tl.store(OUT_G + rows64, g, mask=row_ok)
        g = tl.load(G_IN + rows64, mask=row_ok, other=0.0)
    for m0 in range(0, M, BM):
        cols = m0 + tl.arange(0, BM)
        col_ok = cols < M
        offs = loc64[:, None] * M + cols[None, :]
        lg = tl.load(LG + offs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        d = _dlogits(lg, rows64, row_ok, cols, col_ok, m, lz, PBAR, g, IDX, DVAL, si_n, K)
        tl.store(OUT + offs, d.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _bwd_cols_kernel(Z, W, M_ROW, NORM_ROW, PBAR, G, OUT, N, M, R, n_per_split,
                     sz_n, sz_r, sw_m, sw_r, so_s, so_m,
                     BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
    """The dense part of dR1, a partial (BM, r) over the tokens of split program_id(1):
    Σ_blocks (P ⊙ (p̄ − g))ᵀ z. The sparse top-k part is _sparse_cols_kernel's."""
    cols = tl.program_id(0) * BM + tl.arange(0, BM)
    col_ok = cols < M
    pid_s = tl.program_id(1)
    rr = tl.arange(0, BR)
    r_ok = rr < R
    w = load_rows(W, cols.to(tl.int64), col_ok, sw_m, rr, r_ok, sw_r)
    pbar = tl.load(PBAR + cols, mask=col_ok, other=0.0)
    acc = tl.zeros((BM, BR), tl.float32)
    n_end = tl.minimum(N, (pid_s + 1) * n_per_split)
    for n0 in range(pid_s * n_per_split, n_end, BN):
        rows = n0 + tl.arange(0, BN)
        row_ok = rows < n_end
        rows64 = rows.to(tl.int64)
        z = load_rows(Z, rows64, row_ok, sz_n, rr, r_ok, sz_r)   # masked rows: z = 0
        m, lz = _row_stats(rows64, row_ok, M_ROW, NORM_ROW)
        g = tl.load(G + rows64, mask=row_ok, other=0.0)
        # the tile transposed, (BM, BN): experts along the MMA's rows, so that dℓᵀ is the
        # next MMA's A operand as it stands (no transpose through shared memory)
        pt = tl.math.exp2((tl.dot(w, tl.trans(z), input_precision=PREC) - m[None, :]) * LOG2E
                          - lz[None, :])
        pt = tl.where(pt < float("inf"), pt, 0.0)
        d = pt * (pbar[:, None] - g[None, :])
        acc = tl.dot(d.to(z.dtype), z, acc, input_precision=PREC)
    offs = pid_s.to(tl.int64) * so_s + cols.to(tl.int64)[:, None] * so_m + rr[None, :]
    tl.store(OUT + offs, acc, mask=col_ok[:, None] & r_ok[None, :])


@triton.jit
def _sparse_cols_kernel(A, ORDER, OFFSETS, DVAL, OUT, OWNER, FIRST, SLOT, SCRATCH, M, R, P,
                        sa_n, sa_r, so_m, K: tl.constexpr, BP: tl.constexpr,
                        BR: tl.constexpr):
    """dW[e, chunk] = Σ over the (token, slot) pairs routed to expert e, in pair order, of
    dval · a[token, chunk] (a = z or x): the sparse top-k part of dR1 | dW, deterministic
    (no atomics). Program program_id(0) sums one piece of P pairs of its expert
    (expert_wgrad.plan): an expert of one piece is stored to OUT, one of several into its
    scratch slots, added in piece order by expert_wgrad.add_pieces (an expert that most
    tokens chose no longer leaves one program looping over them all)."""
    i = tl.program_id(0)
    e = tl.load(OWNER + i)
    if e < M:
        rr = tl.program_id(1) * BR + tl.arange(0, BR)
        r_ok = rr < R
        j = i - tl.load(FIRST + e)
        start = tl.load(OFFSETS + e)
        end = tl.load(OFFSETS + e + 1)
        lo = start + j * P
        hi = tl.minimum(lo + P, end)
        acc = tl.zeros((BR,), tl.float32)
        for p0 in range(lo, hi, BP):
            pp = p0 + tl.arange(0, BP)
            ok = pp < hi
            pair = tl.load(ORDER + pp, mask=ok, other=0)
            dv = tl.load(DVAL + pair, mask=ok, other=0.0)
            a = load_rows(A, pair // K, ok, sa_n, rr, r_ok, sa_r).to(tl.float32)
            acc += tl.sum(dv[:, None] * a, axis=0)
        if end - start > P:
            s = (tl.load(SLOT + e) + j).to(tl.int64)
            tl.store(SCRATCH + s * R + rr, acc, mask=r_ok)
        else:
            tl.store(OUT + e.to(tl.int64) * so_m + rr, acc, mask=r_ok)


# ---------------------------------------------------------------- launchers

def check_rows(x, w, k: int, *, x_name: str = "x", w_name: str = "W", rows: str = "M",
               width: str = "h") -> None:
    """x (N, width) scored against w (rows, width): both 2-D, one kernel dtype, 1 <= k <=
    min(rows, MAX_K); errors name the tensors and sizes as the caller does."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{x_name} and {w_name} must be 2-D, got shapes {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    M = w.shape[0]
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{w_name} must have shape ({rows}, {width}) = ({M}, {x.shape[1]}), "
                         f"got {tuple(w.shape)}")
    if not 1 <= k <= min(M, MAX_K):
        raise ValueError(f"k must be in [1, min(M={M}, {MAX_K})] for the fused kernel, got {k}")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise TypeError(f"{x_name} and {w_name} must share one dtype of {DTYPES}, got "
                        f"{x.dtype}, {w.dtype}")


def train_forward(x, w, k: int, *, mode: int, with_psum: bool = True,
                  config: dict | None = None, psum_splits: int | None = None):
    """(val, idx, gates, m, Z, psum | None): the sweep with row statistics, then psum."""
    val, idx, gates, m, norm = launch_sweep(x, w, k, mode=mode, stats=True, config=config)
    psum = launch_psum(x, w, m, norm, mode=mode, splits=psum_splits,
                       config=config) if with_psum else None
    return val, idx, gates, m, norm, psum


def _token_splits(device, tiles: int, N: int, BN: int, splits: int | None) -> int:
    """Split the tokens of a column-wise kernel so that the grid fills the GPU."""
    if splits is not None:
        return max(1, min(splits, triton.cdiv(N, BN)))
    return fill_splits(device, tiles, N, BN)


def sparse_weight_grad(a, idx, dval, experts: int, piece_pairs: int = SPARSE_PIECE_PAIRS):
    """(M, R) fp32: row e is Σ over the (token, slot) pairs routed to expert e of dval · a[token]
    (a = z for dR1, x for dW), summed in pair order within pieces of piece_pairs pairs and
    the pieces in order: deterministic, no atomics (2^62: one program an expert)."""
    N, R = a.shape
    k = idx.shape[1]
    if N == 0:
        return torch.zeros(experts, R, device=a.device, dtype=torch.float32)
    # every expert owns a piece (one of no pairs stores zeros): each row of out is written
    out = torch.empty(experts, R, device=a.device, dtype=torch.float32)
    order, offsets = pair_order(idx, experts)
    owner, first, count, slot, bound, slots, rows = wgrad.plan(offsets, experts, 1,
                                                               piece_pairs, order.shape[0])
    scratch = torch.empty(slots, R, device=a.device, dtype=torch.float32)
    BR = min(128, max(16, triton.next_power_of_2(R)))
    _sparse_cols_kernel[(bound, triton.cdiv(R, BR))](
        a, order, offsets, dval.float().contiguous(), out, owner, first, slot, scratch,
        experts, R, rows, a.stride(0), a.stride(1), out.stride(0), K=k, BP=32, BR=BR,
        num_warps=4)
    wgrad.add_pieces(out[:, :, None], count, count, slot, scratch, rows, accumulate=False,
                     bc=BR, bd=1)
    return out


def _sparse_backward(x, w, idx, dval):
    """Without a psum gradient only the k selected logits have one: gathers for dz and
    sparse_weight_grad for dW."""
    idx64, dval = idx.long(), dval.float()
    dz = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for j in range(idx.shape[1]):
        dz += dval[:, j, None] * w[idx64[:, j]].float()
    return dz, sparse_weight_grad(x, idx, dval, w.shape[0])


def _mm_fp32(a, b):
    """a @ b with fp32 output (cuBLAS accumulates in fp32 either way); 16-bit CUDA inputs
    write fp32 directly where torch supports it."""
    if a.is_cuda and a.dtype != torch.float32:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return (a @ b).float()


def _linear_backward(x, w, m_row, norm_row, pbar, idx, dval, g_given, chunk_bytes=1 << 30):
    """Standard router: for chunks of tokens, the (N_c, M) logits are a cuBLAS GEMM, a
    Triton kernel turns them into dℓ (g needs the whole row, which the chunk has), and
    dx_c = dℓ W, dW += dℓᵀ x_c are cuBLAS GEMMs: three GEMMs at the cuBLAS rate, and the
    (N, M) logits are never whole (a chunk holds at most chunk_bytes). g_given: see
    launch_backward; the rows' own g (N,) is then returned third."""
    N, H = x.shape
    M, k = w.shape[0], idx.shape[1]
    idx, dval, pbar = idx.contiguous(), dval.float().contiguous(), pbar.float().contiguous()
    dx = torch.empty(N, H, device=x.device, dtype=torch.float32)
    dw = None                 # the first chunk's product, then the others added: no fill
    given = g_given is not None
    g_in = g_given.float().contiguous() if given else dx
    g_out = torch.empty(N, device=x.device, dtype=torch.float32) if given else dx
    nc_max = max(1, chunk_bytes // (M * (4 + x.element_size())))
    BN, BM = 16, 256
    for n0 in range(0, N, nc_max):
        nc = min(nc_max, N - n0)
        xc = x[n0:n0 + nc]
        lg = _mm_fp32(xc, w.T)
        dl = torch.empty(nc, M, device=x.device, dtype=x.dtype)
        _dlogits_rows_kernel[(triton.cdiv(nc, BN),)](
            lg, m_row, norm_row, pbar, idx, dval, dl, g_in, g_out, n0, nc, M, idx.stride(0),
            K=k, BN=BN, BM=BM, G_GIVEN=given, num_warps=4)
        dx[n0:n0 + nc] = _mm_fp32(dl, w)
        part = _mm_fp32(dl.T, xc)
        dw = part if dw is None else dw.add_(part)
    if dw is None:            # no rows
        dw = torch.zeros(M, H, device=x.device, dtype=torch.float32)
    return (dx, dw, g_out) if given else (dx, dw)


def launch_psum(x, w, m_row, norm_row, *, mode: int, splits: int | None = None,
                config: dict | None = None):
    """psum (M,) fp32 = Σ_n softmax(ℓ_n)."""
    N, M, R = x.shape[0], w.shape[0], x.shape[1]
    cfg = sweep_config(mode, R, x.shape[1], 1, overrides=config,
                       fp32=x.dtype == torch.float32)
    tiles = triton.cdiv(M, cfg["BM"])
    n_splits = _token_splits(x.device, tiles, N, cfg["BN"], splits)
    n_per_split = triton.cdiv(triton.cdiv(max(N, 1), n_splits), cfg["BN"]) * cfg["BN"]
    n_splits = max(1, triton.cdiv(N, n_per_split))
    # every (split, expert) is written by one program: no fill kernel, except with no rows
    out = (torch.empty if N > 0 else torch.zeros)(n_splits, M, device=x.device,
                                                  dtype=torch.float32)
    if mode == LINEAR and not w_offsets_fit(w, cfg["BM"], x.shape[1]):
        w = w.contiguous()          # a tile past 32-bit offsets (logit_tile): copy, rarely
    if N > 0:
        _psum_kernel[(tiles, n_splits)](
            x, w, m_row, norm_row, out, N, x.shape[1], M, R, n_per_split, x.stride(0), x.stride(1),
            w.stride(0), w.stride(1), out.stride(0), MODE=mode, BN=cfg["BN"], BM=cfg["BM"],
            BR=cfg["BR"], BH=cfg["BH"], PREC=dot_precision(x.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out.sum(0)


def launch_backward(x, w, m_row, norm_row, pbar, idx, dval, *, mode: int, splits: int | None = None,
                    config: dict | None = None, g_given=None):
    """(dz|dx (N, R) fp32, dR1|dW (M, R) fp32) from dval = d topk_val (N, k) and p̄ = d psum
    (M,) or None (no balancing-loss gradient: only the sparse top-k part). The low-rank
    router: one sweep per token block (dz, g), one per expert tile (the dense part of dR1),
    and sparse_weight_grad for its top-k part.
    g_given (N,) fp32 (an expert shard's rows, w its experts, P = exp(ℓ − m) / Z over all the
    layer's experts): dℓ = P ⊙ (p̄ − g_given) + scatter(dval), and the shard's own
    g = P p̄ (N,) fp32 is returned third, for the caller to sum over the shards; k may be 0."""
    N, M, R = x.shape[0], w.shape[0], x.shape[1]
    k = idx.shape[1]
    dev = x.device
    if pbar is None and g_given is None:
        return _sparse_backward(x, w, idx, dval)
    if pbar is None:
        pbar = torch.zeros(M, device=dev, dtype=torch.float32)
    if mode == LINEAR:
        return _linear_backward(x, w, m_row, norm_row, pbar, idx, dval, g_given)
    cfg = sweep_config(mode, R, x.shape[1], 1, overrides=config,
                       fp32=x.dtype == torch.float32)
    # each row's dz and g, each (split, expert)'s dR1 part are written by one program: no
    # fill kernels (a launch each in a launch-bound step), except dR1 with no rows
    dz = torch.empty(N, R, device=dev, dtype=torch.float32)
    g = torch.empty(max(N, 1), device=dev, dtype=torch.float32)
    pbar, idx, dval = pbar.float().contiguous(), idx.contiguous(), dval.float().contiguous()
    tiles = triton.cdiv(M, cfg["BM"])
    n_splits = _token_splits(dev, tiles, N, cfg["BN"], splits)
    n_per_split = triton.cdiv(triton.cdiv(max(N, 1), n_splits), cfg["BN"]) * cfg["BN"]
    n_splits = max(1, triton.cdiv(N, n_per_split))
    dw = (torch.empty if N > 0 else torch.zeros)(n_splits, M, R, device=dev,
                                                 dtype=torch.float32)
    given = g_given is not None
    if N == 0:
        return (dz, dw.sum(0), g[:0]) if given else (dz, dw.sum(0))
    g_in = g_given.float().contiguous() if given else g
    shift = pbar.mean().reshape(1)               # c: g_n is a P-weighted mean of p̄
    wc = (w.float() * (pbar - shift)[:, None]).to(w.dtype)
    common = dict(BN=cfg["BN"], BM=cfg["BM"], BR=cfg["BR"], PREC=dot_precision(x.dtype),
                  num_warps=cfg["num_warps"], num_stages=cfg["bwd_stages"])
    _bwd_rows_kernel[(triton.cdiv(N, cfg["BN"]),)](
        x, w, wc, m_row, norm_row, pbar, idx, dval, dz, g, shift, g_in, N, M, R, x.stride(0),
        x.stride(1), w.stride(0), w.stride(1), wc.stride(0), idx.stride(0), dz.stride(0), K=k,
        G_GIVEN=given, **common)
    _bwd_cols_kernel[(tiles, n_splits)](
        x, w, m_row, norm_row, pbar, g_in, dw, N, M, R, n_per_split, x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), dw.stride(0), dw.stride(1), **common)
    dw = dw.sum(0)
    if k:
        dw += sparse_weight_grad(x, idx, dval, M)
    return (dz, dw, g[:N]) if given else (dz, dw)
