"""Typed configuration of a pretraining run: ModelSpec, OptimSpec, TrainSpec and RunConfig.

The schema only: every key is checked against the dataclass fields and coerced to the
field's type; unknown keys and wrong types are errors that name the key and what was
expected. training/compose.py builds a run from a preset, a YAML file and --set overrides.
"""
from __future__ import annotations

import difflib
import math
import types
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields
from typing import Union, get_args, get_origin, get_type_hints

from ..accounting import LayerShape, layer_name
from ..checks import check_int
from ..model import TransformerConfig
from ..nn.moe import MoEConfig
from ..nn.peer import PEERConfig
from ..nn.router import ROUTER_INITS
from ..parallel.ddp import REDUCE_DTYPES
from ..parallel.fsdp import DATA_MODES
from ..parallel.plan import CUDA_GRAPH_MODES
from ..tasks.tokenizer import VOCAB_SIZE

KINDS = ("moe", "more", "peer")
FP32_MAX = 3.4028234663852886e38      # the optimizer's rates and factors are fp32 on the device
SEED_LIMIT = 2 ** 63 - 2              # torch's generators take 64-bit seeds; + 1 for a second
MOMENTS = ("fp32", "bf16")
UPDATES = ("auto", "fused")     # training/optim.py's choices
EXPERT_GRADS = ("auto", "autograd", "in_place")
GRAD_DTYPES = ("fp32", "bf16")
SECTIONS = ("model", "optim", "train", "parallel")


@dataclass(frozen=True)
class ModelSpec:
    """The transformer: MoE (standard router) or MoRE (rank-r router) in every block."""

    kind: str = "moe"                 # "moe" | "more"
    hidden: int = 512                 # h
    layers: int = 12                  # L
    heads: int = 8
    kv_heads: int | None = None       # None: = heads
    experts: int = 256                # M
    width: int = 64                   # s
    top_k: int = 4                    # k
    rank: int | None = None           # r, MoRE only
    seq_len: int = 1024               # T, tokens per training sequence
    vocab: int | None = VOCAB_SIZE    # GPT-2's; None: the data's vocab_size (meta.json)
    balance_coef: float = 0.001
    router_impl: str = "auto"         # "auto" | "triton" | "reference"
    experts_impl: str = "auto"
    router_init: str = "variance_matched"   # MoRE only: | "default" (the init ablation)
    peer_heads: int = 8               # PEER only (kind "peer"): H query networks,
    peer_dq: int = 32                 # the query size d_q,
    peer_kappa: int = 56              # the top kappa per head (k = H kappa)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"model.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "more" and self.rank is None:
            raise ValueError("model.rank must be set (e.g. 64) when model.kind='more'")
        if self.kind in ("moe", "peer") and self.rank is not None:
            raise ValueError(f"model.rank must be null when model.kind={self.kind!r}, got "
                             f"{self.rank}")
        try:                          # the layer's shape is checked in one place
            if self.kind == "peer":
                self.moe_config()
            else:
                LayerShape(self.experts, self.top_k, self.hidden, self.width, self.rank)
        except (TypeError, ValueError) as err:
            raise type(err)(f"model.{err}") from None
        if self.router_init not in ROUTER_INITS:
            raise ValueError(f"model.router_init must be one of {ROUTER_INITS}, got "
                             f"{self.router_init!r}")
        default = ModelSpec.__dataclass_fields__
        for key, kind in (("peer_heads", "peer"), ("peer_dq", "peer"), ("peer_kappa", "peer"),
                          ("router_init", "more")):
            if self.kind != kind and getattr(self, key) != default[key].default:
                raise ValueError(f"model.{key} is read by model.kind={kind} only, and this "
                                 f"model is model.kind={self.kind}; drop it")
        if self.seq_len < 2:
            raise ValueError(f"model.seq_len must be >= 2, got {self.seq_len}")
        if not 0 <= self.balance_coef < math.inf:
            raise ValueError(f"model.balance_coef must be a finite number >= 0, got "
                             f"{self.balance_coef}")
        self._check_attention()
        try:      # the rest as the model checks it (layers, the impls, vocab), before any data
            self.transformer_config(VOCAB_SIZE)
        except (TypeError, ValueError) as err:
            raise type(err)(f"model.{err}") from None

    def _check_attention(self) -> None:
        """The heads in this spec's keys: TransformerConfig checks them too, but names a
        head_dim that a spec does not have."""
        check_int("model.heads", self.heads)
        if self.kv_heads is not None:
            check_int("model.kv_heads", self.kv_heads, high=self.heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"model.kv_heads must divide model.heads={self.heads}, got "
                                 f"{self.kv_heads}")
        if self.hidden % self.heads:
            raise ValueError(f"model.heads must divide model.hidden={self.hidden}, got "
                             f"{self.heads}")
        if self.hidden // self.heads % 2:
            raise ValueError(f"model.hidden / model.heads = {self.hidden // self.heads} (the "
                             f"head dim) must be even for rotary positions; choose another "
                             f"model.heads")

    @property
    def name(self) -> str:
        return f"PEER-{self.experts}" if self.kind == "peer" else layer_name(self.experts,
                                                                            self.rank)

    def moe_config(self) -> MoEConfig | PEERConfig:
        if self.kind == "peer":
            return PEERConfig(experts=self.experts, hidden=self.hidden, heads=self.peer_heads,
                              d_q=self.peer_dq, kappa=self.peer_kappa,
                              impl=self.experts_impl)
        return MoEConfig(experts=self.experts, top_k=self.top_k, hidden=self.hidden,
                         width=self.width, rank=self.rank, balance_coef=self.balance_coef,
                         router_impl=self.router_impl, experts_impl=self.experts_impl,
                         router_init=self.router_init)

    def transformer_config(self, vocab: int | None = None) -> TransformerConfig:
        """The model config; ``vocab`` fills in model.vocab = null (from the data)."""
        v = self.vocab if self.vocab is not None else vocab
        if v is None:
            raise ValueError("model.vocab is null (take it from the data) but no data "
                             "vocab_size was given")
        return TransformerConfig(vocab=v, layers=self.layers, heads=self.heads,
                                 moe=self.moe_config(), kv_heads=self.kv_heads,
                                 max_seq_len=self.seq_len)


@dataclass(frozen=True)
class OptimSpec:
    """AdamW with a cosine schedule after a linear warmup (paper Appendix C.2)."""

    lr: float = 1e-3
    router_lr: float | None = None    # None: = lr (the paper's choice)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01        # on matrices; none on norm scales
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.0          # the cosine ends at min_lr_frac · lr
    clip: float = 1.0                 # max global grad norm; 0 = no clipping
    moments: str = "fp32"             # AdamW's two moments: "fp32" (torch's AdamW) or "bf16"
                                      # (fp32 master weights, 4 bytes of state a parameter
                                      # instead of 8; on a GPU the tensors under 2^22
                                      # elements keep fp32 ones; training/optim.py)
    expert_grads: str = "auto"        # "in_place": the fused expert backward adds the weight
                                      # gradients into .grad across micro-steps (one process,
                                      # DDP, expert shards; not FSDP2 of whole experts;
                                      # nn/experts.py); "auto": in_place there with fp32
                                      # grads, else autograd
    update: str = "auto"              # on a GPU: "auto" updates tensors of 2^22 elements
                                      # or more by the one-pass Triton kernel (their moments
                                      # in optim.moments) and the rest by torch's fused AdamW
                                      # (the faster of the two by size, measured); "fused":
                                      # torch's for all (bf16 moments: one pass a tensor)
    grads: str = "fp32"               # the parameters' .grad: "fp32", or "bf16" (2 bytes a
                                      # parameter; micro-steps accumulate in bf16; one
                                      # process, with moments=bf16; training/optim.py)

    def __post_init__(self):
        for name in ("lr", "eps"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"optim.{name} must be a finite number > 0, got "
                                 f"{getattr(self, name)}")
        if self.router_lr is not None and not 0 < self.router_lr < math.inf:
            raise ValueError(f"optim.router_lr must be a finite number > 0 or null, got "
                             f"{self.router_lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be in [0, 1), got {self.betas}")
        for name in ("warmup_frac", "min_lr_frac"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"optim.{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("weight_decay", "clip"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"optim.{name} must be a finite number >= 0, got "
                                 f"{getattr(self, name)}")
        for name in ("lr", "router_lr", "eps", "weight_decay", "clip"):
            if (getattr(self, name) or 0) > FP32_MAX:      # the update's scalars are fp32
                raise ValueError(f"optim.{name} must be at most fp32's largest number, "
                                 f"3.4e38, got {getattr(self, name)}")
        if self.moments not in MOMENTS:
            raise ValueError(f"optim.moments must be one of {', '.join(MOMENTS)}, got "
                             f"{self.moments!r}")
        if self.update not in UPDATES:
            raise ValueError(f"optim.update must be one of {', '.join(UPDATES)}, got "
                             f"{self.update!r}")
        if self.expert_grads not in EXPERT_GRADS:
            raise ValueError(f"optim.expert_grads must be one of {', '.join(EXPERT_GRADS)}, "
                             f"got {self.expert_grads!r}")
        if self.grads not in GRAD_DTYPES:
            raise ValueError(f"optim.grads must be one of {', '.join(GRAD_DTYPES)}, got "
                             f"{self.grads!r}")
        if self.grads == "bf16" and (self.moments != "bf16" or self.expert_grads == "in_place"):
            raise ValueError("optim.grads=bf16 needs optim.moments=bf16 (the update that reads "
                             "bf16 gradients) and optim.expert_grads=auto or autograd (the "
                             "in-place banks keep fp32 buffers)")


# CUDA-graph modes: the trainer marks each micro-step and keeps the gradients allocated, so
# no .grad is a backward graph's output that the next replay overwrites (pytorch #169545)
COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs") + CUDA_GRAPH_MODES
COMPILE_SCOPES = ("blocks", "model")
NAN_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class TrainSpec:
    """Data, batch, budget, evaluation, logging and checkpointing."""

    data: str | None = None           # prepared data directory (moremoe data prepare)
    batch_size: int = 8               # sequences per device and micro-step
    grad_accum: int = 1               # micro-steps per optimizer step
    max_steps: int | None = None      # schedule length in optimizer steps, or
    max_tokens: int | None = None     # ... in tokens (steps = tokens / global batch tokens)
    stop_step: int | None = None      # stop early at this step; the schedule is unchanged
    max_minutes: float | None = None  # wall-clock budget: stop, checkpoint, report
    eval_every: int = 500             # steps between validations (and at the end)
    eval_batches: int = 8             # validation batches per rank (rows: × batch_size × world)
    log_every: int = 10               # steps between log lines (and a process's first step)
    ckpt_every: int = 1000
    keep: int = 2                     # checkpoints kept in out/checkpoints
    save_on_stop: bool = True         # checkpoint when the run stops (budget, signal)
    timing_warmup: int = 5            # first steps of a process left out of step times
    profile_steps: int = 0            # > 0: torch.profiler over that many steps after the
                                      # warm-up; the table goes to out/profile.txt
    seed: int = 0                     # initialisation and data order
    out: str | None = None            # run directory; None: runs/train/<preset or config>
    device: str = "auto"              # "auto" | "cpu" | "cuda[:N]"
    autocast: bool = True             # bf16 autocast on CUDA (always off on CPU)
    compile: bool = False             # torch.compile (what: compile_scope)
    compile_mode: str = "default"     # torch.compile's mode (reduce-overhead: CUDA graphs);
                                      # "auto": reduce-overhead on a GPU, one process or
                                      # DDP; default under FSDP2, expert parallelism, CPU
    compile_scope: str = "blocks"     # "blocks": each block (one graph they share) and the
                                      # loss; "model": the whole model as one graph
    tensorboard: bool = False         # also write TensorBoard events to out/tb
    peak_tflops: float | None = None  # per-GPU peak for MFU; None: known device or no MFU
    nan_policy: str = "stop"          # a NaN/inf loss or grad norm: "stop" (before updating,
                                      # checkpointing the last finite step) or "skip" the update
    nan_skip_limit: int = 10          # "skip": stop after this many non-finite steps in a row
    activation_checkpointing: bool = False  # recompute each block's activations in the
                                      # backward: only the blocks' inputs stay saved
    fused_loss: bool = False          # the output head and the loss in chunks of tokens,
                                      # the (tokens, vocab) logits never stored
                                      # (ops/linear_ce.py)

    def __post_init__(self):
        for name, instead in (("data", "a folder from `moremoe data prepare`"),
                              ("out", "or leave it out for runs/train/<preset>")):
            v = getattr(self, name)           # pathlib reads "" as the current folder
            if v is not None and not v.strip():
                raise ValueError(f"train.{name} must be a non-empty path ({instead}), got "
                                 f"{v!r}")
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"train.nan_policy must be one of {', '.join(NAN_POLICIES)}, got "
                             f"{self.nan_policy!r}")
        for name in ("batch_size", "grad_accum", "eval_every", "eval_batches", "log_every",
                     "ckpt_every", "keep", "nan_skip_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "stop_step"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"train.{name} must be >= 1 or null, got {v}")
        for name in ("timing_warmup", "profile_steps", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.seed > SEED_LIMIT:
            raise ValueError(f"train.seed must be at most 2^63 - 2 (torch's generators take "
                             f"64-bit seeds), got {self.seed}")
        for name in ("max_minutes", "peak_tflops"):
            v = getattr(self, name)
            if v is not None and not 0 < v < math.inf:
                raise ValueError(f"train.{name} must be a finite number > 0 or null, got {v}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"train.compile_mode must be one of {', '.join(COMPILE_MODES)}, "
                             f"got {self.compile_mode!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"train.compile_scope must be one of {', '.join(COMPILE_SCOPES)}, "
                             f"got {self.compile_scope!r}")


@dataclass(frozen=True)
class ParallelSpec:
    """How the ranks of a torchrun launch share the model (one process: ignored)."""

    data: str = "ddp"                 # "ddp": every rank holds the whole model; "fsdp":
                                      # FSDP2, parameters, gradients and AdamW states sharded
                                      # (with expert > 1: all but the expert shards)
    expert: int = 1                   # E: ranks that share each layer's experts (M/E each,
                                      # parallel/expert_plan.py); E must divide M and the
                                      # ranks, which form ranks/E data-parallel groups
    bucket_mb: float = 25.0           # DDP's gradient buckets (MB): each is all-reduced once
                                      # its gradients are ready, overlapping the backward;
                                      # under torch.compile each compiled graph ends where a
                                      # bucket ends (chosen by benchmarks/ddp_gpu.sh)
    reduce_dtype: str = "fp32"        # DDP's gradient all-reduce: "fp32", or "bf16" (half
                                      # the bytes; the average rounded to bf16, fp32 kept)

    def __post_init__(self):
        if self.data not in DATA_MODES:
            raise ValueError(f"parallel.data must be one of {', '.join(DATA_MODES)}, got "
                             f"{self.data!r}")
        if self.expert < 1:
            raise ValueError(f"parallel.expert must be >= 1 (1: no expert parallelism), got "
                             f"{self.expert}")
        if not 0 < self.bucket_mb < math.inf:
            raise ValueError(f"parallel.bucket_mb must be a finite number > 0, got "
                             f"{self.bucket_mb}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"parallel.reduce_dtype must be one of "
                             f"{', '.join(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.reduce_dtype != "fp32" and self.data == "fsdp":
            raise ValueError(f"parallel.reduce_dtype={self.reduce_dtype} is DDP's (a comm "
                             f"hook); FSDP2 reduce-scatters in fp32: use parallel.data=ddp "
                             f"or parallel.reduce_dtype=fp32")


# Keys whose values are names from a list: a value of the wrong type names the list too
CHOICES = {"parallel.data": DATA_MODES, "parallel.reduce_dtype": REDUCE_DTYPES,
           "optim.moments": MOMENTS, "optim.expert_grads": EXPERT_GRADS,
           "optim.grads": GRAD_DTYPES, "optim.update": UPDATES}


# Fields a resumed run may change: budget, logging, hardware and where things live. The
# batch split may change too as long as the global batch stays (checked by the sampler).
RESUMABLE = {"train": {"data", "batch_size", "grad_accum", "max_steps", "max_tokens",
                       "stop_step", "max_minutes", "eval_every", "eval_batches", "log_every",
                       "ckpt_every", "keep", "save_on_stop", "timing_warmup", "profile_steps",
                       "out", "device", "compile", "compile_mode", "compile_scope",
                       "tensorboard", "peak_tflops", "nan_policy", "nan_skip_limit",
                       "activation_checkpointing", "fused_loss"},
             "model": {"router_impl", "experts_impl"},
             # gradients: not part of the saved state; update: the same state either way
             "optim": {"expert_grads", "grads", "update"},
             # checkpoints hold the whole state, any layout; a resumed run may reduce in
             # another dtype or bucket size (it then follows another rounding of the average)
             "parallel": {"data", "expert", "bucket_mb", "reduce_dtype"}}


@dataclass(frozen=True)
class RunConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    preset: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        d = dict(d)
        unknown(d, ("preset",) + SECTIONS, "")
        parts = {}
        for name, spec in zip(SECTIONS, (ModelSpec, OptimSpec, TrainSpec, ParallelSpec)):
            parts[name] = build_spec(spec, d.get(name) or {}, name)
        preset = d.get("preset")
        if preset is not None and not isinstance(preset, str):
            raise TypeError(f"preset must be a string, got {preset!r}")
        return cls(preset=preset, **parts)

    def differences(self, other: "RunConfig") -> list[str]:
        """'section.key: old -> new' for every field that a resumed run may not change."""
        a, b = self.to_dict(), other.to_dict()
        out = []
        for section in SECTIONS:
            for key, old in a[section].items():
                new = b[section][key]
                if old != new and key not in RESUMABLE.get(section, ()):
                    out.append(f"{section}.{key}: {old!r} -> {new!r}")
        return out


def unknown(d: dict, known, where: str) -> None:
    """Raise on the first key of d that is not in known, suggesting the closest one."""
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            raise KeyError(f"unknown config key '{where}{key}'{hint} (known: "
                           f"{', '.join(where + k for k in known)})")


def build_spec(cls, values: dict, section: str):
    """cls(**values) with every key checked and coerced to its annotated type."""
    if not isinstance(values, dict):
        raise TypeError(f"{section} must be a mapping of keys to values, got {values!r}")
    hints = get_type_hints(cls)
    unknown(values, [f.name for f in fields(cls)], f"{section}.")
    kw = {k: coerce(f"{section}.{k}", v, hints[k]) for k, v in values.items()}
    return cls(**kw)


def _type_name(tp) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        return f"a list of {len(get_args(tp))} numbers"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number",
            str: "a string"}.get(tp, str(tp))


def coerce(key: str, value, tp):
    """value as type tp (int, float, str, bool, X | None, tuple[float, ...]) or TypeError."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return coerce(key, value, inner[0]) if len(inner) == 1 else value
    expected = (f"one of {', '.join(CHOICES[key])}" if key in CHOICES else _type_name(tp))
    bad = TypeError(f"{key} must be {expected}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad
    if isinstance(value, bool):
        raise bad
    if tp is int:
        return _as_int(key, value, bad)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if tp is str and isinstance(value, str):
        return value
    raise bad


INT_LIMIT = 2 ** 63 - 1        # every integer key is a 64-bit integer downstream (torch)


def _as_int(key: str, value, bad) -> int:
    if isinstance(value, int):
        v = value
    else:
        try:
            f = float(value)                      # "40e9", 1e6
        except (TypeError, ValueError):
            raise bad from None
        if not f.is_integer():
            raise bad
        v = int(f)
    if abs(v) > INT_LIMIT:
        raise TypeError(f"{key} must be a 64-bit integer (at most 2^63 - 1), got {value!r}")
    return v


def planned_steps(cfg: RunConfig, global_batch: int) -> int:
    t = cfg.train
    if t.max_steps is not None:
        return t.max_steps
    if t.max_tokens is not None:
        return max(1, math.ceil(t.max_tokens / (global_batch * cfg.model.seq_len)))
    raise ValueError("set train.max_steps or train.max_tokens (the schedule's length)")


def default_out(cfg: RunConfig) -> str:
    return str(Path("runs") / "train" / (cfg.preset or "run"))


def check_impls(model: ModelSpec, device) -> None:
    """model.router_impl / experts_impl = "triton" on a device the kernels cannot run on (a
    CPU without TRITON_INTERPRET=1, or no Triton): ValueError naming the key."""
    from .. import kernels
    for key in ("router_impl", "experts_impl"):
        if getattr(model, key) == "triton" and not kernels.usable_on(device):
            raise ValueError(f"model.{key}=triton needs Triton and a CUDA GPU (or "
                             f"TRITON_INTERPRET=1 on a CPU); this run's device is {device}: "
                             f"use auto (the kernels where they run) or reference")
