"""The paper's Algorithm 1 (fused low-rank router + top-k, inference), written as the paper
states it, as a baseline row of ``moremoe bench router``; the library never routes with it.

Per block of BN tokens: z = x R2ᵀ accumulated in fp32 over h chunks and narrowed to x's
dtype; then one sweep over expert tiles of BM, each tile's logits y = z R1ᵀ merged into a
running top-k by k rounds of (max, argmax) over the tile, (min, argmin) over the running
values, a replacement when the tile's max is larger, and masking the taken column. Writes
the k values sorted, their indices and the softmax over them (the outputs every router
returns; they were three torch ops after the kernel). Block sizes and pipeline depth: the
best of eight configurations (four block shapes at 2 and 3 stages), chosen by Triton's
autotuner per (M, h, r, k) on the GPU, so the baseline is the best version of itself.

Reads x (N, h), R1 (M, r), R2 (r, h); writes val (N, k) fp32, idx (N, k) int32, gates
(N, k) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import INTERPRET
from ..kernels._common import write_sorted


@triton.jit
def _alg1_kernel(X, R1, R2, OUT_VAL, OUT_IDX, OUT_GATE, N, H, M, R,
                 K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    rr = tl.arange(0, BR)
    z = tl.zeros((BN, BR), tl.float32)                      # phase 1: z in SRAM
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        x = tl.load(X + rows64[:, None] * H + hh[None, :],
                    mask=row_ok[:, None] & (hh < H)[None, :], other=0.0)
        w = tl.load(R2 + rr[:, None] * H + hh[None, :],
                    mask=(rr < R)[:, None] & (hh < H)[None, :], other=0.0)
        z = tl.dot(x, tl.trans(w), z)
    z = z.to(X.dtype.element_ty)                            # narrow z for the MMA
    slots = tl.arange(0, KP)
    top_v = tl.where(slots[None, :] < K, float("-inf"), float("inf")) + tl.zeros(
        (BN, KP), tl.float32)                               # padded slots are never the min
    top_i = tl.zeros((BN, KP), tl.int32)
    tile = tl.arange(0, BM)
    for m0 in range(0, M, BM):                              # phase 2: one sweep over M
        cols = m0 + tile
        w1 = tl.load(R1 + cols.to(tl.int64)[:, None] * R + rr[None, :],
                     mask=(cols < M)[:, None] & (rr < R)[None, :], other=0.0)
        y = tl.dot(z, tl.trans(w1))
        y = tl.where((cols < M)[None, :], y, float("-inf"))
        for _ in tl.static_range(K):                        # k merge rounds per tile
            v_max = tl.max(y, axis=1)
            j_max = tl.argmax(y, axis=1)
            j_min = tl.argmin(top_v, axis=1)
            v_min = tl.min(top_v, axis=1)
            upd = (v_max > v_min)[:, None] & (slots[None, :] == j_min[:, None])
            top_v = tl.where(upd, v_max[:, None], top_v)
            top_i = tl.where(upd, (m0 + j_max)[:, None], top_i)
            y = tl.where(tile[None, :] == j_max[:, None], float("-inf"), y)
    # sorted, with the softmax over the k, in the kernel: the outputs every router returns
    write_sorted(top_v, tl.where(slots[None, :] < K, top_i, -1), rows64, row_ok, OUT_VAL,
                 OUT_IDX, OUT_GATE, K, K, KP)


_CONFIGS = [triton.Config({"BN": BN, "BM": BM}, num_warps=w, num_stages=st)
            for BN, BM, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8))
            for st in (2, 3)]
_tuned = None


def route(x, R1, R2, k: int):
    """(val (N, k) fp32 descending, idx (N, k) int32, gates (N, k) fp32) by Algorithm 1;
    x, R1, R2 contiguous, one dtype."""
    global _tuned
    x, R1, R2 = x.contiguous(), R1.contiguous(), R2.contiguous()
    N, H = x.shape
    M, R = R1.shape
    val = torch.empty(N, k, device=x.device, dtype=torch.float32)
    idx = torch.empty(N, k, device=x.device, dtype=torch.int32)
    gates = torch.empty(N, k, device=x.device, dtype=torch.float32)
    shape = dict(K=k, KP=triton.next_power_of_2(k), BR=max(16, triton.next_power_of_2(R)),
                 BH=64)
    if N and (INTERPRET or x.device.type != "cuda"):
        _alg1_kernel[(triton.cdiv(N, 16),)](x, R1, R2, val, idx, gates, N, H, M, R, BN=16,
                                            BM=32, **shape)
    elif N:
        if _tuned is None:
            _tuned = triton.autotune(_CONFIGS, key=["M", "H", "R", "K"])(_alg1_kernel)
        _tuned[lambda meta: (triton.cdiv(N, meta["BN"]),)](x, R1, R2, val, idx, gates, N, H,
                                                           M, R, **shape)
    return val, idx, gates
