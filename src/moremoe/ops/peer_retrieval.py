"""PEER's product-key retrieval op: for each (token, head) query q = (q_a, q_b), the top κ of
the R² sums q_a · A[a] + q_b · B[b] over the two sub-key tables A, B (R × d_q/2 each), the
(N, H, M) scores never formed.

``peer_retrieval(q, keys, kappa, impl=...)`` runs the fused Triton kernel
(kernels/peer_retrieval.py; custom op moremoe::peer_retrieval with a fake tensor for
torch.compile and autograd for q and keys; outside torch.compile its body runs directly,
ops/eager.py) or the plain-torch path ``peer_retrieval_ref``, the oracle the kernel is
tested against. impl="auto" takes the kernel on CUDA for what it covers (R <=
PEER_MAX_KEYS), the torch path elsewhere.

Both paths select without autograd and return the winners' scores with it, so the backward
is d q_a = Σ_w ds_w A[a_w], d A = Σ ds_w q_a over the winners (the same for b): as a dense
(NH, R) scatter of ds and two matmuls a table, a chunk of rows at a time.

Legend: N tokens, H heads, d_q query size (D = d_q / 2), R keys a table (√M), κ top per head.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .dispatch import needs_grad, resolve_impl
from .eager import call, call_autograd

CHUNK_BYTES = 1 << 30       # the dense (rows, R) fp32 gradient of the scores at a time


@functools.lru_cache(maxsize=None)
def _grid_candidates(kappa: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(i, j) (C,) int64 of the κ × κ grid with (i+1)(j+1) <= κ, C = Σ_i ⌊κ/(i+1)⌋: built
    on the host and moved once per device (a copy, a host sync, on the first call only)."""
    ij = [(i, j) for i in range(kappa) for j in range(kappa // (i + 1))]
    return tuple(torch.tensor(t, dtype=torch.int64).to(device) for t in zip(*ij))


def peer_retrieval_ref(q_NHD: Tensor, keys_2RD: Tensor, kappa: int) -> tuple[Tensor, Tensor]:
    """(scores (N, H, κ) descending in q's dtype, ids (N, H, κ) int64): the two (N, H, R)
    score tables, the top κ of each axis, then the top κ of the ≈ κ ln κ grid sums that can
    rank (_grid_candidates: the axes being sorted, a cell (i, j) with (i+1)(j+1) > κ has κ
    cells at least as large). The winners' scores are gathered again from the tables with
    autograd, so the backward is two small scatters."""
    half = q_NHD.shape[-1] // 2
    R = keys_2RD.shape[1]
    s_a = q_NHD[..., :half] @ keys_2RD[0].T                 # (N, H, R)
    s_b = q_NHD[..., half:] @ keys_2RD[1].T
    with torch.no_grad():
        v_a, i_a = s_a.topk(kappa, dim=-1)                  # sorted, descending
        v_b, i_b = s_b.topk(kappa, dim=-1)
        # traced, the lists become constants of the graph (the cache is the host's)
        grid = _grid_candidates.__wrapped__ if torch.compiler.is_compiling() else _grid_candidates
        ci, cj = grid(kappa, q_NHD.device)
        pos = (v_a[..., ci] + v_b[..., cj]).topk(kappa, dim=-1).indices   # of (N, H, C)
        a, b = i_a.gather(-1, ci[pos]), i_b.gather(-1, cj[pos])
    return s_a.gather(-1, a) + s_b.gather(-1, b), a * R + b


def _kernels():
    from ..kernels import peer_retrieval
    return peer_retrieval


def _fwd(q: Tensor, keys: Tensor, kappa: int) -> tuple[Tensor, Tensor]:
    return _kernels().retrieve(q, keys, kappa)


fwd_op = torch.library.custom_op("moremoe::peer_retrieval", _fwd, mutates_args=())


@fwd_op.register_fake
def _(q, keys, kappa):
    return (q.new_empty((q.shape[0], kappa), dtype=torch.float32),
            q.new_empty((q.shape[0], kappa), dtype=torch.int64))


def _setup(ctx, inputs, output):
    q, keys, _ = inputs
    ctx.save_for_backward(q, keys, output[1])


def _backward(ctx, dscores, _dids):
    q, keys, ids = ctx.saved_tensors
    if dscores is None:                     # eager, the scores unused
        return torch.zeros_like(q), torch.zeros_like(keys), None
    R, D = keys.shape[1], keys.shape[2]
    rows = max(1, CHUNK_BYTES // (4 * R))
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dkeys = torch.zeros(keys.shape, device=q.device, dtype=torch.float32)
    table = keys.float()
    for t, cols in enumerate((ids // R, ids % R)):
        for i in range(0, q.shape[0], rows):
            ds = torch.zeros(min(rows, q.shape[0] - i), R, device=q.device)
            ds.scatter_add_(1, cols[i:i + rows], dscores[i:i + rows].float())
            dq[i:i + rows, t * D:(t + 1) * D] = ds @ table[t]
            dkeys[t] += ds.T @ q[i:i + rows, t * D:(t + 1) * D].float()
    return dq.to(q.dtype), dkeys.to(keys.dtype), None


fwd_op.register_autograd(_backward, setup_context=_setup)


def retrieval_impl(impl: str, q: Tensor, keys: Tensor) -> str:
    """"triton" or "reference" for this call: resolve_impl's choice, and the torch path for
    "auto" where a table is larger than the kernel holds (impl="triton" there raises)."""
    from ..kernels import peer_retrieval
    chosen = resolve_impl(impl, q)
    if chosen == "triton" and (keys.shape[1] > peer_retrieval.PEER_MAX_KEYS
                               or keys.shape[2] > 64):
        if impl == "triton":
            raise ValueError(f"impl='triton': the PEER retrieval kernel holds R <= "
                             f"{peer_retrieval.PEER_MAX_KEYS} keys a table and d_q <= 128, "
                             f"got R={keys.shape[1]}, d_q={2 * keys.shape[2]}; use "
                             f"impl='auto' or 'reference'")
        return "reference"
    return chosen


def peer_retrieval(q_NHD: Tensor, keys_2RD: Tensor, kappa: int, *,
                   impl: str = "auto") -> tuple[Tensor, Tensor]:
    """(scores (N, H, κ), ids (N, H, κ) int64 in [0, R²)): fp32 scores on the fused path, q's
    dtype on the torch path. keys must have q's dtype (a layer casts its parameter)."""
    if q_NHD.ndim != 3 or keys_2RD.ndim != 3 or q_NHD.shape[-1] != 2 * keys_2RD.shape[2]:
        raise ValueError(f"q must be (N, H, d_q) and keys (2, R, d_q/2), got "
                         f"{tuple(q_NHD.shape)} and {tuple(keys_2RD.shape)}")
    if not 1 <= kappa <= keys_2RD.shape[1]:
        raise ValueError(f"kappa must be in [1, R={keys_2RD.shape[1]}], got {kappa}")
    if retrieval_impl(impl, q_NHD, keys_2RD) == "reference":
        return peer_retrieval_ref(q_NHD, keys_2RD, kappa)
    N, H, _ = q_NHD.shape
    args = (q_NHD.reshape(N * H, -1), keys_2RD.to(q_NHD.dtype), kappa)
    if needs_grad(q_NHD, keys_2RD):
        scores, ids = call_autograd(fwd_op, _fwd, _setup, _backward, *args)
    else:
        scores, ids = call(fwd_op, _fwd, *args)
    return scores.view(N, H, kappa), ids.view(N, H, kappa)
