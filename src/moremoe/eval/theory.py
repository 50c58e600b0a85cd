"""The paper's theory, checked by sampling.

Hypercube construction (the load-balancing Proposition of the paper's appendix): with
M = 2^r experts indexed by sign vectors a ∈ {±1}^r, R1 rows u_a = a / √r, R2 = [I_r | 0]
(r × h) and tokens x ~ N(0, I_h), every expert is among a token's top-k with probability
exactly k/M, so the loads N_a ~ Binomial(n, k/M) and, with probability ≥ 1 − δ,
max_a |N_a − n k / M| ≤ √(2 n k L / M) + (2/3) L, L = log(2M / δ). `hypercube_check` routes
sampled tokens through the library's own low-rank router (ops.router_lowrank) and reports
the deviation against that bound and the normalised routing entropy H_norm.

Rank (the Johnson–Lindenstrauss upper bound and the counting lower bound of the paper's
expressivity theorems, made empirical): `rank_agreement` factors an M × h router W into
R1 (M × r) · R2 (r × h), by truncated SVD (the singular values split evenly, √S to each
side) or by a Gaussian projection Φ (R2 = Φ / √r, R1 = W R2ᵀ: the lemma's construction),
and measures on tokens the fraction whose top-k set is unchanged and the mean overlap.
`rank_bounds` gives the theorems' ranks with their universal constants set to 1:
k ln(M + C(M, k)) (sufficient) and ln C(M, k) / ln(1 + 2^(p+1)) at p bits (necessary).
Letters: n tokens (N in the CLI), h hidden, M experts, k active, r rank.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..checks import check_fits
from ..nn.router import factor_router, topk_agreement
from ..ops.balance import expert_counts
from ..ops.router_linear import router_linear
from ..ops.router_lowrank import router_lowrank
from ..report import save_figure
from .routing import normalized_entropy

# Logits are scored a chunk of tokens at a time, the chunk sized so that its (tokens, M)
# logits and the reference router's working copies of them stay near this many bytes: a
# router of 2^20 experts routes 64 tokens at a time instead of asking for 275 GB.
CHUNK_BYTES = 256 << 20
ROUTER_COPIES = 4           # logits, sanitised keys, top-k work and the softmax, at most


def _chunk(per_token: int, most: int = 65_536) -> int:
    """Tokens per chunk: as many as fit in CHUNK_BYTES at per_token bytes each."""
    return max(1, min(most, CHUNK_BYTES // max(1, per_token)))


def hypercube_router(rank: int, hidden: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(R1 (2^r, r), R2 (r, h)) of the construction; expert a's sign vector is the binary
    expansion of a (bit ℓ set ↔ a_ℓ = +1)."""
    h = rank if hidden is None else hidden
    if not 1 <= rank <= 20:
        raise ValueError(f"--rank must be in [1, 20] (M = 2^r experts), got {rank}")
    if h < rank:
        raise ValueError(f"--hidden must be >= --rank={rank}, got {h}")
    M = 1 << rank
    check_fits(M * rank * 12 + rank * h * 4 + CHUNK_BYTES,
               f"the hypercube router (--rank {rank}: M = {M:,} experts, --hidden {h:,})",
               "lower --hidden (R2 = [I_r | 0] reads only the first r coordinates)")
    bits = (torch.arange(M)[:, None] >> torch.arange(rank)[None, :]) & 1
    R1_MR = (2.0 * bits - 1.0) / math.sqrt(rank)
    R2_RH = torch.eye(rank, h)
    return R1_MR, R2_RH


def load_bound(tokens: int, top_k: int, experts: int, delta: float) -> float:
    """The Proposition's bound on max_a |N_a − n k / M| at confidence 1 − δ."""
    L = math.log(2 * experts / delta)
    return math.sqrt(2 * tokens * top_k * L / experts) + 2 * L / 3


def hypercube_check(rank: int, top_k: int, tokens: int, *, hidden: int | None = None,
                    delta: float = 0.01, seed: int = 0, chunk: int = 65_536,
                    progress=None) -> dict:
    """Sample tokens, route them, and compare the loads with k n / M and the bound."""
    R1, R2 = hypercube_router(rank, hidden)
    M = R1.shape[0]
    if not 1 <= top_k <= M:
        raise ValueError(f"--top-k must be in [1, M={M}], got {top_k}")
    if not 0 < delta < 1:
        raise ValueError(f"--delta must be in (0, 1), got {delta}")
    bound = load_bound(tokens, top_k, M, delta)
    if not math.isfinite(bound):
        raise ValueError(f"--delta {delta:g} is too small for the bound to be a number "
                         f"(log(2M/δ) overflows); give a larger --delta")
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(M, dtype=torch.int64)
    h = R2.shape[1]
    # tokens are drawn in blocks of `chunk` (the stream a seed gives) and routed in pieces
    # whose (n, M) logits stay within CHUNK_BYTES
    block, piece = _chunk(4 * h, chunk), _chunk(4 * (h + ROUTER_COPIES * M), chunk)
    for n0 in range(0, tokens, block):
        x = torch.randn(min(block, tokens - n0), h, generator=g)
        idx = torch.cat([router_lowrank(x[p0:p0 + piece], R1, R2, top_k,
                                        impl="reference")[1]
                         for p0 in range(0, x.shape[0], piece)])
        counts += expert_counts(idx, M)          # once a block: M may be 2^20
        if progress:
            progress(min(n0 + block, tokens), tokens)
    mean = tokens * top_k / M
    deviation = (counts.double() - mean).abs()
    return {"rank": rank, "experts": M, "top_k": top_k, "tokens": tokens,
            "hidden": R2.shape[1], "delta": delta, "seed": seed,
            "expected_load": mean, "max_deviation": float(deviation.max()),
            "bound": bound, "within_bound": bool(deviation.max() <= bound),
            "min_load": int(counts.min()), "max_load": int(counts.max()),
            "selection_prob_min": float(counts.min()) / tokens,
            "selection_prob_max": float(counts.max()) / tokens,
            "selection_prob_exact": top_k / M,
            "hnorm": normalized_entropy(counts), "counts": counts.tolist()}


def rank_agreement(W_MH: torch.Tensor, x_NH: torch.Tensor, top_k: int, ranks: list[int], *,
                   methods=("svd",), seed: int = 0, chunk: int = 65_536,
                   progress=None) -> list[dict]:
    """Per (method, r): the share of tokens whose top-k set under the rank-r factorisation
    equals the full router's, and the mean overlap |S ∩ S_r| / k. progress(done, total)
    is called after each (method, r)."""
    M, h = W_MH.shape
    if x_NH.dim() != 2 or x_NH.shape[1] != h:
        raise ValueError(f"tokens must have shape (N, h={h}), got {tuple(x_NH.shape)}")
    if not 1 <= top_k <= M:
        raise ValueError(f"--top-k must be in [1, M={M}], got {top_k}")
    bad = [r for r in ranks if not 1 <= r <= min(M, h)]
    if bad:
        raise ValueError(f"--ranks must be in [1, min(M, h) = {min(M, h)}], got {bad}")
    if not (bool(torch.isfinite(W_MH).all()) and bool(torch.isfinite(x_NH).all())):
        raise ValueError("the router and the tokens must be finite; they hold NaN or inf")
    # float64 throughout: the measure is of the factorisation, not of float32 rounding
    # (which would reorder near-tied logits even at full rank)
    W, x = W_MH.double(), x_NH.double()
    piece = _chunk(8 * (h + ROUTER_COPIES * M), chunk)
    full = torch.cat([router_linear(x[n0:n0 + piece], W, top_k, impl="reference")[1]
                      for n0 in range(0, x.shape[0], piece)])
    rows = []
    for method in methods:
        for r in ranks:
            R1, R2 = factor_router(W, r, method, seed, dtype=torch.float64)
            got = torch.cat([router_lowrank(x[n0:n0 + piece], R1, R2, top_k,
                                            impl="reference")[1]
                             for n0 in range(0, x.shape[0], piece)])
            same, overlap = topk_agreement(got, full)
            rows.append({"method": method, "rank": r, "set_preserved": same,
                         "mean_overlap": overlap,
                         "rel_error": float((R1 @ R2 - W).norm() / W.norm())})
            if progress:
                progress(len(rows), len(methods) * len(ranks))
    return rows


def rank_memory(experts: int, hidden: int, tokens: int, top_k: int) -> int:
    """Bytes rank_agreement needs at least (the tokens in float32 and float64, the router
    and its factors in float64, the top-k sets, a chunk of logits), so that a request that
    cannot fit is refused before anything is allocated."""
    return 12 * tokens * hidden + 32 * experts * hidden + 24 * tokens * top_k + CHUNK_BYTES


def rank_bounds(experts: int, top_k: int, bits: int = 8) -> dict:
    """The expressivity theorems' ranks with universal constants 1 (shapes, not values):
    sufficient k ln(M + C(M, k)) (Johnson–Lindenstrauss), necessary ln C(M, k) / ln(1 + 2/η)
    at the margin η = 2^-bits a p-bit top-k resolves."""
    subsets = math.comb(experts, top_k)          # exact; math.log takes any size of int
    return {"sufficient_jl": top_k * math.log(experts + subsets),
            "necessary_counting": math.log(subsets) / math.log(1 + 2 ** (bits + 1)),
            "bits": bits}


def plot_rank(rows: list[dict], bounds: dict, path: str | Path, title: str) -> Path:
    """Share of tokens whose top-k set survives, against r, with the theorems' ranks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, method in enumerate(sorted({r["method"] for r in rows})):
        pts = sorted((r["rank"], r["set_preserved"], r["mean_overlap"]) for r in rows
                     if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                label=f"{method}: top-k set preserved")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", color=f"C{i}",
                label=f"{method}: mean overlap")
    ax.axvline(bounds["sufficient_jl"], color="C3", linestyle=":",
               label=f"k ln(M + C(M,k)) = {bounds['sufficient_jl']:.0f} (sufficient, constant 1)")
    ax.axvline(bounds["necessary_counting"], color="gray", linestyle=":",
               label=f"ln C(M,k) / ln(1 + 2^{bounds['bits'] + 1}) = "
                     f"{bounds['necessary_counting']:.1f} (necessary)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("router rank r")
    ax.set_ylabel("share of tokens")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_hypercube(result: dict, path: str | Path) -> Path:
    """Each expert's deviation N_a − k n / M against the Proposition's ±bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mean, bound = result["expected_load"], result["bound"]
    dev = [c - mean for c in result["counts"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(dev)), dev, width=1.0, color="C0", label="N_a − k n / M")
    for sign in (1, -1):
        ax.axhline(sign * bound, color="C3", linestyle="--",
                   label=f"±bound {bound:.0f} (δ = {result['delta']:g})" if sign > 0 else None)
    ax.set_xlabel("expert a")
    ax.set_ylabel("tokens above the expected load")
    ax.set_title(f"hypercube router r={result['rank']}, M={result['experts']}, "
                 f"k={result['top_k']}, n={result['tokens']:,}: max |deviation| "
                 f"{result['max_deviation']:.0f}, H_norm {result['hnorm']:.5f}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
