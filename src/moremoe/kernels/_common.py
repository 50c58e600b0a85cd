"""Triton helpers the kernel files share: the launch modes of the routers, the row loader,
the logit tile of both routers, and the block and split choices. Kernel files import these,
never each other's private functions.

Legend: N tokens, h hidden (H in kernels), M experts, r rank (R), k active, BN / BM / BR / BH
block sizes along N, M, r and h.
"""
import torch
import triton
import triton.language as tl

LOWRANK, ZGIVEN, LINEAR = 0, 1, 2   # router launch modes (Python side)
MODE_LOWRANK = tl.constexpr(LOWRANK)  # x, R1, R2: z = x R2ᵀ computed on chip, never stored
MODE_Z = tl.constexpr(ZGIVEN)         # z given (training: x R2ᵀ from cuBLAS, kept for backward)
MODE_LINEAR = tl.constexpr(LINEAR)    # x, W: the standard router; "z" = x, R1 = W, r = h

NEG_INF = tl.constexpr(float("-inf"))
BIG_IDX = tl.constexpr(2 ** 30)       # "no expert": larger than any expert index


@triton.jit
def load_rows(PTR, rows64, row_ok, stride_n, cols, col_ok, stride_c):
    """(rows, cols) of a 2-D tensor, zero where a row or a column is masked."""
    return tl.load(PTR + rows64[:, None] * stride_n + cols[None, :] * stride_c,
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE: tl.constexpr, BN: tl.constexpr,
           BR: tl.constexpr):
    """The block's rows of a given z (N, r); zeros for the standard router, which has none."""
    if MODE == MODE_LINEAR:
        return tl.zeros((BN, BR), dtype=X.dtype.element_ty)
    rr = tl.arange(0, BR)
    return load_rows(X, rows64, row_ok, sx_n, rr, rr < R, sx_h)


@triton.jit
def logit_tile(z, X, W, rows64, row_ok, cols, col_ok, H, R, sx_n, sx_h, sw_m, sw_k,
               MODE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
               BH: tl.constexpr, PREC: tl.constexpr, FULL_R: tl.constexpr = False):
    """fp32 logits (BN, BM) of the rows against experts cols: z R1ᵀ, or x Wᵀ summed over h
    chunks for the standard router (W in R1's place)."""
    cols64 = cols.to(tl.int64)
    if MODE == MODE_LINEAR:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            x = load_rows(X, rows64, row_ok, sx_n, hh, hh < H, sx_h)
            w = load_rows(W, cols64, col_ok, sw_m, hh, hh < H, sw_k)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        return acc
    else:
        rr = tl.arange(0, BR)
        w = load_rows(W, cols64, col_ok, sw_m, rr, (rr < R) | FULL_R, sw_k)
        return tl.dot(z, tl.trans(w), input_precision=PREC)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype) -> str:
    """fp32 inputs get exact fp32 products (the reference's selection); others the MMA's own."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fill_splits(device, programs: int, length: int, block: int) -> int:
    """How many ways to split a dimension of `length` (in blocks of `block`) so that
    `programs` × splits fills the GPU twice over; 1 on the CPU or when `programs` already
    does. Each split keeps at least 4 blocks of work."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, max(programs, 1)), triton.cdiv(length, 4 * block)))
