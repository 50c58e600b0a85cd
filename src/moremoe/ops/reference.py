"""Plain-PyTorch references for every op: the routers (the oracle of the documented selection
semantics) and the experts; the balancing loss is ops/balance.py.

These are the ground truth the fused kernels are tested against, and the path the modules
take on CPU or without Triton. The routers follow the routing contract (docs/design.md):
logits accumulated in float32 from the inputs' values (z = x R2ᵀ rounded to the input
dtype), an exact top-k on them. The experts take ``upcast``: compute in float32 (float64
stays float64) instead of the input dtype, and return the result in that dtype. They favour
being obviously right, yet the selection costs about one torch.topk of the same logits
(a test holds the ratio): it is every CPU user's router.

Legend: N tokens, h hidden, M experts, k active, r rank, s expert width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..runtime import in_graph
from . import route_exact as exact
from .dispatch import needs_grad

CHUNK_BYTES = 1 << 28      # the gathered expert weights at a time on the traceable path


def upcast_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    if not upcast:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def router_logits_linear(x_NH: torch.Tensor, W_MH: torch.Tensor) -> torch.Tensor:
    """Standard-router logits x Wᵀ, (N, M), by the routing contract (docs/design.md,
    "Routing contract"): the products of the inputs' values accumulated in float32 (float64
    for float64 inputs), whatever the input dtype."""
    dt = _acc_dtype(x_NH.dtype)
    return F.linear(x_NH.to(dt), W_MH.to(dt))


def router_logits_lowrank(x_NH: torch.Tensor, R1_MR: torch.Tensor,
                          R2_RH: torch.Tensor) -> torch.Tensor:
    """Low-rank logits z R1ᵀ, (N, M), by the routing contract: z = x R2ᵀ rounded to the
    input dtype as the exact products round (the router's z is what a linear layer of that
    dtype gives, on every path; route_exact.round_z), then z R1ᵀ accumulated in float32
    (float64 for float64)."""
    dt = _acc_dtype(x_NH.dtype)
    return F.linear(lowrank_z(x_NH, R2_RH).to(dt), R1_MR.to(dt))


def lowrank_z(x_NH: torch.Tensor, R2_RH: torch.Tensor) -> torch.Tensor:
    """z = x R2ᵀ in x's dtype (bf16, fp16 or fp32), rounded once from the fp64 product, as
    the exact products round (eagerly; under torch.compile or a capture, as the fp32 sums
    round; fp64 stays its own sum); its gradient is the fp32 product's (rounding passes
    gradients through unchanged)."""
    dt = _acc_dtype(x_NH.dtype)
    if x_NH.dtype == torch.float64 or in_graph():
        return F.linear(x_NH.to(dt), R2_RH.to(dt)).to(x_NH.dtype)
    zr_NR = exact.round_z(x_NH, R2_RH)
    if not needs_grad(x_NH, R2_RH):
        return zr_NR
    z_NR = F.linear(x_NH.to(dt), R2_RH.to(dt)).to(x_NH.dtype)     # the gradient's path
    return z_NR + (zr_NR - z_NR.detach())


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def select_topk(logits_NM: torch.Tensor, k: int, *, settle=None):
    """The k largest finite logits per row, ties to the lower index (docs/design.md,
    "Selection semantics"): values (N, k) and int32 indices (N, k). NaN and ±inf logits are
    never selected; a row with fewer than k finite logits fills its remaining slots with the
    lowest expert indices not chosen. Values are the logits of the returned indices, the
    finite ones descending, then the others, ties by the lower index. Exact and deterministic.

    One torch.topk of k + 1 per row does the work, and it settles every row whose k + 1
    largest keys are distinct. Only the others are redone: rows holding NaN or +inf (which
    torch.topk ranks first) on sanitised keys, then rows with a tie among their k + 1 largest
    keys (torch.topk orders ties in no promised way) from their candidates. Under
    torch.compile or a CUDA-graph capture the selection is one traceable pass instead (no
    data-dependent shapes, no host sync).

    settle: () -> (bound, rows -> fp64 logits): the logits are fp32 sums within bound
    of the exact ones; rows whose selection that bound leaves open are decided again on
    their fp64 logits (route_exact.settle_rows)."""
    if in_graph():
        return _select_topk_traceable(logits_NM, k)
    keys_NM = logits_NM.detach()
    k1 = min(k + 1, keys_NM.shape[1])
    key_NK, idx_NK = torch.topk(keys_NM, k1, dim=-1)
    unsafe_N = ~(key_NK[:, 0] < float("inf"))                   # the row holds NaN or +inf
    if unsafe_N.any():
        rows = unsafe_N.nonzero()[:, 0]
        key_NK[rows], idx_NK[rows] = torch.topk(_finite_or_neg_inf(keys_NM[rows]), k1, dim=-1)
    if k1 > k:                         # the k-th key ties one outside: take the lowest ids
        tied_N = key_NK[:, k - 1] == key_NK[:, k]
        if tied_N.any():
            rows = tied_N.nonzero()[:, 0]
            idx_NK[rows, :k] = _lowest_tied(keys_NM.index_select(0, rows), key_NK[rows], k,
                                            idx_NK[rows, :k])
    near = None
    if settle is not None and keys_NM.shape[0]:
        near = (key_NK, *settle())
    key_NK, idx_NK = key_NK[:, :k], idx_NK[:, :k]
    tied_N = (key_NK[:, 1:] == key_NK[:, :-1]).any(-1)   # ties inside: lower id first
    if tied_N.any():
        rows = tied_N.nonzero()[:, 0]
        idx_RK, by_id = torch.sort(idx_NK[rows], dim=-1)
        by_key = torch.sort(key_NK[rows].gather(1, by_id), dim=-1, descending=True,
                            stable=True).indices
        idx_NK[rows] = idx_RK.gather(1, by_key)
    if near is not None:
        key_NK1, bound, exact_rows = near
        idx_NK, fix_NK = exact.settle_rows(logits_NM, idx_NK, key_NK1, k, bound, exact_rows)
        if fix_NK is not None:
            return logits_NM.gather(1, idx_NK) + fix_NK, idx_NK.to(torch.int32)
    return logits_NM.gather(1, idx_NK), idx_NK.to(torch.int32)


def _lowest_tied(keys_RM, key_RK, k: int, idx_RK):
    """The top-k ids of rows whose k-th largest key key_RK[:, k-1] ties the (k+1)-th:
    torch.topk's ids of the keys above it, then the tied columns lowest first. A k-th key of
    -inf ties every non-finite logit of the row (the fillers)."""
    kth_R1 = key_RK[:, k - 1:k]
    tied_RM = keys_RM == kth_R1
    short_R = kth_R1[:, 0] == float("-inf")                      # fewer than k finite logits
    if short_R.any():
        tied_RM[short_R] = ~torch.isfinite(keys_RM[short_R])
    above_R = (key_RK[:, :k] > kth_R1).sum(-1)
    row_C, col_C = tied_RM.nonzero(as_tuple=True)                 # ids ascending in each row
    counts_R = torch.bincount(row_C, minlength=keys_RM.shape[0])
    first_R = counts_R.cumsum(0) - counts_R
    slot_C = torch.arange(row_C.numel(), device=row_C.device) - first_R[row_C] + above_R[row_C]
    keep = slot_C < k
    idx_RK = idx_RK.clone()
    idx_RK[row_C[keep], slot_C[keep]] = col_C[keep]
    return idx_RK


def _select_topk_traceable(logits_NM: torch.Tensor, k: int):
    """select_topk without data-dependent shapes or branches, for torch.compile: the k-th
    largest key per row, every key above it, then the tied ones by a cumulative count."""
    N, M = logits_NM.shape
    keys_NM = _finite_or_neg_inf(logits_NM.detach())
    kth_N1 = torch.topk(keys_NM, k, dim=-1).values[:, -1:]
    above_NM = keys_NM > kth_N1
    tied_NM = keys_NM == kth_N1                                   # filled lowest index first
    need_N1 = k - above_NM.sum(-1, keepdim=True)
    take_NM = above_NM | (tied_NM & (tied_NM.cumsum(-1) <= need_N1))
    descending_M = torch.arange(M, 0, -1, device=logits_NM.device)
    idx_NK = torch.topk(take_NM * descending_M, k, dim=-1).indices   # ascending index order
    val_NK = logits_NM.gather(1, idx_NK)
    order_NK = torch.sort(_finite_or_neg_inf(val_NK.detach()), dim=-1, descending=True,
                          stable=True).indices
    return val_NK.gather(1, order_NK), idx_NK.gather(1, order_NK).to(torch.int32)


def topk_gates(topk_val_NK: torch.Tensor) -> torch.Tensor:
    """Softmax over the finite top-k values: 0 for the fillers of a row with fewer than k
    finite logits, NaN for a row with none (its token has no defined routing)."""
    return torch.softmax(_finite_or_neg_inf(topk_val_NK), dim=-1)


def softmax_colsum(logits_NM: torch.Tensor) -> torch.Tensor:
    """psum (M,): column sums over tokens of the softmax over the finite logits of each row
    (a non-finite logit has probability 0; a row with no finite logit adds nothing), in fp32
    (fp64 for fp64 logits). One softmax of the logits as they are when that leaves no row NaN
    (no NaN or +inf logit, some finite one in every row: a healthy router), else the
    sanitised formula."""
    dt = torch.float64 if logits_NM.dtype == torch.float64 else torch.float32
    if not in_graph():
        probs_NM = torch.softmax(logits_NM, dim=-1, dtype=dt)
        if not probs_NM[:, 0].isnan().any():            # a spoilt row is NaN throughout
            return probs_NM.sum(dim=0)
    probs_NM = torch.softmax(_finite_or_neg_inf(logits_NM), dim=-1, dtype=dt)
    return torch.where(probs_NM.isnan(), 0.0, probs_NM).sum(dim=0)


def _finite_or_neg_inf(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, float("-inf"))


def router_linear_ref(x_NH, W_MH, k: int, *, with_psum: bool = False):
    """Standard router: (topk_val (N,k) fp32, topk_idx (N,k) int32, psum (M,) or None)."""
    dt = _acc_dtype(x_NH.dtype)
    W_dt = W_MH.to(dt)
    w_max = _row_norm_max(W_MH)

    def logits(rows):
        return F.linear(x_NH[rows].to(dt), W_dt)

    def settle(rows):      # the fp32 logits' error bound, and the rows' fp64 logits
        x = x_NH[rows]
        return exact.settle_fp64(x, W_MH, lambda r: x[r].detach().double(), w_max=w_max)
    return _route(logits, x_NH, W_MH.shape[0], k, with_psum, settle,
                  whole=needs_grad(x_NH, W_MH))


def router_lowrank_ref(x_NH, R1_MR, R2_RH, k: int, *, with_psum: bool = False):
    """Low-rank router: (topk_val (N,k) fp32, topk_idx (N,k) int32, psum (M,) or None)."""
    z_NR = lowrank_z(x_NH, R2_RH)
    dt = _acc_dtype(x_NH.dtype)
    R1_dt = R1_MR.to(dt)
    w_max = _row_norm_max(R1_MR)

    def logits(rows):
        return F.linear(z_NR[rows].to(dt), R1_dt)

    def settle(rows):                           # z rounded once to x's dtype: exact
        z = z_NR[rows]
        return exact.settle_fp64(z, R1_MR, lambda r: z[r].detach().double(), w_max=w_max)
    return _route(logits, x_NH, R1_MR.shape[0], k, with_psum, settle,
                  whole=needs_grad(x_NH, R1_MR, R2_RH))


def _row_norm_max(w_MR: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return w_MR.detach().float().norm(dim=1).max() if w_MR.numel() else w_MR.new_zeros(())


BLOCK_BYTES = 1 << 23       # eager inference: the fp32 logits of a block of rows at a time


def in_blocks(device: torch.device) -> bool:
    """Whether eager inference selects a block of rows at a time: on a CPU, where a block's
    logits stay in cache; not on a GPU, where each block is a few launches (1,024 blocks at
    N = 262,144, M = 8,192) and the whole batch's logits are one pass over HBM."""
    return device.type == "cpu"


def _route(logits_of, x_NH, M: int, k: int, with_psum: bool, settle_of, *, whole: bool):
    """The exact selection on the float32 (float64) logits, the rows fp32 cannot decide
    decided again on fp64 ones (eagerly; settle_of(rows) gives those rows' bound and fp64
    logits); psum's softmax in the logits' dtype. logits_of(rows): the logits of a slice of
    rows. Eager inference on a CPU (no autograd, no psum, fp32 sums) takes the rows a block
    at a time (BLOCK_BYTES of logits), each selected while it is in cache, which costs less
    than one (N, M) tensor written and read back; each row's selection is its own, so the
    blocks route as the whole batch does."""
    N = x_NH.shape[0]
    fp64 = x_NH.dtype == torch.float64
    if whole or with_psum or fp64 or in_graph() or N == 0 or not in_blocks(x_NH.device):
        logits_NM = logits_of(slice(None))
        decide = None if fp64 or in_graph() else (lambda: settle_of(slice(None)))
        topk_val_NK, topk_idx_NK = select_topk(logits_NM, k, settle=decide)
        psum_M = softmax_colsum(logits_NM) if with_psum else None
        return topk_val_NK, topk_idx_NK, psum_M
    rows = max(1, BLOCK_BYTES // (4 * max(M, 1)))
    vals, idxs = [], []
    for start in range(0, N, rows):
        block = slice(start, min(start + rows, N))
        val, idx = select_topk(logits_of(block), k, settle=lambda b=block: settle_of(b))
        vals.append(val)
        idxs.append(idx)
    return torch.cat(vals), torch.cat(idxs), None


def swiglu_experts_ref(x_NH, gates_NK, topk_idx_NK, w_gate_MSH, w_up_MSH, w_down_MHS, *,
                       upcast: bool = False, first_expert: int | None = None):
    """y (N, h) = Σ_j gates[:, j] · f_{idx[:, j]}(x), f_e(x) = W_down,e (silu(W_gate,e x) ⊙ W_up,e x).

    Sorts the (token, slot) pairs by expert and runs each expert present on its rows; the
    gated outputs are summed in float32 (float64 when upcast from float64) and returned in
    the compute dtype. Under torch.compile or a CUDA-graph capture, without gradients (a
    decode step), each pair multiplies its expert's gathered weights instead: the sort's
    per-expert split has shapes that depend on the ids. first_expert: the weights are
    experts [first_expert, first_expert + M) of a larger layer, and the slots of other ids
    are left out (other shards' work).
    """
    N, k = topk_idx_NK.shape
    M = w_gate_MSH.shape[0]
    dt = upcast_dtype(x_NH.dtype, upcast)
    acc_dt = torch.float64 if dt == torch.float64 else torch.float32
    weights = (x_NH, gates_NK, w_gate_MSH, w_up_MSH, w_down_MHS)
    if first_expert is None and in_graph() and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in weights)):
        return _swiglu_experts_gathered(x_NH, gates_NK, topk_idx_NK, w_gate_MSH, w_up_MSH,
                                        w_down_MHS, dt, acc_dt)
    flat_idx = topk_idx_NK.reshape(-1).long() - (first_expert or 0)
    pairs = torch.arange(flat_idx.numel(), device=flat_idx.device)
    if first_expert is not None:
        pairs = ((flat_idx >= 0) & (flat_idx < M)).nonzero().squeeze(1)
        flat_idx = flat_idx.index_select(0, pairs)
    order = pairs.index_select(0, torch.argsort(flat_idx, stable=True))
    token = order // k
    counts = torch.bincount(flat_idx, minlength=M).tolist()
    x_sorted = x_NH.to(dt).index_select(0, token)   # backward: index_add, not index_put
    gate_sorted = gates_NK.reshape(-1).index_select(0, order).to(acc_dt)
    # split / unbind once: slicing x or indexing w[e] per expert would make the backward
    # add one full-size zero-filled gradient per expert, O(M N k h) work.
    w_gates, w_ups, w_downs = (w.to(dt).unbind(0) for w in (w_gate_MSH, w_up_MSH, w_down_MHS))
    outs = []
    for e, xe in enumerate(x_sorted.split(counts)):
        if xe.shape[0] == 0:
            continue
        act = F.silu(F.linear(xe, w_gates[e])) * F.linear(xe, w_ups[e])
        outs.append(F.linear(act, w_downs[e]))
    y_NH = torch.zeros(N, x_NH.shape[1], dtype=acc_dt, device=x_NH.device)
    if outs:
        y_NH = y_NH.index_add(0, token, torch.cat(outs).to(acc_dt) * gate_sorted[:, None])
    return y_NH.to(dt)


def _swiglu_experts_gathered(x_NH, gates_NK, topk_idx_NK, w_gate_MSH, w_up_MSH, w_down_MHS,
                             dt, acc_dt):
    """swiglu_experts_ref with no shape that depends on the ids: pair n k + j multiplies the
    weights of expert topk_idx[n, j], gathered (p, s, h) for a chunk of p pairs at a time
    (CHUNK_BYTES), and the k gated rows of a token are summed in slot order."""
    N, k = topk_idx_NK.shape
    M, s, h = w_gate_MSH.shape
    flat_P = topk_idx_NK.reshape(-1).long()
    x_PH1 = x_NH.to(dt).repeat_interleave(k, dim=0)[:, :, None]
    rows = max(1, CHUNK_BYTES // (3 * s * h * torch.finfo(dt).bits // 8))
    outs = [x_PH1.new_zeros(0, h)]
    for i in range(0, N * k, rows):
        e, xp = flat_P[i:i + rows], x_PH1[i:i + rows]
        act = (F.silu(torch.bmm(w_gate_MSH[e].to(dt), xp))
               * torch.bmm(w_up_MSH[e].to(dt), xp))                      # (p, s, 1)
        outs.append(torch.bmm(w_down_MHS[e].to(dt), act)[..., 0])        # (p, h)
    y_PH = torch.cat(outs).to(acc_dt) * gates_NK.reshape(-1, 1).to(acc_dt)
    return y_PH.view(N, k, h).sum(1).to(dt)


def sum_rows_ref(rows_RH, pos_NE, kept_SH=None):
    """y (N, h) in rows' dtype: y[n] = Σ_j src[pos[n, j]] over pos[n, j] >= 0, src the rows
    followed by the kept rows, summed in float32 (float64 stays float64) in the order of j."""
    if kept_SH is not None:
        rows_RH = torch.cat([rows_RH, kept_SH])
    acc_dt = torch.float64 if rows_RH.dtype == torch.float64 else torch.float32
    y_NH = torch.zeros(pos_NE.shape[0], rows_RH.shape[1], dtype=acc_dt, device=rows_RH.device)
    for p_N in pos_NE.unbind(1):              # one row per token at most: no index collides
        hit = (p_N >= 0).nonzero().squeeze(1)
        y_NH = y_NH.index_add(0, hit, rows_RH.index_select(0, p_N[hit]).to(acc_dt))
    return y_NH.to(rows_RH.dtype)
