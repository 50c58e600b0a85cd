"""PEER, the paper's other many-experts baseline (Appendix B; He 2024): M single-neuron
experts e_i(x) = σ(u_iᵀ x) v_i, retrieved by product keys.

H query networks (one d_q × h matrix each) and two sub-key tables (√M × d_q/2) shared by the
heads: each head splits its query in halves, scores each half against one table, keeps the
top κ on each axis and then the top κ of the κ² candidate sums; expert (a, b) of the grid is
index a √M + b. A head mixes its κ experts with the softmax of their scores; the layer adds
the H heads, k = H κ experts per token. The (N, M) scores never exist: retrieval costs
O(H d_q (h + √M) + H κ²) per token, as the accounting's 6 H d_q (h + √M) counts.

Retrieval (ops/peer_retrieval.py, config impl) scores only the κ²-grid candidates (i, j)
with (i+1)(j+1) <= κ (about κ ln κ of them): each per-axis list is sorted, so at least
(i+1)(j+1) candidates score at least as much as (i, j), and one with (i+1)(j+1) > κ is never
needed in the top κ (ties aside). On CUDA one fused kernel does all of it per (token, head),
nothing but the winners leaving the chip; the torch path forms the two (N, H, √M) tables.

The experts (ops/peer_experts.py, config impl): on CUDA the fused kernels gather the rows of
u and v on chip (no (N, H κ, h) tensor, any N); the torch path (CPU, impl="reference")
gathers the u rows, (N, H κ, h) in x's dtype, in chunks of tokens for inference, and makes
the v side an embedding bag. Legend: N tokens, h hidden, M experts (√M = R keys per table),
H heads, κ top per head (kappa in code), d_q query size.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..accounting import peer_active_flops, peer_params
from ..checks import check_int, check_number, check_tensor
from ..ops.balance import expert_counts
from ..ops.dispatch import IMPLS
from ..ops.peer_experts import ACTIVATIONS, peer_experts, peer_experts_ref, peer_impl
from ..ops.peer_retrieval import peer_retrieval
from .moe import MoEOutput

CHUNK_BYTES = 1 << 30       # gathered u rows at a time on the torch path without autograd


@dataclass(frozen=True)
class PEERConfig:
    experts: int          # M, a perfect square
    hidden: int           # h
    heads: int = 8        # H
    d_q: int = 32         # query size (even: two halves)
    kappa: int = 16       # top per head
    activation: str = "gelu"
    init_std: float = 0.02
    impl: str = "auto"    # the experts: "auto" (fused kernels on CUDA) | "triton" | "reference"

    def __post_init__(self):
        for name in ("experts", "hidden", "heads", "kappa"):
            check_int(name, getattr(self, name))
        check_int("d_q", self.d_q, low=2)
        peer_params(self.experts, self.hidden, self.heads, self.d_q)   # M must be a square
        if self.d_q % 2:
            raise ValueError(f"d_q must be even (two query halves), got {self.d_q}")
        if not 1 <= self.kappa <= math.isqrt(self.experts):
            raise ValueError(f"kappa must be in [1, sqrt(M) = {math.isqrt(self.experts)}], "
                             f"got {self.kappa}")
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                             f"{self.activation!r}")
        if not isinstance(self.impl, str) or self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        check_number("init_std", self.init_std)

    @property
    def top_k(self) -> int:
        return self.heads * self.kappa

    @property
    def flops(self) -> int:
        return peer_active_flops(self.experts, self.hidden, self.heads, self.d_q, self.kappa)

    @property
    def label(self) -> str:
        return f"PEER-{self.experts} (H={self.heads}, kappa={self.kappa}, d_q={self.d_q})"

    def active_flops(self, *, training: bool = False) -> int:
        """The paper's 12 k h + 6 H d_q (h + sqrt M) (6 per parameter used); training counts
        forward and backward as 3x it, as the (18, 14) of the MoE layers do."""
        return 3 * self.flops if training else self.flops

    def ffn_params(self) -> int:
        return sum(peer_params(self.experts, self.hidden, self.heads, self.d_q))

    def to_dict(self) -> dict:
        return {"kind": "peer", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "PEERConfig":
        return cls(**{k: v for k, v in d.items() if k != "kind"})


class PEERLayer(nn.Module):
    """x (..., h) -> MoEOutput(y, aux 0 in training, no switch loss, counts (M,) in training
    or when asked, router None): the MoE layer's interface, with no balancing loss (PEER has
    none)."""

    def __init__(self, config: PEERConfig):
        super().__init__()
        if not isinstance(config, PEERConfig):
            raise TypeError(f"config must be a PEERConfig, got {type(config).__name__}")
        c = self.config = config
        R = math.isqrt(c.experts)
        self.query = nn.Linear(c.hidden, c.heads * c.d_q, bias=False)
        self.keys = nn.Parameter(torch.empty(2, R, c.d_q // 2))
        self.u = nn.Parameter(torch.empty(c.experts, c.hidden))     # down (input) weights
        self.v = nn.Parameter(torch.empty(c.experts, c.hidden))     # up (output) weights
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for p in (self.query.weight, self.keys, self.u, self.v):
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, *, return_counts: bool = False):
        """x (..., h) in any floating dtype: computed in x's dtype (the autocast dtype under
        autocast), as MoELayer does, with the softmax of the scores in fp32 (fp64 for fp64
        inputs); y in x's dtype."""
        c = self.config
        check_tensor("x", x, floating=True, last=c.hidden, last_name="hidden")
        x_NH = x.reshape(-1, c.hidden)
        q = F.linear(x_NH, self.query.weight.to(x_NH.dtype)).view(-1, c.heads, c.d_q)
        scores, ids = peer_retrieval(q, self.keys.to(q.dtype), c.kappa, impl=c.impl)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        gates = torch.softmax(scores.to(acc), dim=-1)                     # per head
        ids_NK = ids.reshape(x_NH.shape[0], c.top_k)                     # (N, H κ)
        y_NH = self._experts(x_NH, gates.reshape(ids_NK.shape), ids_NK)
        counts = expert_counts(ids_NK, c.experts) if (return_counts or self.training) else None
        aux = x.new_zeros((), dtype=torch.float32) if self.training else None
        return MoEOutput(y_NH.to(x.dtype).reshape(x.shape), aux, None, counts, None)

    def _experts(self, x_NH, gates_NK, ids_NK):
        """Σ_j gates_j σ(u_{id_j}ᵀ x) v_{id_j}: the fused op on one pass, or the torch path,
        which without autograd gathers its (n, k, h) u rows a chunk of tokens at a time and
        reads u and v in x's dtype (as the MoE experts' torch path reads its weights)."""
        c = self.config
        if peer_impl(c.impl, x_NH) == "triton":
            return peer_experts(x_NH, gates_NK, ids_NK, self.u, self.v,
                                activation=c.activation, impl="triton", check_ids=False)
        u, v = self.u.to(x_NH.dtype), self.v.to(x_NH.dtype)
        rows = (max(1, CHUNK_BYTES // (ids_NK.shape[1] * c.hidden * x_NH.element_size()))
                if not torch.is_grad_enabled() else max(1, x_NH.shape[0]))
        return torch.cat([peer_experts_ref(x_NH[i:i + rows], gates_NK[i:i + rows],
                                           ids_NK[i:i + rows], u, v, c.activation)
                          for i in range(0, x_NH.shape[0], rows)] or [x_NH[:0]])

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={c.experts}, hidden={c.hidden}, heads={c.heads}, d_q={c.d_q}, "
                f"kappa={c.kappa}, activation={c.activation}, impl={c.impl}")


def peer_reference(x_NH, query_W, keys_2RD, u_MH, v_MH, heads: int, kappa: int,
                   activation: str = "gelu") -> torch.Tensor:
    """The layer written the naive way, for tests: all M scores of every head (the full
    Cartesian sum of the two tables), the top κ per head by torch.topk, then the experts."""
    N, h = x_NH.shape
    R, half = keys_2RD.shape[1], keys_2RD.shape[2]
    q = (x_NH @ query_W.T).view(N, heads, 2 * half)
    full = ((q[..., :half] @ keys_2RD[0].T)[..., :, None]
            + (q[..., half:] @ keys_2RD[1].T)[..., None, :]).reshape(N, heads, R * R)
    scores, ids = full.topk(kappa, dim=-1)
    gates = torch.softmax(scores, dim=-1)
    hidden = ACTIVATIONS[activation](torch.einsum("nhkd,nd->nhk", u_MH[ids], x_NH))
    return torch.einsum("nhk,nhkd->nd", gates * hidden, v_MH[ids])
