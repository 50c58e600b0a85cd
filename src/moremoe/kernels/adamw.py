"""One AdamW update of one parameter in one pass, the gradient clip folded in.

Legend: n elements of the parameter. Reads w (fp32, the master weights), g (fp32 or bf16),
the moments m, v (fp32 or bf16) and the clip coefficient c (one fp32 on the device, or
none); writes w, m, v in place. g is read once and never written (torch's fused AdamW, given
a grad_scale, writes the scaled gradient back: 4 bytes a parameter more). Per element:
    g' = c g;  m = m + (1 - β1)(g' - m);  v = β2 v + (1 - β2) g'²
    w = w (1 - lr λ) - (lr / (1 - β1^t)) m / (sqrt(v) / sqrt(1 - β2^t) + ε)
in fp32 registers, the moments rounded to their dtype (to nearest even) as they are stored.
Bytes a parameter: 4 + 4 (w) + 4 (g, fp32) + 2·2·2 (bf16 m, v) = 20, or 28 with fp32 moments.
BLOCK = 1,024 elements a program (4 warps, 8 per thread: 16-byte fp32 loads); offsets are
int64 (an expert bank of MoRE-8192 has 1.3G elements).
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _adamw_kernel(W, G, M, V, COEF, n, decay, beta1, beta2, eps, step_size, bc2_sqrt,
                  HAS_COEF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(COEF)
    m = tl.load(M + offs, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    w = tl.load(W + offs, mask=ok, other=0.0)
    w = w * decay - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(W + offs, w, mask=ok)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=ok)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=ok)


def adamw_(w, g, m, v, *, decay: float, beta1: float, beta2: float, eps: float,
           step_size: float, bc2_sqrt: float, coef=None) -> None:
    """The update of w, m, v in place (contiguous, one device; w fp32, the others fp32 or
    bf16); coef: the clip coefficient, a one-element fp32 tensor, or None."""
    ts = {"w": w, "g": g, "m": m, "v": v}
    for name, t in ts.items():
        if t.shape != w.shape or not t.is_contiguous() or t.device != w.device:
            raise ValueError(f"adamw_: {name} must be contiguous, of w's shape "
                             f"{tuple(w.shape)} and on {w.device}, got {tuple(t.shape)} on "
                             f"{t.device}")
    if w.dtype != torch.float32 or any(t.dtype not in (torch.float32, torch.bfloat16)
                                       for t in (g, m, v)):
        raise TypeError(f"adamw_: w must be float32 and g, m, v float32 or bfloat16, got "
                        f"{w.dtype}, {g.dtype}, {m.dtype}, {v.dtype}")
    n = w.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        w, g, m, v, coef if coef is not None else w, n, decay, beta1, beta2, eps, step_size,
        bc2_sqrt, HAS_COEF=coef is not None, BLOCK=BLOCK, num_warps=4)
