"""Named run configurations: the paper's pretraining pairs and tiny CPU models.

The paper's pairs (Table fineweb_p3_configs, and the M = 1024 / 8192 pair of Table
fineweb_p3_results): L = 12, k = 4, head dim 64, GPT-2 vocabulary (V = 50,257), untied
embeddings, T = 1,024, MoRE at r = 64. h = 1024 uses 16 heads and 4 key/value heads (Appendix
C.2); h = 512 uses 8 heads, and 2 key/value heads reproduce the total parameters the paper
lists (362.9M, 1.91B, 664.9M, 3.76B, 1.27B, 7.92B), so we take those. MoRE-8192's width
s = 52 is the paper's (Table same_config). h512-s56-moe1792 is MoRE-1792's shape with the
standard linear router (M = 1,792, s = 56, k = 4, no rank): the same-shape comparison.
Optimiser: AdamW at lr 1e-3 for every configuration (router lr = lr), cosine schedule with
5 % warmup, 40B tokens; 262,144 tokens per optimizer step (256 sequences) on 4 GPUs, 64
sequences per GPU. The paper accumulates 4 micro-steps of 16; the presets take the 64 in one
micro-step (the same tokens and gradient; the Switch balance loss is then over 65,536
tokens, not the mean of four over 16,384), with the head and the loss in chunks
(train.fused_loss): the expert weights are read and their fp32 gradients written once a
step instead of four times. On one H200 MoRE-1792's step fell from 181.8 ms (7452ebd) to
135.8 (46d51d2) and MoE-256's from 127.4 to 106.8, peaks 59 and 36 GiB (benchmarks/NOTES.md;
31 of them the final evaluation's whole-batch fp32 logits, which the validation loss now
takes in chunks: eval/perplexity.py). A GPU too small for that passes --set
train.batch_size=16 --set train.grad_accum=4. The MoRE presets keep AdamW's moments in bf16
(optim.moments=bf16: 7 GiB less for MoRE-1792; over 300 steps of a whole schedule its loss
moved 0.014 on average from fp32 moments', where two seeds moved 0.053; with one update
launch a tensor the step was no faster, 136.8 against 135.8 ms; they now take the split
update, not yet timed), and so does the same-shape h512-s56-moe1792, which differs from
MoRE-1792 only in its router. The matched MoE presets keep fp32 moments (--set
optim.moments=fp32 gives any preset the paper's optimiser exactly).
The paper presets torch.compile the whole model (train.compile, compile_scope=model) with
CUDA graphs on one GPU (compile_mode=auto): eager, MoE-256's step on an H100 was host-bound
(305 ms a step for 170 ms of kernels); so compiled it takes 166 ms (3de2414), GPU-bound.

Tiny presets (h = 64, 2 layers, T = 128, vocabulary from the data) train in seconds on a CPU;
tiny-more is matched in active FLOPs to tiny-moe (6·k·h·s + 6·router at k = 2, r = 8).
h512-peer150544 and tiny-peer use PEER layers (nn/peer.py): the paper's Appendix B match to
MoRE-1792, and a small one for tests.
"""
from __future__ import annotations

from ..tasks.tokenizer import VOCAB_SIZE
from .config import ModelSpec, OptimSpec, RunConfig, TrainSpec

PAPER_TOKENS = 40_000_000_000


def _paper(kind: str, hidden: int, experts: int, width: int) -> RunConfig:
    heads, kv = (16, 4) if hidden == 1024 else (8, 2)
    model = ModelSpec(kind=kind, hidden=hidden, layers=12, heads=heads, kv_heads=kv,
                      experts=experts, width=width, top_k=4,
                      rank=64 if kind == "more" else None, seq_len=1024, vocab=VOCAB_SIZE)
    train = TrainSpec(batch_size=64, grad_accum=1, max_tokens=PAPER_TOKENS, eval_every=2000,
                      eval_batches=4, log_every=50, ckpt_every=2000, compile=True,
                      compile_mode="auto", compile_scope="model", fused_loss=True)
    # bf16 AdamW moments for MoRE (4 bytes a parameter less): on MoRE-1792 their loss stayed
    # within two seeds' spread (benchmarks/NOTES.md); the MoE presets keep fp32 moments
    moments = "bf16" if kind == "more" else "fp32"
    return RunConfig(model=model, optim=OptimSpec(lr=1e-3, moments=moments), train=train)


def _peer() -> RunConfig:
    """PEER matched to MoRE-1792 as the paper does (Appendix B): M = 388², H = 8, d_q = 32,
    kappa = 56 (k = 448), otherwise the h = 512 pair's model and training."""
    cfg = _paper("moe", 512, 256, 64)
    model = ModelSpec(**{**cfg.model.__dict__, "kind": "peer", "experts": 388 ** 2,
                         "peer_heads": 8, "peer_dq": 32, "peer_kappa": 56})
    return RunConfig(model=model, optim=cfg.optim, train=cfg.train)


def _tiny(kind: str) -> RunConfig:
    experts, width, rank = {"moe": (8, 32, None), "more": (64, 28, 8),
                            "peer": (256, 32, None)}[kind]
    extra = {"peer_heads": 2, "peer_dq": 8, "peer_kappa": 4} if kind == "peer" else {}
    model = ModelSpec(kind=kind, hidden=64, layers=2, heads=4, experts=experts, width=width,
                      top_k=2, rank=rank, seq_len=128, vocab=None, **extra)
    train = TrainSpec(batch_size=8, max_steps=200, eval_every=50, eval_batches=4, log_every=10,
                      ckpt_every=100, device="auto")
    return RunConfig(model=model, optim=OptimSpec(lr=3e-3), train=train)


PRESETS = {
    "h1024-s32-moe128": ("moe", 1024, 128, 32),
    "h1024-s32-more1536": ("more", 1024, 1536, 24),
    "h512-s64-moe256": ("moe", 512, 256, 64),
    "h512-s64-more1792": ("more", 512, 1792, 56),
    "h512-s56-moe1792": ("moe", 512, 1792, 56),
    "h512-s128-moe256": ("moe", 512, 256, 128),
    "h512-s128-more1792": ("more", 512, 1792, 112),
    "h512-s64-moe1024": ("moe", 512, 1024, 64),
    "h512-s64-more8192": ("more", 512, 8192, 52),
    "h512-peer150544": ("peer",),
    "tiny-moe": ("moe",),
    "tiny-more": ("more",),
    "tiny-peer": ("peer",),
}

# matched pairs (equal active FLOPs): name -> (MoE preset, MoRE preset); the first is the
# paper's main h = 512 pair. "h512-s56-same" pairs MoRE-1792 with the standard router at its
# shape (the paper's same-configuration comparison): what the low-rank router saves.
PAIRS = {"h512-s64": ("h512-s64-moe256", "h512-s64-more1792"),
         "h512-s56-same": ("h512-s56-moe1792", "h512-s64-more1792"),
         "h512-s128": ("h512-s128-moe256", "h512-s128-more1792"),
         "h512-s64-x8": ("h512-s64-moe1024", "h512-s64-more8192"),
         "h1024-s32": ("h1024-s32-moe128", "h1024-s32-more1536"),
         "tiny": ("tiny-moe", "tiny-more")}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> RunConfig:
    if not isinstance(name, str) or name not in PRESETS:   # a YAML list or mapping too
        raise KeyError(f"preset must be one of {', '.join(PRESETS)}; got {name!r}")
    args = PRESETS[name]
    if name == "h512-peer150544":
        cfg = _peer()
    else:
        cfg = _tiny(*args) if len(args) == 1 else _paper(*args)
    if name == "h512-s56-moe1792":       # MoRE-1792's shape and training, optimiser included
        cfg = RunConfig(model=cfg.model, optim=get_preset("h512-s64-more1792").optim,
                        train=cfg.train)
    return RunConfig(model=cfg.model, optim=cfg.optim, train=cfg.train, preset=name)


def preset_rows(vocab_default: int = VOCAB_SIZE) -> list[dict]:
    """One dict per preset: shape, total parameters and FLOPs (via moremoe.accounting)."""
    rows = []
    for name in PRESETS:
        m = get_preset(name).model
        tc = m.transformer_config(vocab=vocab_default)
        rows.append({"name": name, "kind": m.kind, "hidden": m.hidden, "layers": m.layers,
                     "heads": m.heads, "kv_heads": tc.n_kv_heads, "experts": m.experts,
                     "width": 1 if m.kind == "peer" else m.width,     # PEER: single neurons
                     "top_k": tc.moe.top_k, "rank": m.rank,
                     "seq_len": m.seq_len, "vocab": tc.vocab, "vocab_from_data": m.vocab is None,
                     "params_total": tc.total_params(),
                     "moe_flops_inference": tc.moe.active_flops(),
                     "moe_flops_training": tc.moe.active_flops(training=True),
                     "train_flops_per_token": tc.training_flops_per_token(m.seq_len)})
    return rows
