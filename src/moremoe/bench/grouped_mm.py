"""The experts written the way torchtitan writes them, as the benchmarks' baseline: sort the
(token, slot) pairs by expert, gather x, three ``torch._grouped_mm`` calls (the gate and up
projections as one, with their weights side by side), scatter the rows back to pair order
and sum each token's k rows (deterministic).

The weights are laid out once, outside the timed call, the way the grouped GEMM takes them
(``GroupedWeights``): a baseline holds its weights in its preferred layout. Group sizes are
the routed counts as they are; where the GEMM insists on aligned groups (``pad=16``) each
expert's rows are padded to a multiple of 16 with zero rows, as torchtitan does.
``torch._grouped_mm`` needs bf16 and sm90+ (CUDA); callers check ``available()``.

Legend: N tokens, k slots, P = N·k pairs, h hidden, s expert width, M experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def available(device) -> bool:
    device = torch.device(device)
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@dataclass
class GroupedWeights:
    w_gate_up: torch.Tensor      # (M, h, 2s): [W_gateᵀ | W_upᵀ]
    w_down: torch.Tensor         # (M, s, h): W_downᵀ

    @classmethod
    def of(cls, w_gate, w_up, w_down) -> "GroupedWeights":
        gu = torch.cat([w_gate, w_up], dim=1).transpose(1, 2).contiguous()
        return cls(gu, w_down.transpose(1, 2).contiguous())


def _padded(flat_P, counts_M, pad: int):
    """Destination row of each sorted pair in expert groups padded to multiples of pad, and
    the padded cumulative group ends."""
    padded = (counts_M + pad - 1) // pad * pad
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    run_starts = torch.cumsum(counts_M, 0) - counts_M
    sorted_e = flat_P.sort(stable=True).values
    q = torch.arange(flat_P.numel(), device=flat_P.device)
    return starts[sorted_e] + q - run_starts[sorted_e], ends


def grouped_mm_experts(x_NH, gates_NK, idx_NK, w: GroupedWeights, *, pad: int = 0):
    """y (N, h) = Σ_j gates[:, j] · SwiGLU_{idx[:, j]}(x) through torch._grouped_mm."""
    N, k = idx_NK.shape
    M, s = w.w_down.shape[:2]
    flat = idx_NK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=M)
    xs = x_NH[order // k]
    if pad:
        dest, ends = _padded(flat, counts, pad)
        xp = xs.new_zeros(int(ends[-1]), x_NH.shape[1])
        xp[dest] = xs
        xs, offs = xp, ends.int()
    else:
        offs = torch.cumsum(counts, 0).int()
    gu = torch._grouped_mm(xs, w.w_gate_up, offs=offs)
    act = F.silu(gu[:, :s]) * gu[:, s:]
    out = torch._grouped_mm(act, w.w_down, offs=offs)
    if pad:
        out = out[dest]
    out = out * gates_NK.reshape(-1)[order, None].to(out.dtype)
    pairs = torch.empty_like(out)
    pairs[order] = out
    return pairs.view(N, k, -1).sum(1)
