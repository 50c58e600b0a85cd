"""The runs of ``moremoe study lm``: which models, for how many tokens, with which seeds and
learning rates, planned from the matched-FLOP planner (moremoe.accounting).

The base pair is the paper's rule at the study's scale: the MoE takes M = k s experts of
width s (its optimum with C_e = C_r), and the MoRE at rank r the largest M' and width s'
that match its active FLOPs (plan_matched; at h = 256, s = 64, k = 4, r = 32: MoE-256
against MoRE-1920 of width 60). Experiments (the paper's label in brackets):

  pair       MoE against MoRE at each --budgets, every seed          [tab:fineweb_p3_results,
                                                                      fig:gap_vs_tokens]
  experts    MoRE at (h, s', r) with M = M'/16 ... M'                [fig:more_experts]
  rank       MoRE at s' and the pair's FLOPs, M fitted to each rank  [fig:rank_sweeps]
  init       MoRE at M', s', each of --init-ranks, variance-matched
             against per-entry N(0, 0.02^2) router initialisation   [fig:initialization_ablation]
  router-lr  the pair's MoRE with the router at 0.3x, 1x, 3x the lr  [fig:rlr_switch]
  paper      the h = 512 presets MoE-256 and MoRE-1792 (PEER with
             --peer), one seed, at lr 1e-3 (the paper's choice)     [tab:peer_quality]

Learning rates, the paper's protocol: each configuration (model shape) of pair, experts and
rank takes the rate of --lrs whose short run (--lr-tokens, the first seed) ends with the
lowest validation loss; init and router-lr run at the rate chosen for the pair's MoRE (the
paper ran its ablations at its one chosen rate); --lr fixes one rate for all instead.

A run is named by what it trains (model, tokens, router-lr factor, seed), so experiments
that need the same run share it (the pair's MoRE at --sweep-tokens is also the experts
sweep's M' and the router-lr sweep's 1x).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from ..accounting import layer_name, plan_matched, rank_sweep
from ..training.config import ModelSpec
from ..training.presets import get_preset

EXPERIMENTS = ("pair", "experts", "rank", "init", "router-lr", "paper")
LRS = (5e-4, 1e-3, 3e-3, 5e-3)
INITS = {"variance_matched": "variance-matched", "default": "per-entry"}
PAPER_PRESETS = ("h512-s64-moe256", "h512-s64-more1792")
PEER_PRESET = "h512-peer150544"
PAPER_LR = 1e-3


@dataclass(frozen=True)
class StudySettings:
    experiments: tuple[str, ...] = ("pair",)
    hidden: int = 256                       # h
    layers: int = 6                         # L
    heads: int | None = None                # None: h / 64 (head dim 64, as the paper)
    kv_heads: int | None = None             # None: heads / 4 where 4 divides it, else heads
    top_k: int = 4                          # k
    width: int = 64                         # the MoE's s (M = k s)
    rank: int = 32                          # the pair's r
    seq_len: int = 1024                     # T
    batch: int = 64                         # sequences a step (one micro-step)
    budgets: tuple[int, ...] = (60_000_000, 120_000_000)    # pair: tokens a run
    sweep_tokens: int = 120_000_000         # experts, rank, init, router-lr
    paper_tokens: int = 250_000_000         # paper
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = LRS            # the selection's candidates
    lr_tokens: int = 20_000_000             # tokens of a selection run
    lr: float | None = None                 # one fixed rate: no selection
    eval_tokens: int = 10_000_000           # tokens between validations (fixed marks)
    val_sequences: int | None = None        # validation sequences; None: all of them
    experts: tuple[int, ...] | None = None  # the experts sweep's M; None: M'/16 ... M'
    ranks: tuple[int, ...] = (16, 32, 64, 128)
    init_ranks: tuple[int, ...] = (16, 32, 64)
    router_lr_factors: tuple[float, ...] = (0.3, 1.0, 3.0)
    peer: bool = False                      # paper: PEER beside MoE-256 and MoRE-1792
    max_epochs: float = 4.0                 # no run past this many passes over the corpus
    overrides: tuple[str, ...] = ()         # --set section.key=value, on every run

    def __post_init__(self):
        _check_types(self)
        bad = [e for e in self.experiments if e not in EXPERIMENTS]
        if bad or not self.experiments:
            raise ValueError(f"--experiments must be a comma list of {', '.join(EXPERIMENTS)}, "
                             f"got {', '.join(self.experiments) or 'none'}")
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed")
        if self.lr is None and not self.lrs:
            raise ValueError("--lrs: give at least one learning rate, or one --lr")

    @property
    def head_count(self) -> int:
        return self.heads if self.heads is not None else max(1, self.hidden // 64)

    @property
    def kv_head_count(self) -> int:
        if self.kv_heads is not None:
            return self.kv_heads
        return self.head_count // 4 if self.head_count % 4 == 0 else self.head_count

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def steps(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.tokens_per_step))

    def to_dict(self) -> dict:
        return asdict(self)


def _check_types(settings: "StudySettings") -> None:
    """Every setting of the type its field says (a study.json read back included): TypeError
    naming the setting."""
    import typing
    hints = typing.get_type_hints(StudySettings)
    for f in fields(StudySettings):
        v, tp = getattr(settings, f.name), hints[f.name]
        base = tp
        if type(None) in typing.get_args(tp):           # X | None
            if v is None:
                continue
            base = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(base) is tuple:            # tuple[X, ...]
            inner = typing.get_args(base)[0]
            ok = isinstance(v, tuple) and all(_is(x, inner) for x in v)
        else:
            ok = _is(v, base)
        if not ok:
            raise TypeError(f"setting {f.name} = {v!r} is not {tp}")


def _is(v, tp) -> bool:
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, tp)


# what a study's runs are: a study continues only with these unchanged (the others add runs)
FROZEN = ("hidden", "layers", "heads", "kv_heads", "top_k", "width", "rank", "seq_len", "batch",
          "lrs", "lr_tokens", "lr", "eval_tokens", "val_sequences", "overrides")


def changed_frozen(old: dict, new: StudySettings) -> list[str]:
    now = new.to_dict()
    return [f"{k}: {old.get(k)!r} -> {now[k]!r}" for k in FROZEN
            if _plain(old.get(k)) != _plain(now[k])]


def _plain(v):
    return list(v) if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class Run:
    name: str                     # its folder under OUT/runs, unique
    kind: str                     # "main" or "lr" (a selection run)
    model: dict                   # ModelSpec fields (seq_len and vocab from the study)
    tokens: int
    seed: int
    lr: float | None = None       # a fixed rate; None: the selection of lr_config
    lr_config: str | None = None  # the configuration whose chosen rate this run takes
    router_lr_factor: float = 1.0
    uses: tuple[tuple[str, str], ...] = field(default=())     # (experiment, arm)

    @property
    def config(self) -> str:
        return model_tag(self.model)


def model_tag(m: dict) -> str:
    """A model's configuration as a folder-safe name, e.g. more1920-s60-r32."""
    if m["kind"] == "peer":
        return f"peer{m['experts']}-h{m['hidden']}"
    tag = f"{m['kind']}{m['experts']}-s{m['width']}" + (f"-r{m['rank']}" if m["rank"] else "")
    tag += "" if m["hidden"] == 256 and m["layers"] == 6 else f"-h{m['hidden']}-L{m['layers']}"
    return tag + ("-init_default" if m.get("router_init") == "default" else "")


def tokens_tag(tokens: int) -> str:
    """120000000 -> 120M, 2560 -> 2.56K, 1.5e9 -> 1.5B."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if tokens >= div:
            return f"{tokens / div:g}{suffix}"
    return str(tokens)


def arm_label(m: dict) -> str:
    if m["kind"] == "peer":
        return f"PEER-{m['experts']}"
    name = layer_name(m["experts"], m["rank"])
    init = ", per-entry init" if m.get("router_init") == "default" else ""
    return f"{name} (s={m['width']}" + (f", r={m['rank']}" if m["rank"] else "") + f"{init})"


def _model(settings: StudySettings, kind: str, experts: int, width: int,
           rank: int | None = None, init: str = "variance_matched") -> dict:
    m = {"kind": kind, "hidden": settings.hidden, "layers": settings.layers,
         "heads": settings.head_count, "kv_heads": settings.kv_head_count, "experts": experts,
         "width": width, "top_k": settings.top_k, "rank": rank, "router_init": init}
    model_spec(m, settings)                 # a shape the model refuses: now, naming the key
    return m


def model_spec(m: dict, settings: StudySettings) -> ModelSpec:
    return ModelSpec(**m, seq_len=settings.seq_len, vocab=None)


class _Plan:
    def __init__(self, settings: StudySettings):
        self.settings, self.runs = settings, {}
        base = plan_matched(hidden=settings.hidden, top_k=settings.top_k, rank=settings.rank,
                            width=settings.width)
        self.budget = base.moe.flops
        self.moe = _model(settings, "moe", base.moe.experts, base.moe.width)
        self.more = _model(settings, "more", base.more.experts, base.more.width,
                           base.more.rank)

    def add(self, exp: str, arm: str, m: dict, tokens: int, seed: int, *, lr=None,
            lr_config: str | None = None, factor: float = 1.0) -> None:
        s = self.settings
        if s.lr is not None and lr is None:
            lr, lr_config = s.lr, None
        elif lr is None and lr_config is None:
            lr_config = model_tag(m)
        name = (f"{model_tag(m)}-{tokens_tag(tokens)}"
                + (f"-rlr{factor:g}" if factor != 1 else "") + f"-s{seed}")
        run = self.runs.get(name) or Run(name, "main", m, tokens, seed, lr, lr_config, factor)
        self.runs[name] = replace(run, uses=run.uses + ((exp, arm),))

    def selection_runs(self) -> list[Run]:
        s = self.settings
        configs = dict.fromkeys(r.lr_config for r in self.runs.values() if r.lr_config)
        models = {model_tag(self.more): self.more} | {model_tag(r.model): r.model
                                                      for r in self.runs.values()}
        out = []
        for tag in configs:
            model = models[tag]
            for lr in s.lrs:
                name = f"lr-{tag}-{tokens_tag(s.lr_tokens)}-lr{lr:g}-s{s.seeds[0]}"
                out.append(Run(name, "lr", model, s.lr_tokens, s.seeds[0], lr, None,
                               uses=(("lr", tag),)))
        return out


def _pair(p: _Plan) -> None:
    for tokens in p.settings.budgets:
        for seed in p.settings.seeds:
            for m in (p.moe, p.more):
                p.add("pair", arm_label(m), m, tokens, seed)


def experts_sweep(p: _Plan) -> list[int]:
    M = p.more["experts"]
    return list(p.settings.experts or sorted({max(p.settings.top_k, M // d)
                                              for d in (16, 8, 4, 2, 1)}))


def _experts(p: _Plan) -> None:
    for M in experts_sweep(p):
        m = _model(p.settings, "more", M, p.more["width"], p.more["rank"])
        for seed in p.settings.seeds:
            p.add("experts", arm_label(m), m, p.settings.sweep_tokens, seed)


def _rank(p: _Plan) -> None:
    s = p.settings
    for layer in rank_sweep(p.budget, s.hidden, s.top_k, p.more["width"], list(s.ranks)):
        if layer.experts < s.top_k:
            continue                        # the rank's projection alone spends the budget
        m = _model(s, "more", layer.experts, layer.width, layer.rank)
        for seed in s.seeds:
            p.add("rank", arm_label(m), m, s.sweep_tokens, seed)


def _init(p: _Plan) -> None:
    s, base = p.settings, model_tag(p.more)
    for r in s.init_ranks:
        for init in INITS:
            m = _model(s, "more", p.more["experts"], p.more["width"], r, init)
            for seed in s.seeds:
                p.add("init", f"r={r} {INITS[init]}", m, s.sweep_tokens, seed,
                      lr_config=base)


def _router_lr(p: _Plan) -> None:
    s, base = p.settings, model_tag(p.more)
    for factor in s.router_lr_factors:
        for seed in s.seeds:
            p.add("router-lr", f"{factor:g}x", p.more, s.sweep_tokens, seed, lr_config=base,
                  factor=factor)


def _paper(p: _Plan) -> None:
    s = p.settings
    names = PAPER_PRESETS + ((PEER_PRESET,) if s.peer else ())
    keep = {f.name for f in fields(ModelSpec)} - {"seq_len", "vocab", "router_impl",
                                                  "experts_impl", "balance_coef"}
    for preset in names:
        spec = get_preset(preset).model
        m = {k: v for k, v in asdict(spec).items() if k in keep}
        p.add("paper", preset, m, s.paper_tokens, s.seeds[0], lr=s.lr or PAPER_LR)


PLANNERS = {"pair": _pair, "experts": _experts, "rank": _rank, "init": _init,
            "router-lr": _router_lr, "paper": _paper}


def plan_runs(settings: StudySettings, *, train_tokens: int | None = None) -> list[Run]:
    """Every run of the study: the selection runs first, then the experiments' runs in the
    order of --experiments (each by budget, then seed, then model). ValueError when a run
    would pass over the corpus more than max_epochs times (train_tokens: the data's)."""
    p = _Plan(settings)
    for exp in settings.experiments:
        PLANNERS[exp](p)
    runs = (p.selection_runs() if settings.lr is None else []) + list(p.runs.values())
    if train_tokens:
        for run in runs:
            if run.tokens / train_tokens > settings.max_epochs:
                raise ValueError(f"{run.name} would train {run.tokens:,} tokens, "
                                 f"{run.tokens / train_tokens:.2f} epochs of the data's "
                                 f"{train_tokens:,} training tokens; --max-epochs is "
                                 f"{settings.max_epochs:g}: give smaller budgets or more text")
    return runs


def base_pair(settings: StudySettings) -> tuple[dict, dict]:
    p = _Plan(settings)
    return p.moe, p.more
