"""The exact merge of the sharded router's local top-k lists (ops/router_shard.merge_topk):
each of E ranks kept the k_e best of its experts; every row's global top-k is among the
E k_e candidates.

  _merge_kernel (N/BN)  val (E, N, k_e) fp32, idx (E, N, k_e) int32 global ids
                        -> val (N, k) fp32, idx (N, k) int32

The selection is _common.write_sorted's, the routers' own: finite values descending, ties
and the non-finite fillers by the lower index (reference.select_topk of the whole row).
One read of the candidates and one write of the k winners: no (N, E k_e) sort in HBM.
E k_e (CP, padded to a power of two) and k are compile-time sizes.
Legend: N tokens, E ranks, k_e a shard's top-k, k the layer's, BN rows a program.
"""
import torch
import triton
import triton.language as tl

from ._common import next_pow2, write_sorted

BN = 32     # rows a program: E k_e candidates and the k-slot buffers stay in registers


@triton.jit
def _merge_kernel(VAL, IDX, OUT_VAL, OUT_IDX, N, KE: tl.constexpr, C: tl.constexpr,
                  CP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN).to(tl.int64)
    row_ok = rows < N
    cc = tl.arange(0, CP)
    shard = (cc // KE).to(tl.int64)
    offs = shard[None, :] * N * KE + rows[:, None] * KE + (cc % KE)[None, :]
    ok = row_ok[:, None] & (cc < C)[None, :]
    vals = tl.load(VAL + offs, mask=ok, other=float("nan"))
    ids = tl.load(IDX + offs, mask=ok, other=-1)
    write_sorted(vals, ids, rows, row_ok, OUT_VAL, OUT_IDX, OUT_VAL, K, K, KP, GATES=False)


def merge(val_ENK: torch.Tensor, idx_ENK: torch.Tensor, k: int):
    """(val (N, k) fp32, idx (N, k) int32) of the E local lists."""
    E, N, ke = val_ENK.shape
    val = torch.empty(N, k, device=val_ENK.device, dtype=torch.float32)
    idx = torch.empty(N, k, device=val_ENK.device, dtype=torch.int32)
    if N:
        _merge_kernel[(triton.cdiv(N, BN),)](
            val_ENK.float().contiguous(), idx_ENK.to(torch.int32).contiguous(), val, idx, N,
            KE=ke, C=E * ke, CP=next_pow2(E * ke), K=k, KP=next_pow2(k), BN=BN)
    return val, idx
