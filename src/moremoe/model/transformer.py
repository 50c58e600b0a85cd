"""Decoder-only transformer with an MoE or MoRE feed-forward layer in every block.

RMSNorm (no bias), causal self-attention with n_heads query heads and n_kv_heads key/value
heads (GQA) through scaled_dot_product_attention, rotary positions, untied input/output
embeddings. Single-device code: parallelism is applied from outside. With a key/value cache
(model/cache.py, or a Hugging Face ``Cache``) the forward pass continues the cached sequence:
rotary positions start at the cached length and the new queries see every cached key. With a
static cache (StaticKVCache, or transformers' StaticCache) the positions are a tensor
(positions_T) and the step's shapes never change: the keys are written at those positions
into buffers of a fixed length, and each query sees the keys at or before its position.

Legend: B batch, T positions (S those of the keys, cache included), h hidden, V vocabulary,
H query heads, G key/value heads, D head dim.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .. import accounting
from ..checks import check_int, check_tensor
from ..nn.moe import MoEConfig, MoELayer
from ..nn.peer import PEERConfig, PEERLayer
from ..ops.linear_ce import IGNORE_INDEX, linear_cross_entropy

HEAD_ROWS_MULTIPLE = 64       # the output head's rows are padded to this on CUDA (see padded_linear)


def padded_linear(x: torch.Tensor, weight_Vh: torch.Tensor, multiple: int) -> torch.Tensor:
    """x @ weight.T with weight's V rows padded with zeros to a multiple of `multiple`, the
    padded columns sliced off: the same values and gradients as F.linear, returned as a
    (..., V) view with a row stride of round_up(V, multiple). With V = 50,257 the plain
    product's output rows are not 16-byte aligned and cuBLAS falls back to slow kernels (on an
    H100 the three head GEMMs of a 16,384-token micro-batch ran 5.7-9.1 ms each in sm75
    cutlass kernels)."""
    V = weight_Vh.shape[0]
    pad = -V % multiple
    if pad == 0:
        return F.linear(x, weight_Vh)
    return F.linear(x, F.pad(weight_Vh, (0, 0, 0, pad)))[..., :V]


@dataclass(frozen=True)
class TransformerConfig:
    vocab: int
    layers: int
    heads: int
    moe: MoEConfig | PEERConfig       # the feed-forward layer: MoE / MoRE, or PEER
    kv_heads: int | None = None       # None: = heads (no GQA)
    head_dim: int | None = None       # None: = hidden // heads
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        check_int("vocab", self.vocab)
        check_int("layers", self.layers)
        check_int("heads", self.heads)
        check_int("max_seq_len", self.max_seq_len)
        if self.kv_heads is not None:
            check_int("kv_heads", self.kv_heads, high=self.heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"kv_heads must divide heads={self.heads}, got {self.kv_heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"heads must divide hidden={self.hidden} (or give head_dim), "
                             f"got {self.heads}")
        if self.dim_per_head % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.dim_per_head}")

    @property
    def hidden(self) -> int:
        return self.moe.hidden

    @property
    def n_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    def total_params(self) -> int:
        m = self.moe
        if isinstance(m, PEERConfig):     # the same sum with PEER's feed-forward
            h = m.hidden
            attn = accounting.attention_params(h, self.heads, self.n_kv_heads, self.dim_per_head)
            return 2 * self.vocab * h + h + self.layers * (m.ffn_params() + attn + 2 * h)
        return accounting.total_params(vocab=self.vocab, hidden=m.hidden, layers=self.layers,
                                       experts=m.experts, width=m.width, heads=self.heads,
                                       kv_heads=self.n_kv_heads, rank=m.rank,
                                       head_dim=self.dim_per_head)

    def training_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs per token at sequence length seq_len (for MFU)."""
        m = self.moe
        if isinstance(m, PEERConfig):
            d = self.dim_per_head
            per_layer = (m.active_flops(training=True)
                         + 6 * accounting.attention_params(m.hidden, self.heads,
                                                           self.n_kv_heads, d)
                         + 12 * self.heads * d * seq_len)
            return self.layers * per_layer + 6 * m.hidden * self.vocab
        return accounting.training_flops_per_token(
            vocab=self.vocab, hidden=m.hidden, layers=self.layers, experts=m.experts,
            top_k=m.top_k, width=m.width, rank=m.rank, heads=self.heads,
            kv_heads=self.n_kv_heads, head_dim=self.dim_per_head, seq_len=seq_len)

    def to_dict(self) -> dict:
        return {**asdict(self), "moe": self.moe.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "TransformerConfig":
        d = dict(d)
        d["moe"] = feed_forward_config(d["moe"])
        return cls(**d)


def feed_forward_config(d: dict):
    """A layer config from its dict: PEER's carries kind "peer"; MoE / MoRE the rest."""
    if d.get("kind") == "peer":
        return PEERConfig.from_dict(d)
    return MoEConfig(**d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float):
    """cos, sin (T, D/2) for rotary positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles_TD = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_TD.cos(), angles_TD.sin()


def apply_rotary(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor):
    x1, x2 = x_BHTD.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos_TD - x2 * sin_TD, x1 * sin_TD + x2 * cos_TD), dim=-1)
    return out.to(x_BHTD.dtype)


def repeat_kv(x_BGSD: torch.Tensor, rep: int) -> torch.Tensor:
    """x.repeat_interleave(rep, dim=1) (query head i reads key/value head i // rep) as a
    broadcast: its backward is a sum over the copies, where repeat_interleave's is an indexed
    scatter."""
    B, G, S, D = x_BGSD.shape
    return x_BGSD[:, :, None].expand(B, G, rep, S, D).reshape(B, G * rep, S, D)


def _native_gqa(q_BHTD: torch.Tensor, sdpa_kwargs: dict) -> bool:
    """Whether SDPA takes the G key/value heads as they are (enable_gqa): on a CUDA GPU of
    compute capability 8.0 or more, bf16 or fp16 queries, no explicit mask. There its
    flash and cuDNN kernels read each key/value head once (on an H200 at the presets'
    shape, forward + backward 0.28 ms against 0.48 with the heads repeated first:
    benchmarks/NOTES.md, issue 36). Elsewhere (fp32, a mask, a CPU, older GPUs) SDPA would
    fall back to its unfused math kernel for enable_gqa, so the heads are repeated."""
    return (q_BHTD.is_cuda and q_BHTD.dtype in (torch.bfloat16, torch.float16)
            and "attn_mask" not in sdpa_kwargs and _gqa_capable(q_BHTD.device.index))


@torch.compiler.assume_constant_result
def _gqa_capable(index: int | None) -> bool:
    """Compute capability 8.0 or more (a constant to torch.compile, also under fullgraph)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _causal(T: int, S: int, device) -> dict:
    """SDPA arguments for T queries that are the last T of S positions: query i sees keys
    <= S - T + i. SDPA's is_causal aligns its mask to the top left, right only when T == S."""
    if T == S:
        return {"is_causal": True}
    if T == 1:
        return {}
    return {"attn_mask": torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)}


def attend_static(q_BHTD, k_BGSD, v_BGSD, positions_T):
    """Attention over a static cache's whole buffers: query t (at position positions[t]) sees
    the keys at positions <= it. The H = G·rep query heads attend as G groups of rep·T rows
    (head g·rep + r reads key/value head g, as repeat_kv maps them), so the (B, G, S, D)
    buffers are read once and never copied per query head. The kernels may return the rows
    in another memory order (CUDA's fused attention writes (B, rep·T, G, D) strides), so the
    heads are split by reshape."""
    B, H, T, D = q_BHTD.shape
    G, S = k_BGSD.shape[1], k_BGSD.shape[2]
    rep = H // G
    visible_TS = torch.arange(S, device=q_BHTD.device) <= positions_T[:, None]
    out = F.scaled_dot_product_attention(q_BHTD.reshape(B, G, rep * T, D), k_BGSD, v_BGSD,
                                         attn_mask=visible_TS.repeat(rep, 1))
    return out.reshape(B, H, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int = 0):
        super().__init__()
        h, D = cfg.hidden, cfg.dim_per_head
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.n_kv_heads, D
        self.layer_idx = layer_idx        # this layer's slot in a key/value cache
        self.q_proj = nn.Linear(h, cfg.heads * D, bias=False)
        self.k_proj = nn.Linear(h, cfg.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(h, cfg.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.heads * D, h, bias=False)

    def forward(self, x_BTh, cos_TD, sin_TD, cache=None, positions_T=None):
        """positions_T (T,) int64: a static cache's write positions (model/cache.py)."""
        B, T, _ = x_BTh.shape
        q = self.q_proj(x_BTh).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTh).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTh).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_TD, sin_TD), apply_rotary(k, cos_TD, sin_TD)
        if positions_T is not None:
            k, v = cache.update(k, v, self.layer_idx, {"cache_position": positions_T})
            out = attend_static(q, k, v, positions_T)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        kw = _causal(T, k.shape[2], q.device)
        if self.kv_heads != self.heads:
            if _native_gqa(q, kw):
                kw["enable_gqa"] = True
            else:
                rep = self.heads // self.kv_heads
                k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.moe_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = PEERLayer(cfg.moe) if isinstance(cfg.moe, PEERConfig) else MoELayer(cfg.moe)
        self.checkpointing: str | None = None     # Transformer.checkpoint_blocks sets it

    def forward(self, x_BTh, cos_TD, sin_TD, return_counts: bool, cache=None,
                positions_T=None):
        if self.checkpointing is None or not torch.is_grad_enabled():
            return self._forward(x_BTh, cos_TD, sin_TD, return_counts, cache, positions_T)
        full = self.checkpointing == "full"
        with set_checkpoint_early_stop(False) if full else contextlib.nullcontext():
            return checkpoint(self._forward, x_BTh, cos_TD, sin_TD, return_counts, cache,
                              positions_T, use_reentrant=False)

    def _forward(self, x_BTh, cos_TD, sin_TD, return_counts: bool, cache=None,
                 positions_T=None):
        x_BTh = x_BTh + self.attn(self.attn_norm(x_BTh), cos_TD, sin_TD, cache, positions_T)
        out = self.moe(self.moe_norm(x_BTh), return_counts=return_counts)
        return x_BTh + out.y, out.for_the_model()


@dataclass
class TransformerOutput:
    logits: torch.Tensor | None                # (B, T, V); None with the fused head + loss
    loss: torch.Tensor | None = None           # lm_loss + aux_loss
    lm_loss: torch.Tensor | None = None        # mean cross-entropy over target positions
    aux_loss: torch.Tensor | None = None       # Σ_layers balance_coef · Switch loss
    switch_losses: list = field(default_factory=list)   # unscaled, per layer (training)
    expert_counts: list = field(default_factory=list)   # (M,) int64 per layer, when asked


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy over the positions whose target is not IGNORE_INDEX."""
    return F.cross_entropy(logits_BTV.float().reshape(-1, logits_BTV.shape[-1]),
                           targets_BT.reshape(-1), ignore_index=IGNORE_INDEX)


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self._lm_loss = lm_loss
        self.fused_head_loss = False    # fuse_head_and_loss()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.dim_per_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def compile_blocks(self, mode: str = "default", backend: str = "inductor", *,
                       moe: bool = True, options: dict | None = None) -> None:
        """torch.compile each block in place (the blocks share one compiled graph; `mode` is
        torch.compile's) and the loss (default mode: the log-softmax reads the bf16 logits
        and needs no fp32 copy of them; CUDA graphs would copy its input). The parameters and
        their names are unchanged. moe=False: each block's norms and attention only, its
        feed-forward layer left eager (one that communicates with other ranks, whose
        collectives and host-side split sizes torch.compile would break its graph on).
        options: inductor's settings for these graphs (torch.compile's `options`, in place
        of `mode`), e.g. {"combo_kernels": True}."""
        # Inductor says so at every compile of a split log-softmax: nothing a user can act on
        warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled",
                                category=UserWarning)
        opts = {"options": dict(options)} if options else {}
        for block in self.blocks:
            parts = [block] if moe else [block.attn_norm, block.attn, block.moe_norm]
            for part in parts:
                part.compile(backend=backend, **(opts or {"mode": mode}))
        self._lm_loss = torch.compile(lm_loss, backend=backend, **opts)

    def fuse_head_and_loss(self, on: bool = True) -> None:
        """In training with targets, compute the output head and the loss together in chunks
        of tokens (ops/linear_ce.py): the (tokens, vocabulary) logits are never stored,
        and the output's logits are None. Evaluation and generation keep the logits."""
        self.fused_head_loss = on

    def checkpoint_blocks(self, *, full: bool = False) -> None:
        """Activation checkpointing: in training each block keeps only its input and
        recomputes the rest in the backward (torch.utils.checkpoint, non-reentrant), the
        memory of one block's activations instead of L. full=True recomputes each block to
        its end instead of stopping once the tensors its backward needs are back: a layer
        that communicates must issue every collective of its forward on every rank, also in
        the recomputation. Names and parameters are unchanged."""
        for block in self.blocks:
            block.checkpointing = "full" if full else "early_stop"

    def reset_parameters(self) -> None:
        """N(0, σ²) everywhere; residual output projections σ / sqrt(2 L) (GPT-2)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.layers)
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                nn.init.normal_(proj.weight, std=std)
            nn.init.normal_(block.attn.o_proj.weight, std=out_std)
            if isinstance(block.moe, PEERLayer):
                block.moe.reset_parameters()
                continue
            block.moe.router.reset_parameters()
            block.moe.experts.out_init_std = out_std
            block.moe.experts.reset_parameters()

    def forward(self, tokens_BT: torch.Tensor | None, targets_BT: torch.Tensor | None = None, *,
                return_counts: bool = False, cache=None,
                embeds_BTh: torch.Tensor | None = None,
                positions_T: torch.Tensor | None = None,
                keep_T: torch.Tensor | None = None) -> TransformerOutput:
        """tokens (B, T) -> logits; with targets (B, T) (IGNORE_INDEX = -100 where no loss),
        also the mean LM loss, the summed balancing loss and their sum. With a cache (a
        KVCache or a Hugging Face Cache), tokens continue the cached sequence and their keys
        and values are appended to it. embeds (B, T, h) in place of tokens: the input
        embeddings given directly (tokens None). positions_T (T,) int64: the tokens'
        positions, written there into a static cache (StaticKVCache; transformers'
        StaticCache gives them itself). keep_T (K,) int64: logits only at these of the T
        positions (B, K, V) (a prefill needs the last one)."""
        cfg = self.config
        if (tokens_BT is None) == (embeds_BTh is None):
            raise ValueError("give tokens (B, T) or embeds (B, T, h), exactly one of them")
        if embeds_BTh is not None:
            check_tensor("embeds", embeds_BTh, ndim=3, floating=True, last=cfg.hidden,
                         last_name="hidden")
        else:
            check_tensor("tokens", tokens_BT, ndim=2, integer=True)
        if keep_T is not None and targets_BT is not None:
            raise ValueError("keep_T computes some positions' logits only: no loss with it")
        x = self.embed(tokens_BT) if embeds_BTh is None else embeds_BTh
        cos, sin, positions_T = self._rotary(x.shape[1], cache, positions_T, x.device)
        outs = []
        for block in self.blocks:
            x, out = block(x, cos, sin, return_counts, cache, positions_T)
            outs.append(out)
        if keep_T is not None:
            x = x.index_select(1, keep_T)
        x = self.norm(x)
        fused = self.fused_head_loss and self.training and targets_BT is not None
        logits = (None if fused else
                  padded_linear(x, self.lm_head.weight, HEAD_ROWS_MULTIPLE) if x.is_cuda
                  else self.lm_head(x))
        result = TransformerOutput(logits=logits)
        result.expert_counts = [o.counts for o in outs if o.counts is not None]
        if self.training:
            result.switch_losses = [o.switch_loss for o in outs]
            result.aux_loss = torch.stack([o.aux_loss for o in outs]).sum()
        if targets_BT is not None:
            check_tensor("targets", targets_BT, integer=True, shape=x.shape[:2])
            result.lm_loss = (linear_cross_entropy(x.reshape(-1, cfg.hidden),
                                                   self.lm_head.weight, targets_BT.reshape(-1))
                              if fused else self._lm_loss(logits, targets_BT))
            result.loss = result.lm_loss + (result.aux_loss if result.aux_loss is not None
                                            else 0.0)
        return result

    def _rotary(self, T: int, cache, positions_T, device):
        """(cos, sin) of the T new tokens and their positions tensor (None unless the cache
        is static): after the cached length (a Python int), or at the positions given or
        that transformers' static cache counts on the device (no host sync either way)."""
        if positions_T is None and getattr(cache, "is_compileable", False):
            positions_T = torch.arange(T, device=device) + cache.get_seq_length()
        if positions_T is not None:
            if cache is None:
                raise ValueError("positions_T writes into a static cache: pass the cache")
            return (self.rope_cos.index_select(0, positions_T),
                    self.rope_sin.index_select(0, positions_T), positions_T)
        start = 0 if cache is None else cache.get_seq_length()
        if start + T > self.config.max_seq_len:
            cached = f"{start} cached plus " if cache is not None else ""
            raise ValueError(f"tokens has sequence length {cached}{T}, expected <= "
                             f"max_seq_len={self.config.max_seq_len}")
        return self.rope_cos[start:start + T], self.rope_sin[start:start + T], None
