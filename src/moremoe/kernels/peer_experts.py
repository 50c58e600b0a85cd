"""PEER's expert kernels (the paper's Appendix B; nn/peer.py): single-neuron experts
e_i(x) = σ(u_iᵀ x) v_i, with the rows of u and v gathered inside the kernels.

Legend: N tokens, h hidden (H in kernels), M experts, k slots a token (K; the layer's heads
times κ, the heads do not appear here), P = N·k (token, slot) pairs; a = x · u_e the
pre-activation, σ the activation (gelu, relu or silu), c = gate · σ(a) the weight of v_e;
blocks BN tokens, BJ slots, BP expert-sorted pairs, BH >= h hidden.

  y_n = Σ_j gates[n, j] σ(x_n · u_{ids[n, j]}) v_{ids[n, j]}

Forward
  _token_kernel  (N/BN)  x (N, h), ids, gates (N, k), u, v (M, h) -> y (N, h). A program
                         holds its tokens' x rows and an fp32 y accumulator; per step it
                         gathers BJ slots' u rows and v rows, (BN, BJ, BH) each, into
                         registers. HBM traffic: 2 N k h weight elements (the rows) + 2 N h.
Backward (dy (N, h))
  _expert_kernel (M)     one program per expert, over its pairs in expert-sorted order (a
                         stable torch sort of ids; offsets int64): u_e, v_e read once, the x
                         and dy rows of its pairs gathered; recomputes a, writes dgates
                         = (dy · v_e) σ(a) and da = (dy · v_e) gate σ'(a) at the pairs' (n, j)
                         (N, k) fp32, and du_e = Σ da x, dv_e = Σ c dy (one row each, written
                         once: no atomics)
  _token_kernel  (N/BN)  dx_n = Σ_j da[n, j] u_{ids[n, j]}: the forward's gather-and-sum
                         with da for the coefficients and u for the rows
  HBM traffic: 3 N k h (x and dy rows per pair, u rows per pair) + 2 M h + the sort.
  Why this split: a token-major backward would gather the u and v rows again (4 N k h) and
  need float atomics for du, dv (N k h of them); grouping the pairs by expert reads x and dy
  rows instead and keeps du_e, dv_e in registers, and only dx goes back to token order.

Never in HBM: the gathered (N, k, h) rows of u, v, x or dy (the torch path materialises the
u rows), the pre-activations a and the coefficients c. Deterministic: every sum runs in a
fixed order (a token's slots in order, an expert's pairs in pair-id order), nothing uses
atomics, so repeated runs are bitwise equal. Offsets are int64 (N k h passes 2^31 at the
paper's 262,144 tokens and k = 448).

Sizes: built for PEER's many experts (M from thousands to millions: the expert pass has one
program per expert, and an expert with very many pairs is walked by one program) and h <=
PEER_MAX_HIDDEN: a whole row is held in registers (BH = next power of 2 >= h), since a needs
all of h before the activation and y accumulates over all k slots. Weights are x's dtype or
fp32 (a model's master weights under autocast): fp32 rows are rounded to x's dtype as they
are loaded (round to nearest even, as torch's cast), so the products are those of the cast
weights; du, dv come out in the weights' dtype.

Constants:
  TILE_PER_THREAD = 32  fp32 values a thread holds per gathered tile (BN·BJ·BH = 32 · 32 ·
                        warps): the u tile, the v tile, x and the accumulator then stay
                        below ~160 registers; at h = 512 a step gathers 8 rows (8 KB in bf16)
                        of each of u and v per program, enough in flight to cover HBM latency
                        with a few programs an SM
  8 warps from BH = 4096 so a row still fits those registers
  BP = tile / BH        the expert pass's pairs a step: its x and dy tiles are as large
  CAST_RATIO = 3        fp32 weights are cast to x's dtype once per call (reading 4 and
                        writing 2 bytes a weight) when the rows would be gathered more than
                        3 times on average (N k > 3 M): a gathered fp32 row costs 2 bytes a
                        weight more than a cast one
"""
import torch
import triton
import triton.language as tl

from . import DTYPES, PEER_MAX_HIDDEN
from ._common import load_rows, next_pow2
from .routing_meta import pair_order

ACTIVATION_CODES = {"gelu": 0, "relu": 1, "silu": 2}
TILE_PER_THREAD = 32
CAST_RATIO = 3
RSQRT2 = tl.constexpr(0.7071067811865476)      # 1 / sqrt(2)
RSQRT2PI = tl.constexpr(0.3989422804014327)    # 1 / sqrt(2 pi)


@triton.jit
def _act(a, ACT: tl.constexpr):
    """σ(a): gelu (exact, erf), relu or silu, as torch's F.gelu / F.relu / F.silu."""
    if ACT == 0:
        out = 0.5 * a * (1.0 + tl.math.erf(a * RSQRT2))
    elif ACT == 1:
        out = tl.maximum(a, 0.0)
    else:
        out = a * tl.sigmoid(a)
    return out


@triton.jit
def _act_grad(a, ACT: tl.constexpr):
    """σ'(a); relu's is 0 at 0, as torch's."""
    if ACT == 0:
        out = 0.5 * (1.0 + tl.math.erf(a * RSQRT2)) + a * tl.exp(-0.5 * a * a) * RSQRT2PI
    elif ACT == 1:
        out = tl.where(a > 0.0, 1.0, 0.0)
    else:
        s = tl.sigmoid(a)
        out = s * (1.0 + a * (1.0 - s))
    return out


@triton.jit
def _rows3(W, e, mask, sw_m, hh, OUT):
    """Rows W[e] (BN, BJ, BH) as fp32 values of OUT's dtype (fp32 weights rounded to it)."""
    w = tl.load(W + e[:, :, None] * sw_m + hh[None, None, :], mask=mask, other=0.0)
    return w.to(OUT.dtype.element_ty).to(tl.float32)


@triton.jit
def _token_kernel(X, IDS, COEF, A, B, Y, N, H, K, sx_n, sa_m, sb_m, sy_n,
                  FORWARD: tl.constexpr, ACT: tl.constexpr, BN: tl.constexpr,
                  BJ: tl.constexpr, BH: tl.constexpr):
    """FORWARD: Y[n] = Σ_j COEF[n, j] σ(X[n] · A[id]) B[id] (COEF gates, A u, B v).
    Otherwise Y[n] = Σ_j COEF[n, j] B[id] (COEF da, B u; X and A unused): dx."""
    n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    n_ok = n < N
    hh = tl.arange(0, BH)
    h_ok = hh < H
    if FORWARD:
        x = load_rows(X, n, n_ok, sx_n, hh, h_ok, 1).to(tl.float32)[:, None, :]
    acc = tl.zeros((BN, BH), tl.float32)
    for j0 in range(0, K, BJ):
        j = j0 + tl.arange(0, BJ)
        ok = n_ok[:, None] & (j < K)[None, :]
        pair = n[:, None] * K + j[None, :]
        e = tl.load(IDS + pair, mask=ok, other=0).to(tl.int64)
        c = tl.load(COEF + pair, mask=ok, other=0.0).to(tl.float32)
        mask = ok[:, :, None] & h_ok[None, None, :]
        if FORWARD:
            a = tl.sum(_rows3(A, e, mask, sa_m, hh, Y) * x, axis=2)
            c = tl.where(ok, c * _act(a, ACT), 0.0)
        acc += tl.sum(c[:, :, None] * _rows3(B, e, mask, sb_m, hh, Y), axis=1)
    tl.store(Y + n[:, None] * sy_n + hh[None, :], acc.to(Y.dtype.element_ty),
             mask=n_ok[:, None] & h_ok[None, :])


@triton.jit
def _expert_kernel(X, DY, U, V, GATES, ORDER, OFFSETS, DG, DA, DU, DV, H, K, sx_n, sdy_n,
                   su_m, sv_m, sdu_m, sdv_m, ACT: tl.constexpr, BP: tl.constexpr,
                   BH: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BH)
    h_ok = hh < H
    # fp32 weights rounded to x's dtype, as the forward's products had them
    u = tl.load(U + e * su_m + hh, mask=h_ok, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    v = tl.load(V + e * sv_m + hh, mask=h_ok, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    start = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    du = tl.zeros((BH,), tl.float32)
    dv = tl.zeros((BH,), tl.float32)
    for r0 in range(start, end, BP):
        rows = r0 + tl.arange(0, BP).to(tl.int64)
        ok = rows < end
        pair = tl.load(ORDER + rows, mask=ok, other=0)
        tok = pair // K
        x = load_rows(X, tok, ok, sx_n, hh, h_ok, 1).to(tl.float32)
        dy = load_rows(DY, tok, ok, sdy_n, hh, h_ok, 1).to(tl.float32)
        gate = tl.load(GATES + pair, mask=ok, other=0.0).to(tl.float32)
        a = tl.sum(x * u[None, :], axis=1)
        dc = tl.sum(dy * v[None, :], axis=1)           # d loss / d c
        act = _act(a, ACT)
        da = dc * gate * _act_grad(a, ACT)
        tl.store(DG + pair, dc * act, mask=ok)
        tl.store(DA + pair, da, mask=ok)
        du += tl.sum(da[:, None] * x, axis=0)
        dv += tl.sum((gate * act)[:, None] * dy, axis=0)
    tl.store(DU + e * sdu_m + hh, du.to(DU.dtype.element_ty), mask=h_ok)
    tl.store(DV + e * sdv_m + hh, dv.to(DV.dtype.element_ty), mask=h_ok)


# ---------------------------------------------------------------- launchers

def check_inputs(x, gates, ids, u, v, activation: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be (N, h), got shape {tuple(x.shape)}")
    N, h = x.shape
    if u.ndim != 2 or u.shape[1] != h or v.shape != u.shape:
        raise ValueError(f"u and v must both be (M, h) with h={h}, got {tuple(u.shape)} and "
                         f"{tuple(v.shape)}")
    if x.dtype not in DTYPES or u.dtype != v.dtype or u.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"x must have a dtype of {DTYPES} and u, v both x's dtype or both "
                        f"float32, got {x.dtype}, {u.dtype}, {v.dtype}")
    if ids.ndim != 2 or ids.shape != gates.shape or ids.shape[0] != N:
        raise ValueError(f"ids and gates must both be (N, k) with N={N}, got "
                         f"{tuple(ids.shape)} and {tuple(gates.shape)}")
    if h > PEER_MAX_HIDDEN:
        raise ValueError(f"hidden h={h} is more than the PEER kernels hold "
                         f"({PEER_MAX_HIDDEN})")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {sorted(ACTIVATION_CODES)}, got "
                         f"{activation!r}")


def config(h: int, k: int) -> dict:
    """Blocks (see the header): a whole row of h, as many slots (then tokens) as fill a
    tile of TILE_PER_THREAD values a thread."""
    BH = next_pow2(h)
    warps = 4 if BH < 4096 else 8
    tile = TILE_PER_THREAD * 32 * warps
    BJ = min(next_pow2(k), max(1, tile // BH))
    return {"BN": max(1, tile // (BH * BJ)), "BJ": BJ, "BP": max(1, tile // BH), "BH": BH,
            "num_warps": warps}


def _weights(u, v, dtype, pairs: int):
    """u, v as the kernels read them: contiguous rows; fp32 weights under a half x cast to
    x's dtype once where they would be gathered more than CAST_RATIO times (same values)."""
    if u.dtype != dtype and pairs > CAST_RATIO * u.shape[0]:
        u, v = u.to(dtype), v.to(dtype)
    return (w if w.stride(1) == 1 else w.contiguous() for w in (u, v))


def _token_pass(x, ids, coef, a, b, out, activation: str, *, forward: bool) -> None:
    N, h = out.shape
    k = ids.shape[1]
    c = config(h, k)
    _token_kernel[(triton.cdiv(N, c["BN"]),)](
        x, ids, coef, a, b, out, N, h, k, x.stride(0), a.stride(0), b.stride(0), out.stride(0),
        FORWARD=forward, ACT=ACTIVATION_CODES[activation], BN=c["BN"], BJ=c["BJ"], BH=c["BH"],
        num_warps=c["num_warps"])


def forward(x, gates, ids, u, v, activation: str = "gelu"):
    """y (N, h) in x's dtype."""
    check_inputs(x, gates, ids, u, v, activation)
    x, gates, ids = x.contiguous(), gates.contiguous(), ids.contiguous()
    N, k = ids.shape
    if N == 0 or k == 0:
        return torch.zeros_like(x)
    u, v = _weights(u, v, x.dtype, N * k)
    y = torch.empty_like(x)
    _token_pass(x, ids, gates, u, v, y, activation, forward=True)
    return y


def backward(dy, x, gates, ids, u, v, activation: str = "gelu"):
    """(dx (N, h) x's dtype, dgates (N, k) fp32, du, dv (M, h) in u's dtype)."""
    check_inputs(x, gates, ids, u, v, activation)
    x, dy = x.contiguous(), dy.contiguous().to(x.dtype)
    gates, ids = gates.contiguous(), ids.contiguous()
    (N, h), (M, k) = x.shape, (u.shape[0], ids.shape[1])
    if N == 0 or k == 0:
        return (torch.zeros_like(x), torch.zeros(N, k, device=x.device), torch.zeros_like(u),
                torch.zeros_like(v))
    du, dv = torch.empty_like(u), torch.empty_like(v)   # every row is written
    ur, vr = _weights(u, v, x.dtype, N * k)
    order, offsets = pair_order(ids, M)
    # every pair is one expert's: the expert pass writes each (n, j) of these once
    dgates = torch.empty(N, k, device=x.device, dtype=torch.float32)
    da = torch.empty_like(dgates)
    c = config(h, k)
    _expert_kernel[(M,)](x, dy, ur, vr, gates, order, offsets, dgates, da, du, dv, h, k,
                         x.stride(0), dy.stride(0), ur.stride(0), vr.stride(0), du.stride(0),
                         dv.stride(0), ACT=ACTIVATION_CODES[activation], BP=c["BP"],
                         BH=c["BH"], num_warps=c["num_warps"])
    dx = torch.empty_like(x)
    _token_pass(x, ids, da, ur, ur, dx, activation, forward=False)
    return dx, dgates, du, dv
