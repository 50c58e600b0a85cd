"""Per-expert weight gradients, dW[e] = Σ over expert e's sorted rows of Aᵀ B, split so that
an expert with many rows is summed by several programs, in a fixed order.

One program per expert (the first version) loops over all of its expert's rows: a router
that sends most tokens to a few experts (as at the start of training: H_norm 0.4-0.66 in
MoRE-1792's first steps) leaves one program summing thousands of rows while the rest of the
GPU idles (the weight-gradient kernels were 27 % of the h = 512 presets' steps there;
benchmarks/NOTES.md, issue 36). Here expert e's rows, counted over every chunk of tokens,
c_e = Σ_c c_{c,e}, are cut into n_e = max(1, ceil(c_e / P)) pieces of P rows:

  plan(offsets, M, chunks, P, total)   pieces laid out expert by expert (first_e = Σ_{e'<e}
                                       n_e'); owner[i] the expert of piece i (M past the
                                       last); slot_e the first scratch slot of an expert of
                                       several pieces. B = M + ceil(total / P) programs
                                       cover every piece, S = 2 ceil(total / P) slots every
                                       several-piece expert's (c_e > P: n_e < 2 c_e / P);
                                       P grows with `total` so that S <= MAX_SLOTS (the
                                       scratch is allocated whatever the routing: 128 MB at
                                       most for a (64, 512) fp32 weight). Device tensors
                                       only: no host sync. On a GPU one launch of
                                       _plan_kernel (one program, PLAN_TILE experts a step)
                                       instead of plan_torch's ~16 ops (sums, cumsums, a
                                       searchsorted: as many kernels, in a backward that
                                       runs it once a layer for the experts and once for a
                                       router's sparse dW).
  _piece_kernel   (B, C/BC, D/BD)      the piece's rows in sorted order (a piece may span the
                                       chunks of its expert: their row ranges are walked in
                                       chunk order); an expert of one piece is stored to DW
                                       (added to it where KEEP says), else the sum goes to
                                       its scratch slot
  _reduce_kernel  (M, C/BC, D/BD)      the scratch slots of an expert of several pieces added
                                       in piece order (onto DW where KEEP says); others exit

So an expert's sum is always Σ over pieces in piece order of Σ over rows in row order:
deterministic, and the same whatever the timing (no atomics). At balanced routing (c_e <= P)
every expert is one piece and the work is the one-program version's.

Rows: a row of A (or B) is a token's (gathered by pair // K, A_BY_TOKEN / B_BY_TOKEN) or a
sorted row; SCALE_A multiplies A's rows by their pair's gate. piece_rows = 2^62 gives every
expert one piece: the one-program-per-expert schedule, kept for comparison (config
dw_piece_rows)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import load_rows, matmul_precision

PIECE_ROWS = 512      # P: rows a program sums (8 MMAs of 64 rows), at least
MAX_SLOTS = 1024      # scratch slots at most: P grows past PIECE_ROWS for more rows
PLAN_TILE = 1024      # experts a step of _plan_kernel's one program
KERNEL: bool | None = None   # plan by _plan_kernel: None on a GPU (the interpreter: torch ops)


class Plan(NamedTuple):
    owner: torch.Tensor       # (B,) int32: each piece's expert, M past the last
    first: torch.Tensor       # (M,) int64: each expert's first piece
    count: torch.Tensor       # (M,) int64: each expert's rows over every chunk
    slot: torch.Tensor        # (M,) int64: a several-piece expert's first scratch slot
    bound: int                # B, the programs a launch takes
    slots: int                # S, the scratch slots
    rows: int                 # P, the rows a piece holds


def plan(offsets: torch.Tensor, experts: int, chunks: int, piece_rows: int,
         total: int, *, kernel: bool | None = None, tile: int = PLAN_TILE) -> Plan:
    """Each expert's pieces of the sorted rows offsets (chunks·M + 1,) of `total` rows, at
    least piece_rows rows a piece, see above: by _plan_kernel (kernel; default: KERNEL, or
    on a GPU) or plan_torch, field for field the same."""
    piece_rows = max(piece_rows, triton.cdiv(2 * total, MAX_SLOTS))
    bound = experts + triton.cdiv(total, piece_rows)
    slots = max(1, 2 * triton.cdiv(total, piece_rows))
    kernel = (offsets.is_cuda if KERNEL is None else KERNEL) if kernel is None else kernel
    if not kernel:
        return plan_torch(offsets, experts, chunks, piece_rows, bound, slots)
    dev = offsets.device
    owner = torch.empty(bound, device=dev, dtype=torch.int32)
    first, count, slot = (torch.empty(experts, device=dev, dtype=torch.int64)
                          for _ in range(3))
    _plan_kernel[(1,)](offsets, owner, first, count, slot, experts, chunks, piece_rows, bound,
                       BE=tile, num_warps=4)
    return Plan(owner, first, count, slot, bound, slots, piece_rows)


@triton.jit
def _plan_kernel(OFFSETS, OWNER, FIRST, COUNT, SLOT, M, CHUNKS, P, BOUND, BE: tl.constexpr):
    """One program, BE experts a step: c_e over the chunks, n_e = max(1, ceil(c_e / P)),
    first_e and slot_e by running exclusive sums, owner[first_e + j] = e for j < n_e; the
    pieces past the last owned by M."""
    pieces = tl.sum(tl.zeros((BE,), tl.int64), 0)      # int64 scalars carried by the loop
    slots = pieces
    for e0 in range(0, M, BE):
        e = e0 + tl.arange(0, BE)
        ok = e < M
        c = tl.zeros((BE,), tl.int64)
        for ch in range(0, CHUNKS):
            lo = tl.load(OFFSETS + ch * M + e, mask=ok, other=0)
            hi = tl.load(OFFSETS + ch * M + e + 1, mask=ok, other=0)
            c += hi - lo
        n = tl.where(ok, tl.maximum((c + P - 1) // P, 1), 0)
        several = tl.where(n > 1, n, 0)
        first = pieces + tl.cumsum(n, 0) - n
        tl.store(COUNT + e, c, mask=ok)
        tl.store(FIRST + e, first, mask=ok)
        tl.store(SLOT + e, slots + tl.cumsum(several, 0) - several, mask=ok)
        for j in range(0, tl.max(n, 0)):
            tl.store(OWNER + first + j, e, mask=j < n)
        pieces += tl.sum(n, 0)
        slots += tl.sum(several, 0)
    for i0 in range(pieces.to(tl.int32), BOUND, BE):
        i = i0 + tl.arange(0, BE)
        tl.store(OWNER + i, tl.zeros((BE,), tl.int32) + M, mask=i < BOUND)


def plan_torch(offsets: torch.Tensor, experts: int, chunks: int, piece_rows: int, bound: int,
               slots: int) -> Plan:
    """plan's reference in torch ops (piece_rows, bound and slots as plan derives them)."""
    per = (offsets[1:] - offsets[:-1]).reshape(chunks, experts).sum(0)       # c_e
    n = torch.clamp(torch.div(per + piece_rows - 1, piece_rows, rounding_mode="floor"), min=1)
    ends = torch.cumsum(n, 0)
    owner = torch.searchsorted(ends, torch.arange(bound, device=offsets.device,
                                                  dtype=ends.dtype), right=True)
    several = torch.where(n > 1, n, 0)
    slot = torch.cumsum(several, 0) - several
    return Plan(owner.to(torch.int32), ends - n, per, slot, bound, slots, piece_rows)


@triton.jit
def _piece_sum(A, A2, B, GATES, OFFSETS, ORDER, e, lo, hi, M, CHUNKS, C, D, K, sa_r, sb_r, cc,
               dd, c_ok, d_ok, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
               SCALE_A: tl.constexpr, TWO: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
               BD: tl.constexpr, PREC: tl.constexpr):
    """Σ of Aᵀ B (and with TWO, of A2ᵀ B: A2 laid out as A, B's rows loaded once for both)
    over rows [lo, hi) of expert e's rows concatenated over the chunks (chunk c's rows are
    order[offsets[c·M + e] : offsets[c·M + e + 1]]), in that order."""
    acc = tl.zeros((BC, BD), tl.float32)
    acc2 = tl.zeros((BC, BD), tl.float32)
    seen = lo * 0                           # rows of expert e in the chunks before this one
    for chunk in range(0, CHUNKS):
        start = tl.load(OFFSETS + chunk * M + e)
        end = tl.load(OFFSETS + chunk * M + e + 1)
        a0 = tl.maximum(lo - seen, 0) + start          # this chunk's part of [lo, hi)
        a1 = tl.minimum(hi - seen, end - start) + start
        for r0 in range(a0, a1, BR):
            rows = r0 + tl.arange(0, BR).to(tl.int64)
            ok = rows < a1
            pair = tl.load(ORDER + rows, mask=ok, other=0)
            ra = rows
            rb = rows
            if A_BY_TOKEN:
                ra = pair // K
            if B_BY_TOKEN:
                rb = pair // K
            a = load_rows(A, ra, ok, sa_r, cc, c_ok, 1)
            if SCALE_A:
                gate = tl.load(GATES + pair, mask=ok, other=0.0).to(tl.float32)
                a = (a.to(tl.float32) * gate[:, None]).to(a.dtype)
            b = load_rows(B, rb, ok, sb_r, dd, d_ok, 1).to(a.dtype)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)
            if TWO:
                a2 = load_rows(A2, ra, ok, sa_r, cc, c_ok, 1)
                if SCALE_A:
                    a2 = (a2.to(tl.float32) * gate[:, None]).to(a2.dtype)
                acc2 = tl.dot(tl.trans(a2), b, acc2, input_precision=PREC)
        seen += end - start
    return acc, acc2


@triton.jit
def _piece_kernel(A, A2, B, GATES, DW, DW2, KEEP, OFFSETS, ORDER, OWNER, FIRST, COUNT, SLOT,
                  SCRATCH, SCRATCH2, CHUNKS, M, C, D, K, P, sa_r, sb_r, sw_e, sw_c, sw_d,
                  A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, SCALE_A: tl.constexpr,
                  ACCUMULATE: tl.constexpr, TWO: tl.constexpr, BR: tl.constexpr,
                  BC: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """Piece program_id(0): its sum stored to DW (an expert of one piece; added where
    KEEP[0] != 0 with ACCUMULATE) or to its scratch slot (SCRATCH (S, C, D) fp32); with TWO
    the same for A2's sum into DW2 / SCRATCH2."""
    i = tl.program_id(0)
    e = tl.load(OWNER + i)
    if e < M:
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        dd = tl.program_id(2) * BD + tl.arange(0, BD)
        c_ok = cc < C
        d_ok = dd < D
        j = i - tl.load(FIRST + e)
        count = tl.load(COUNT + e)
        lo = j * P
        acc, acc2 = _piece_sum(A, A2, B, GATES, OFFSETS, ORDER, e, lo,
                               tl.minimum(lo + P, count), M, CHUNKS, C, D, K, sa_r, sb_r, cc,
                               dd, c_ok, d_ok, A_BY_TOKEN, B_BY_TOKEN, SCALE_A, TWO, BR, BC,
                               BD, PREC)
        mask = c_ok[:, None] & d_ok[None, :]
        if count > P:       # several pieces: the scratch slot, added up by _reduce_kernel
            s = (tl.load(SLOT + e) + j).to(tl.int64)
            at = s * C * D + cc[:, None] * D + dd[None, :]
            tl.store(SCRATCH + at, acc, mask=mask)
            if TWO:
                tl.store(SCRATCH2 + at, acc2, mask=mask)
        else:
            _store(DW, KEEP, e, cc, dd, mask, acc, sw_e, sw_c, sw_d, ACCUMULATE, BC, BD)
            if TWO:
                _store(DW2, KEEP, e, cc, dd, mask, acc2, sw_e, sw_c, sw_d, ACCUMULATE, BC, BD)


@triton.jit
def _reduce_kernel(DW, DW2, KEEP, COUNT, SLOT, SCRATCH, SCRATCH2, M, C, D, P, sw_e, sw_c, sw_d,
                   ACCUMULATE: tl.constexpr, TWO: tl.constexpr, BC: tl.constexpr,
                   BD: tl.constexpr):
    """Expert program_id(0) of several pieces: its scratch slots summed in piece order (with
    TWO, SCRATCH2's into DW2 too)."""
    e = tl.program_id(0)
    count = tl.load(COUNT + e)
    if count > P:
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        dd = tl.program_id(2) * BD + tl.arange(0, BD)
        mask = (cc < C)[:, None] & (dd < D)[None, :]
        first = tl.load(SLOT + e).to(tl.int64)
        acc = tl.zeros((BC, BD), tl.float32)
        acc2 = tl.zeros((BC, BD), tl.float32)
        for s in range(first, first + (count + P - 1) // P):
            at = s * C * D + cc[:, None] * D + dd[None, :]
            acc += tl.load(SCRATCH + at, mask=mask, other=0.0)
            if TWO:
                acc2 += tl.load(SCRATCH2 + at, mask=mask, other=0.0)
        _store(DW, KEEP, e, cc, dd, mask, acc, sw_e, sw_c, sw_d, ACCUMULATE, BC, BD)
        if TWO:
            _store(DW2, KEEP, e, cc, dd, mask, acc2, sw_e, sw_c, sw_d, ACCUMULATE, BC, BD)


@triton.jit
def _store(DW, KEEP, e, cc, dd, mask, acc, sw_e, sw_c, sw_d, ACCUMULATE: tl.constexpr,
           BC: tl.constexpr, BD: tl.constexpr):
    """Expert e's whole sum acc stored to its tile of DW, or added to it where KEEP[0] != 0
    with ACCUMULATE (a stale buffer is overwritten)."""
    ptr = DW + e.to(tl.int64) * sw_e + cc[:, None] * sw_c + dd[None, :] * sw_d
    if ACCUMULATE:
        keep = (tl.load(KEEP) + tl.zeros((BC, BD), tl.int32)) != 0
        acc += tl.load(ptr, mask=mask & keep, other=0.0)
    tl.store(ptr, acc.to(DW.dtype.element_ty), mask=mask)


def weight_grad(a, b, gates, dw, keep, offsets, order, *, experts: int, chunks: int, k: int,
                a_by_token: bool, b_by_token: bool, scale_a: bool, accumulate: bool,
                br: int, bc: int, bd: int, warps: int, stages: int, pieces: Plan | None = None,
                piece_rows: int = PIECE_ROWS, a2=None, dw2=None):
    """dw[e] (= or +=, see the module) Σ over expert e's sorted rows of aᵀ b: a (rows, C),
    b (rows, D) (by token or sorted, as the flags say), dw (M, C, D); pieces: a plan() to
    reuse (the three weight gradients of a backward share one). a2, dw2 (a's and dw's
    shapes and strides): dw2 from a2ᵀ b in the same launches, b's rows loaded once (the
    gate and up projections' gradients, both against x)."""
    M, C, D = experts, dw.shape[1], dw.shape[2]
    two = a2 is not None
    if two and (a2.shape != a.shape or a2.stride() != a.stride() or dw2.shape != dw.shape
                or dw2.stride() != dw.stride()):
        raise ValueError("a2 and dw2 must share a's and dw's shapes and strides")
    total = order.shape[0]
    owner, first, count, slot, bound, slots, rows = pieces or plan(offsets, M, chunks,
                                                                   piece_rows, total)
    scratch = torch.empty(slots, C, D, device=dw.device, dtype=torch.float32)
    scratch2 = torch.empty_like(scratch) if two else scratch
    flag = keep if accumulate else count            # unread without ACCUMULATE
    tiles = (triton.cdiv(C, bc), triton.cdiv(D, bd))
    _piece_kernel[(bound, *tiles)](
        a, a2 if two else a, b, gates, dw, dw2 if two else dw, flag, offsets, order, owner,
        first, count, slot, scratch, scratch2, chunks, M, C, D, k, rows, a.stride(0),
        b.stride(0), *dw.stride(), A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token,
        SCALE_A=scale_a, ACCUMULATE=accumulate, TWO=two, BR=br, BC=bc, BD=bd,
        PREC=matmul_precision(a.dtype), num_warps=warps, num_stages=stages)
    add_pieces(dw, flag, count, slot, scratch, rows, accumulate=accumulate, bc=bc, bd=bd,
               dw2=dw2 if two else None, scratch2=scratch2)


def add_pieces(dw, keep, count, slot, scratch, piece_rows: int, *, accumulate: bool, bc: int,
               bd: int, dw2=None, scratch2=None) -> None:
    """Each expert of several pieces (count[e] > piece_rows): its scratch slots (S, C, D)
    from slot[e] on added in piece order into dw[e] (M, C, D), stored or (accumulate, see
    the module) added; experts of one piece are left as their piece kernel wrote them.
    dw2, scratch2: a second gradient of dw's shape and strides, in the same launch."""
    M, C, D = dw.shape
    two = dw2 is not None
    _reduce_kernel[(M, triton.cdiv(C, bc), triton.cdiv(D, bd))](
        dw, dw2 if two else dw, keep, count, slot, scratch, scratch2 if two else scratch, M,
        C, D, piece_rows, *dw.stride(), ACCUMULATE=accumulate, TWO=two, BC=bc, BD=bd,
        num_warps=4)
