"""Grouped SwiGLU expert kernels: gather and scatter inside the kernels (scatter2scatter).

Legend: N tokens, k slots, P = N·k (token, slot) pairs, h hidden (H), s expert width (S),
M experts; xg = x W_gateᵀ and xu = x W_upᵀ the two SwiGLU branches (act = silu(xg) ⊙ xu),
gates the router's (one per pair).
Weights: w_gate, w_up (M, s, h), w_down (M, h, s). Rows are processed in the expert-sorted
order of routing_meta: each program owns one block of at most BM sorted rows of one expert,
so a block never loops over experts (decoding touches only the experts present).

Forward
  _gate_up_kernel  (B, s/BS)  x (gathered by token), w_gate, w_up -> act = silu(xg) xu (P, s)
                              [+ xg, xu (P, s) kept for the backward]
  _down_kernel     (B, h/BH)  act, w_down, gates -> out (P, h) in pair order (row n·k + j),
                              out = gate · act W_downᵀ
  token_rows.combine_pairs    out -> y (N, h) = Σ_j out[n·k + j]: the k rows of a token are
                              summed in a fixed order, so y is deterministic (no atomics)
Backward
  _down_bwd_kernel (B, s/BS)  dy (gathered), w_down, act, xg, xu, gates -> dxg, dxu (P, s) and
                              the gate gradient partials (s/BS, P): t = dy W_down,
                              dgate = t · act, dact = gate t, then the SwiGLU derivative
  _dx_kernel       (B, h/BH)  dxg, dxu, w_gate, w_up -> dx pair rows (P, h), combined as above
  expert_wgrad     (pieces, C/BC, D/BD)  per expert: Σ over its rows of Aᵀ B (dW_gate = dgᵀ x,
                              dW_up = duᵀ x, dW_down = (gate dy)ᵀ act), an expert's rows cut
                              into pieces of dw_piece_rows (summed by several programs,
                              then in piece order): a fixed order, robust to hot experts

An expert-parallel shard (first_expert: its weights are experts [first_expert, + M) of a
larger layer): the other shards' slots get no block (never read or written), the combine
skips them. Chunks of tokens (bounds, callbacks before and after each): one launch per
chunk over its blocks, so that a caller overlaps communication with the next chunk.

The (P, s) intermediates are the same size as the activations a plain implementation keeps;
the (P, h) pair rows are the price of a deterministic combine (see benchmarks/NOTES.md).
Any h and s: the last chunk of each is masked, the chunks BS / BH at least 16 wide (the
MMA's smallest K); offsets and row indices int64. The weights are x's dtype or fp32 (master
weights under autocast): fp32 tiles are rounded to x's dtype as loaded (to nearest even, as
torch's cast), with no cast copy in memory. The weight gradients come out in fp32, or are
added by expert_wgrad's epilogue into fp32 buffers across micro-steps (backward's `into`).
"""
import torch
import triton
import triton.language as tl

from . import DTYPES
from . import expert_wgrad as wgrad
from ._common import load_rows, matmul_precision, next_pow2
from .routing_meta import RoutingMeta, routing_meta
from .token_rows import combine_pairs


@triton.jit
def _block(BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M, BM: tl.constexpr):
    """Expert (-1: none), sorted rows, their validity and pair ids of the block in slot
    B0 + program_id(0); its rows end where its virtual expert's do, its weights are expert
    v mod M's (routing_meta)."""
    b = tl.program_id(0) + B0
    v = tl.load(BLOCK_EXPERT + b)
    start = tl.load(BLOCK_START + b)
    end = tl.where(v >= 0, tl.load(OFFSETS + tl.maximum(v, 0) + 1), start)
    rows = start + tl.arange(0, BM).to(tl.int64)
    ok = rows < end
    pair = tl.load(ORDER + rows, mask=ok, other=0)
    return tl.where(v >= 0, v % M, -1), rows, ok, pair


@triton.jit
def _gate_up(X, WG, WU, e, tok, ok, ss, s_ok, H, sx_n, sw_e, sw_s, sw_h,
             h_lo, h_hi, BM: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
             PREC: tl.constexpr):
    """(x W_gateᵀ, x W_upᵀ) (BM, BS) fp32 of expert e for the token rows tok, summed over
    h in [h_lo, h_hi)."""
    wg_base = WG + e.to(tl.int64) * sw_e
    wu_base = WU + e.to(tl.int64) * sw_e
    acc_xg = tl.zeros((BM, BS), tl.float32)
    acc_xu = tl.zeros((BM, BS), tl.float32)
    for h0 in range(h_lo, h_hi, BH):
        hh = h0 + tl.arange(0, BH)
        h_ok = hh < h_hi
        x = load_rows(X, tok, ok, sx_n, hh, h_ok, 1)
        wg = load_rows(wg_base, ss, s_ok, sw_s, hh, h_ok, sw_h).to(x.dtype)
        wu = load_rows(wu_base, ss, s_ok, sw_s, hh, h_ok, sw_h).to(x.dtype)
        acc_xg = tl.dot(x, tl.trans(wg), acc_xg, input_precision=PREC)
        acc_xu = tl.dot(x, tl.trans(wu), acc_xu, input_precision=PREC)
    return acc_xg, acc_xu


@triton.jit
def _gate_up_kernel(X, WG, WU, ACT, XG, XU, BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M,
                    H, S, K, P, H_PER, sx_n, sw_e, sw_s, sw_h, SAVE: tl.constexpr,
                    SPLIT: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                    BH: tl.constexpr,
                    PREC: tl.constexpr):
    """SPLIT (inference with few blocks): program (b, j, q) sums h in [q·H_PER, (q+1)·H_PER)
    only, writing its fp32 partial xg, xu to XG, XU (n_split, P, S) for the down kernel."""
    e, rows, ok, pair = _block(BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M, BM)
    if e >= 0:
        ss = tl.program_id(1) * BS + tl.arange(0, BS)
        s_ok = ss < S
        offs = rows[:, None] * S + ss[None, :]
        mask = ok[:, None] & s_ok[None, :]
        h_lo = tl.program_id(2) * H_PER
        acc_xg, acc_xu = _gate_up(X, WG, WU, e, pair // K, ok, ss, s_ok, H, sx_n, sw_e, sw_s,
                                  sw_h, h_lo, tl.minimum(h_lo + H_PER, H), BM, BS, BH,
                                  PREC)
        if SPLIT:
            part = tl.program_id(2).to(tl.int64) * P * S + offs
            tl.store(XG + part, acc_xg, mask=mask)
            tl.store(XU + part, acc_xu, mask=mask)
        else:
            act = acc_xg * tl.sigmoid(acc_xg) * acc_xu
            tl.store(ACT + offs, act.to(ACT.dtype.element_ty), mask=mask)
        if SAVE:
            tl.store(XG + offs, acc_xg.to(XG.dtype.element_ty), mask=mask)
            tl.store(XU + offs, acc_xu.to(XU.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(ACT, XG, XU, WD, GATES, OUT, BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0,
                 M, H, S, P, N_SPLIT, sw_e, sw_h, sw_s, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
                 PREC: tl.constexpr):
    """SPLIT: act = silu(Σ xg) Σ xu from the gate/up kernel's N_SPLIT fp32 partials, rounded
    to ACT's dtype as the stored act would be."""
    e, rows, ok, pair = _block(BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M, BM)
    if e >= 0:
        hh = tl.program_id(1) * BH + tl.arange(0, BH)
        h_ok = hh < H
        wd_base = WD + e.to(tl.int64) * sw_e
        acc = tl.zeros((BM, BH), tl.float32)
        for s0 in range(0, S, BS):
            ss = s0 + tl.arange(0, BS)
            s_ok = ss < S
            if SPLIT:
                xg = tl.zeros((BM, BS), tl.float32)
                xu = tl.zeros((BM, BS), tl.float32)
                xg_q, xu_q = XG, XU
                for _ in range(0, N_SPLIT):
                    xg += load_rows(xg_q, rows, ok, S, ss, s_ok, 1)
                    xu += load_rows(xu_q, rows, ok, S, ss, s_ok, 1)
                    xg_q += P * S
                    xu_q += P * S
                a = (xg * tl.sigmoid(xg) * xu).to(ACT.dtype.element_ty)
            else:
                a = load_rows(ACT, rows, ok, S, ss, s_ok, 1)
            wd = load_rows(wd_base, hh, h_ok, sw_h, ss, s_ok, sw_s).to(a.dtype)
            acc = tl.dot(a, tl.trans(wd), acc, input_precision=PREC)
        gate = tl.load(GATES + pair, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + pair[:, None] * H + hh[None, :], (acc * gate[:, None]).to(
            OUT.dtype.element_ty), mask=ok[:, None] & h_ok[None, :])


@triton.jit
def _fused_kernel(X, WG, WU, WD, GATES, OUT, BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M,
                  H, S, K, sx_n, sw_e, sw_s, sw_h, sd_e, sd_h, sd_s,
                  ATOMIC: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
                  PREC: tl.constexpr):
    """Inference with s <= BS: gate/up and down projections in one program, act kept on chip
    (no (P, s) round trip, one launch). Program (b, j) does the down projection's h chunks
    j, j + n, j + 2n, ... (n programs along axis 1): n = 1 when there are blocks enough to
    fill the GPU, more when few (decoding), each then recomputing the block's act.
    OUT: the pair rows (P, h), or with ATOMIC the fp32 (N, h) sum itself through float
    atomics (order-dependent: opt-in, not deterministic)."""
    e, rows, ok, pair = _block(BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M, BM)
    if e >= 0:
        tok = pair // K
        ss = tl.arange(0, BS)
        s_ok = ss < S
        wd_base = WD + e.to(tl.int64) * sd_e
        acc_xg, acc_xu = _gate_up(X, WG, WU, e, tok, ok, ss, s_ok, H, sx_n, sw_e, sw_s, sw_h,
                                  0, H, BM, BS, BH, PREC)
        act = (acc_xg * tl.sigmoid(acc_xg) * acc_xu).to(X.dtype.element_ty)
        gate = tl.load(GATES + pair, mask=ok, other=0.0).to(tl.float32)
        dest = tok if ATOMIC else pair
        for h0 in range(tl.program_id(1) * BH, H, tl.num_programs(1) * BH):
            hh = h0 + tl.arange(0, BH)
            h_ok = hh < H
            wd = load_rows(wd_base, hh, h_ok, sd_h, ss, s_ok, sd_s).to(act.dtype)
            out = tl.dot(act, tl.trans(wd), input_precision=PREC) * gate[:, None]
            ptr = OUT + dest[:, None] * H + hh[None, :]
            mask = ok[:, None] & h_ok[None, :]
            if ATOMIC:
                tl.atomic_add(ptr, out, mask=mask, sem="relaxed")
            else:
                tl.store(ptr, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _down_bwd_kernel(DY, WD, ACT, XG, XU, GATES, DXG, DXU, DGATE, BLOCK_EXPERT, BLOCK_START,
                     OFFSETS, ORDER, B0, M, H, S, P, K, sdy_n, sw_e, sw_h, sw_s,
                     BM: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
                     PREC: tl.constexpr):
    e, rows, ok, pair = _block(BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M, BM)
    if e >= 0:
        tok = pair // K
        ss = tl.program_id(1) * BS + tl.arange(0, BS)
        s_ok = ss < S
        wd_base = WD + e.to(tl.int64) * sw_e
        t = tl.zeros((BM, BS), tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            h_ok = hh < H
            dy = load_rows(DY, tok, ok, sdy_n, hh, h_ok, 1)
            t = tl.dot(dy, load_rows(wd_base, hh, h_ok, sw_h, ss, s_ok, sw_s).to(dy.dtype), t,
                       input_precision=PREC)
        offs = rows[:, None] * S + ss[None, :]
        mask = ok[:, None] & s_ok[None, :]
        act = tl.load(ACT + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DGATE + tl.program_id(1).to(tl.int64) * P + pair, tl.sum(t * act, axis=1),
                 mask=ok)
        gate = tl.load(GATES + pair, mask=ok, other=0.0).to(tl.float32)
        dact = t * gate[:, None]
        xg = tl.load(XG + offs, mask=mask, other=0.0).to(tl.float32)
        xu = tl.load(XU + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(xg)
        tl.store(DXU + offs, (dact * xg * sig).to(DXU.dtype.element_ty), mask=mask)
        dsilu = sig * (1.0 + xg * (1.0 - sig))
        tl.store(DXG + offs, (dact * xu * dsilu).to(DXG.dtype.element_ty), mask=mask)


@triton.jit
def _dx_kernel(DXG, DXU, WG, WU, OUT, BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M,
               H, S, sw_e, sw_s, sw_h, BM: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
               PREC: tl.constexpr):
    e, rows, ok, pair = _block(BLOCK_EXPERT, BLOCK_START, OFFSETS, ORDER, B0, M, BM)
    if e >= 0:
        hh = tl.program_id(1) * BH + tl.arange(0, BH)
        h_ok = hh < H
        wg_base = WG + e.to(tl.int64) * sw_e
        wu_base = WU + e.to(tl.int64) * sw_e
        acc = tl.zeros((BM, BH), tl.float32)
        for s0 in range(0, S, BS):
            ss = s0 + tl.arange(0, BS)
            s_ok = ss < S
            dxg = load_rows(DXG, rows, ok, S, ss, s_ok, 1)
            dxu = load_rows(DXU, rows, ok, S, ss, s_ok, 1)
            wg = load_rows(wg_base, ss, s_ok, sw_s, hh, h_ok, sw_h).to(dxg.dtype)
            wu = load_rows(wu_base, ss, s_ok, sw_s, hh, h_ok, sw_h).to(dxu.dtype)
            acc = tl.dot(dxg, wg, acc, input_precision=PREC)
            acc = tl.dot(dxu, wu, acc, input_precision=PREC)
        tl.store(OUT + pair[:, None] * H + hh[None, :], acc.to(OUT.dtype.element_ty),
                 mask=ok[:, None] & h_ok[None, :])


# ---------------------------------------------------------------- launchers

def check_inputs(x, gates, idx, w_gate, w_up, w_down) -> None:
    N, h = x.shape
    M, s, h2 = w_gate.shape
    if h2 != h or w_up.shape != (M, s, h) or w_down.shape != (M, h, s):
        raise ValueError(f"expert weights must be w_gate, w_up (M, s, h) = ({M}, {s}, {h}) "
                         f"and w_down (M, h, s); got {tuple(w_gate.shape)}, "
                         f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")
    wdt = {w.dtype for w in (w_gate, w_up, w_down)}
    if x.dtype not in DTYPES or len(wdt) != 1 or not wdt <= {x.dtype, torch.float32}:
        raise TypeError(f"x must have a dtype of {DTYPES} and the expert weights all x's "
                        f"dtype or all float32, got {x.dtype}, {w_gate.dtype}, "
                        f"{w_up.dtype}, {w_down.dtype}")
    if w_up.stride() != w_gate.stride():        # the kernels take one set of strides for both
        raise ValueError(f"w_up must have w_gate's strides {w_gate.stride()}, got "
                         f"{w_up.stride()}")
    if idx.shape != gates.shape or idx.shape[0] != N:
        raise ValueError(f"topk_idx and gates must both be (N, k) with N={N}, got "
                         f"{tuple(idx.shape)} and {tuple(gates.shape)}")


def config(h: int, s: int, overrides: dict | None = None) -> dict:
    """BM sorted rows per block (a 64-row MMA), BS / BH the s and h chunks; dw_* the weight
    gradients' own tiles (rows summed per step, the two weight dimensions), warps and
    stages, by default the same as the blocks', and dw_piece_rows the rows one program sums
    (expert_wgrad; 2^62: one program an expert); dw_pair: the gate and up projections'
    gradients in one launch (x's rows gathered once), on by default: two launches fewer a
    layer in a launch-bound step (the phonebook's 16 x 64 tiles), and at 64 x 64, where its
    two accumulators spill in a compile for sm_90, the backward still 1.03-1.09x faster at
    every point `bench experts --tune` timed on an H100 (h = 512, M = 256 to 8,192, bf16 and
    fp32 weights, uniform and Zipf routing; 0e637fc)."""
    cfg = {"BM": 64, "BS": max(16, min(64, next_pow2(s))), "BH": max(16, min(64, next_pow2(h))),
           "num_warps": 4, "num_stages": 2}
    cfg.update({k: v for k, v in (overrides or {}).items() if not k.startswith("dw_")})
    cfg.update({"dw_BR": cfg["BM"], "dw_BS": cfg["BS"], "dw_BH": cfg["BH"],
                "dw_warps": cfg["num_warps"], "dw_stages": cfg["num_stages"],
                "dw_piece_rows": wgrad.PIECE_ROWS})
    cfg.update({k: v for k, v in (overrides or {}).items() if k.startswith("dw_")})
    cfg.setdefault("dw_pair", True)
    cfg.setdefault("fused", None)
    cfg.setdefault("split_h", None)
    unknown = set(cfg) - {"BM", "BS", "BH", "num_warps", "num_stages", "dw_BR", "dw_BS",
                          "dw_BH", "dw_warps", "dw_stages", "dw_piece_rows", "dw_pair",
                          "fused", "split_h"}
    if unknown:
        raise ValueError(f"unknown expert kernel config keys {sorted(unknown)}")
    for key in ("BM", "BS", "BH", "dw_BR", "dw_BS", "dw_BH"):
        v = cfg[key]
        if not (isinstance(v, int) and v >= 16 and v & (v - 1) == 0):
            # tl.dot's smallest operand on a GPU (the interpreter takes smaller ones)
            raise ValueError(f"expert kernel config {key} must be a power of two >= 16, "
                             f"got {v!r}")
    return cfg


def _launch(c: dict, dtype: torch.dtype) -> dict:
    """The row-block kernels' tile and launch parameters from a config, and the products'
    precision for inputs of dtype (matmul_precision)."""
    return dict(BM=c["BM"], BS=c["BS"], BH=c["BH"], num_warps=c["num_warps"],
                num_stages=c["num_stages"], PREC=matmul_precision(dtype))


def _meta(meta: RoutingMeta | None, idx, M: int, c: dict, first_expert, **kw) -> RoutingMeta:
    first = first_expert or 0
    if meta is None:
        return routing_meta(idx, M, c["BM"], first_expert=first, **kw)
    if meta.block_rows != c["BM"] or (meta.tokens, meta.top_k) != tuple(idx.shape):
        raise ValueError(f"meta was built for BM={meta.block_rows} and (N, k) = "
                         f"({meta.tokens}, {meta.top_k}); this call has BM={c['BM']} and "
                         f"{tuple(idx.shape)}")
    if meta.first_expert != first:
        raise ValueError(f"meta was built for first_expert={meta.first_expert}; this call "
                         f"has {first}")
    return meta


# Inference with s <= BS takes the one-kernel forward (cfg fused=None) where it measured
# faster on the H100 (benchmarks/NOTES.md, issue 14): with blocks enough to fill the GPU
# (2.07 against 2.56 ms at N = 262,144, M = 8,192) and with so few that one launch less
# outweighs recomputing gate/up per h split (N = 4: 20.5 against 23.4 us); between them
# (N = 16 … 64 tokens) the two kernels are faster.
FILL_BLOCKS = 1024    # row blocks that fill an H100 (132 SMs) without splitting h
FEW_BLOCKS = 32
FEW_BLOCKS_MAX_H = 512
# The two-kernel inference forward splits the gate/up projection's reduction over h across
# programs when there are <= FEW_BLOCKS programs (decoding a few tokens), about this many
# programs in all: without it each block's program loops over all of h (h = 4,096, 4
# tokens: 81.5 against 60.2 us split); at 16 tokens (65 blocks) the split lost (103 against
# 125 us at h = 4,096) and is not taken.
SPLIT_PROGRAMS = 264


def _launcher(x, gates_flat, w_gate, w_up, w_down, meta, k, c, *, save, fused, atomic):
    """(launch(first slot, slots), out, act, xg, xu): the kernels that write the gated pair
    rows (P, h) of the blocks in the given slots, or (atomic) add them into out (N, h) fp32."""
    (N, h), (M, s, _) = x.shape, w_gate.shape
    P, dev, dt, B = N * k, x.device, x.dtype, meta.max_blocks
    args = (meta.block_expert, meta.block_start, meta.offsets, meta.order)
    out = (torch.zeros(N, h, device=dev, dtype=torch.float32) if atomic
           else torch.empty(P, h, device=dev, dtype=dt))
    if fused:
        split = 1 if B >= FILL_BLOCKS else triton.cdiv(h, c["BH"])

        def launch(b0, nb):
            _fused_kernel[(nb, split)](
                x, w_gate, w_up, w_down, gates_flat, out, *args, b0, M, h, s, k, x.stride(0),
                *w_gate.stride(), *w_down.stride(), ATOMIC=atomic, **_launch(c, dt))
        return launch, out, None, None, None
    act = torch.empty(P, s, device=dev, dtype=dt)
    n_s, n_h = triton.cdiv(s, c["BS"]), triton.cdiv(h, c["BH"])
    split = 1 if save else c["split_h"] or (
        1 if B * n_s > FEW_BLOCKS else max(1, min(n_h, SPLIT_PROGRAMS // (B * n_s))))
    h_per = triton.cdiv(n_h, split) * c["BH"]
    split = triton.cdiv(h, h_per)
    if split > 1:           # fp32 partials of xg, xu per h split
        xg = torch.empty(split, P, s, device=dev, dtype=torch.float32)
    else:                   # the saved xg, xu (a placeholder when not saving)
        xg = torch.empty(P if save else 1, s, device=dev, dtype=dt)
    xu = torch.empty_like(xg)

    def launch(b0, nb):
        _gate_up_kernel[(nb, n_s, split)](
            x, w_gate, w_up, act, xg, xu, *args, b0, M, h, s, k, P, h_per, x.stride(0),
            *w_gate.stride(), SAVE=save, SPLIT=split > 1, **_launch(c, dt))
        _down_kernel[(nb, n_h)](
            act, xg, xu, w_down, gates_flat, out, *args, b0, M, h, s, P, split,
            *w_down.stride(), SPLIT=split > 1, **_launch(c, dt))
    return launch, out, act, xg, xu


def forward(x, gates, idx, w_gate, w_up, w_down, *, save: bool = False,
            cfg: dict | None = None, walk_experts: bool = False,
            meta: RoutingMeta | None = None, combine: str = "pairs", first_expert=None,
            bounds=None, before=None, after=None):
    """y (N, h) in x's dtype; with save also (act, xg, xu) (P, s) in sorted-row order.
    meta: routing_meta(idx, M, BM) when the caller has it (the backward reuses the
    forward's); walk_experts: the benchmarks' baseline schedule (routing_meta).
    Inference with s <= BS runs gate/up and down in one kernel, act kept on chip, where that
    is faster (FILL_BLOCKS, FEW_BLOCKS; cfg fused=True / False forces it);
    combine="atomic" (opt-in, inference with s <= BS, fused) sums each token's k rows
    through fp32 atomics instead of pair rows: the summation order, hence the last bits of y,
    may differ between runs.
    first_expert: the weights are experts [first_expert, first_expert + M) of a larger layer
    (an expert-parallel shard): the slots of other ids add nothing (a token with none of
    the shard's slots gets a zero row) and get no gradient.
    bounds (b_0 = 0, ..., b_C = N), before, after: run in chunks of tokens [b_c, b_{c+1})
    (routing_meta's chunks): before(c) is called before chunk c's rows of x are read,
    after(c, y[b_c:b_{c+1}]) once they are written (enqueued on the current stream), so that
    a caller can overlap communication with the other chunks' experts."""
    if combine not in ("pairs", "atomic"):
        raise ValueError(f"combine must be 'pairs' or 'atomic', got {combine!r}")
    check_inputs(x, gates, idx, w_gate, w_up, w_down)
    x, idx = x.contiguous(), idx.contiguous()
    N, h = x.shape
    M, s, _ = w_gate.shape
    k = idx.shape[1]
    c = config(h, s, cfg)
    meta = _meta(meta, idx, M, c, first_expert, walk_experts=walk_experts, bounds=bounds)
    gates_flat = gates.reshape(-1).contiguous()
    B = meta.max_blocks
    one_kernel = not save and s <= c["BS"]
    atomic = combine == "atomic"
    if atomic and not (one_kernel and meta.chunks == 1 and first_expert is None):
        raise ValueError(f"combine='atomic' needs inference (save=False) with s <= BS "
                         f"({c['BS']}) in one chunk of the whole layer; got save={save}, "
                         f"s={s}, {meta.chunks} chunks, first_expert={first_expert}")
    fused = atomic or (c["fused"] if c["fused"] is not None else (
        B >= FILL_BLOCKS or (B <= FEW_BLOCKS and h <= FEW_BLOCKS_MAX_H)))
    launch, out, act, xg, xu = _launcher(x, gates_flat, w_gate, w_up, w_down, meta, k, c,
                                         save=save, fused=one_kernel and fused, atomic=atomic)
    if atomic:
        if N * k:
            launch(0, B)
        return out.to(x.dtype)
    y = torch.empty(N, h, device=x.device, dtype=x.dtype)
    bounds = meta.bounds or (0, N)
    for chunk, (b0, nb) in enumerate(meta.slots):
        if before is not None:
            before(chunk)
        if nb and N * k:
            launch(b0, nb)
        combine_pairs(y, out, idx, bounds[chunk], bounds[chunk + 1], first_expert, M)
        if after is not None:
            after(chunk, y[bounds[chunk]:bounds[chunk + 1]])
    return (y, act, xg, xu) if save else y


def backward(dy, x, gates, idx, w_gate, w_up, w_down, act, xg, xu, *, cfg: dict | None = None,
             meta: RoutingMeta | None = None, first_expert=None, into=None, keep=None):
    """(dx (N, h), dgates (N, k) fp32, dw_gate, dw_up, dw_down) from the saved act, xg, xu
    and the forward's routing metadata (needed when the forward ran in chunks, whose
    sorted-row order act, xg and xu follow); first_expert as the forward's. into (fp32
    g_gate, g_up, g_down; ops' GradInto checks them), keep (int32, one element): the weight
    gradients are added into `into` where keep[0] != 0, else stored over it; then keep = 1."""
    x, dy, idx = x.contiguous(), dy.contiguous().to(x.dtype), idx.contiguous()
    N, h = x.shape
    M, s, _ = w_gate.shape
    k = idx.shape[1]
    c = config(h, s, cfg)
    meta = _meta(meta, idx, M, c, first_expert)
    P, dev, dt = N * k, x.device, x.dtype
    B, chunks = meta.max_blocks, (meta.offsets.numel() - 1) // M   # offsets: C·M + 1
    args = (meta.block_expert, meta.block_start, meta.offsets, meta.order)
    gates_flat = gates.reshape(-1).contiguous()
    n_s = triton.cdiv(s, c["BS"])
    dxg = torch.empty(P, s, device=dev, dtype=dt)
    dxu = torch.empty_like(dxg)
    # each pair's dgate is written once an h tile, unless it is another shard's (first_expert
    # given): then it stays zero
    dgate = (torch.empty if P and first_expert is None else torch.zeros)(
        n_s, max(P, 1), device=dev, dtype=torch.float32)
    dx_pairs = torch.empty(P, h, device=dev, dtype=dt)
    # the dW kernels write every element (experts with no rows: zeros), if there are pairs
    dws = list(into) if into is not None else [
        (torch.empty_like if P else torch.zeros_like)(w) for w in (w_gate, w_up, w_down)]
    if P:
        blk = _launch(c, dt)
        _down_bwd_kernel[(B, n_s)](dy, w_down, act, xg, xu, gates_flat, dxg, dxu, dgate, *args,
                                   0, M, h, s, P, k, dy.stride(0), *w_down.stride(), **blk)
        _dx_kernel[(B, triton.cdiv(h, c["BH"]))](dxg, dxu, w_gate, w_up, dx_pairs, *args, 0, M,
                                                 h, s, *w_gate.stride(), **blk)
        bs, bh = c["dw_BS"], c["dw_BH"]
        rows = c["dw_piece_rows"]
        wk = dict(experts=M, chunks=chunks, k=k, accumulate=into is not None, br=c["dw_BR"],
                  warps=c["dw_warps"], stages=c["dw_stages"],
                  pieces=wgrad.plan(meta.offsets, M, chunks, rows, P))
        # dW = aᵀ x, (s, h) an expert, for the gate and up projections in one launch (x's
        # rows gathered once; config dw_pair) where their gradients share strides
        same = c["dw_pair"] and dws[0].stride() == dws[1].stride()
        for a, dw, a2, dw2 in (((dxg, dws[0], dxu, dws[1]),) if same else
                               ((dxg, dws[0], None, None), (dxu, dws[1], None, None))):
            wgrad.weight_grad(a, x, gates_flat, dw, keep, meta.offsets, meta.order,
                              a_by_token=False, b_by_token=True, scale_a=False, bc=bs, bd=bh,
                              a2=a2, dw2=dw2, **wk)
        wgrad.weight_grad(dy, act, gates_flat, dws[2], keep, meta.offsets, meta.order,
                          a_by_token=True, b_by_token=False, scale_a=True, bc=bh, bd=bs,
                          **wk)                          # (gate dy)ᵀ act: (h, s)
    elif into is not None:              # no pairs: a stale buffer becomes zeros
        for g in dws:
            g.masked_fill_(keep == 0, 0.0)
    dx = torch.empty(N, h, device=dev, dtype=dt)
    combine_pairs(dx, dx_pairs, idx, 0, N, first_expert, M)
    dgates = (dgate[0] if n_s == 1 else dgate.sum(0))[:P].reshape(N, k)
    if into is not None:
        keep.fill_(1)
    return (dx, dgates, *dws)

