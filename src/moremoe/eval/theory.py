"""The paper's theory, checked by sampling.

Hypercube construction (the load-balancing Proposition of the paper's appendix): with
M = 2^r experts indexed by sign vectors a ∈ {±1}^r, R1 rows u_a = a / √r, R2 = [I_r | 0]
(r × h) and tokens x ~ N(0, I_h), every expert is among a token's top-k with probability
exactly k/M, so the loads N_a ~ Binomial(n, k/M) and, with probability ≥ 1 − δ,
max_a |N_a − n k / M| ≤ √(2 n k L / M) + (2/3) L, L = log(2M / δ). `hypercube_check` routes
sampled tokens through the library's own low-rank router (ops.router_lowrank) and reports
the deviation against that bound and the normalised routing entropy H_norm.
Letters: n tokens (N in the CLI), h hidden, M experts, k active, r rank.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..ops.balance import expert_counts
from ..ops.router_lowrank import router_lowrank
from .routing import normalized_entropy


def hypercube_router(rank: int, hidden: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(R1 (2^r, r), R2 (r, h)) of the construction; expert a's sign vector is the binary
    expansion of a (bit ℓ set ↔ a_ℓ = +1)."""
    h = rank if hidden is None else hidden
    if not 1 <= rank <= 20:
        raise ValueError(f"--rank must be in [1, 20] (M = 2^r experts), got {rank}")
    if h < rank:
        raise ValueError(f"--hidden must be >= --rank={rank}, got {h}")
    M = 1 << rank
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
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(M, dtype=torch.int64)
    for n0 in range(0, tokens, chunk):
        x = torch.randn(min(chunk, tokens - n0), R2.shape[1], generator=g)
        idx = router_lowrank(x, R1, R2, top_k, impl="reference")[1]
        counts += expert_counts(idx, M)
        if progress:
            progress(min(n0 + chunk, tokens), tokens)
    mean = tokens * top_k / M
    deviation = (counts.double() - mean).abs()
    bound = load_bound(tokens, top_k, M, delta)
    return {"rank": rank, "experts": M, "top_k": top_k, "tokens": tokens,
            "hidden": R2.shape[1], "delta": delta, "seed": seed,
            "expected_load": mean, "max_deviation": float(deviation.max()),
            "bound": bound, "within_bound": bool(deviation.max() <= bound),
            "min_load": int(counts.min()), "max_load": int(counts.max()),
            "selection_prob_min": float(counts.min()) / tokens,
            "selection_prob_max": float(counts.max()) / tokens,
            "selection_prob_exact": top_k / M,
            "hnorm": normalized_entropy(counts), "counts": counts.tolist()}


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
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
