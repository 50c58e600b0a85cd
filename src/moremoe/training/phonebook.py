"""Training on the phonebook: AdamW, constant schedule with warmup, early stopping, LR
calibration and the capacity search (paper Section 3.2, Appendix C.1).

Optimiser: AdamW (β1 0.9, β2 0.95, weight decay 0.01 on matrices, none on norms), constant
learning rate after a linear warmup over 5 % of the planned steps, batch 1,024. Training
stops early once exact match on 1,000 training entries reaches the threshold (0.9).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from ..checks import UserError, check_fits, gib
from ..eval.phonebook import score
from ..eval.routing import routing_hnorm
from ..model import Transformer, TransformerConfig
from ..nn.moe import MoEConfig
from ..nn.peer import PEERConfig
from ..tasks import phonebook as pb
from ..runtime import autocast_dtype, duration, progress_bar, progress_note, resolve_device
from .optim import make_optimizer

HNORM_SAMPLE = 65_536   # entries used for H_norm at intermediate evaluations


@dataclass(frozen=True)
class PhonebookTrainConfig:
    size: int                               # phonebook entries
    seed: int = 0                           # phonebook, initialisation and data order
    batch_size: int = 1024
    lr: float | None = None                 # None: calibrate over lr_grid
    lr_grid: tuple = (1e-4, 3e-4, 1e-3)
    calibration_steps: int = 200
    max_epochs: float = 1500.0
    max_steps: int | None = None            # overrides max_epochs
    max_minutes: float | None = None        # wall-clock cap
    warmup_frac: float = 0.05
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.95)
    threshold: float = 0.9                  # early stop at this exact match
    eval_every: int = 100                   # steps
    eval_entries: int = 1000
    loss_on: str = "number"
    device: str = "auto"

    def __post_init__(self):
        if self.loss_on not in pb.LOSS_ON:
            raise ValueError(f"loss_on must be one of {pb.LOSS_ON}, got {self.loss_on!r}")
        for name in ("batch_size", "calibration_steps", "eval_every", "eval_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def planned_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.max_epochs * math.ceil(self.size / self.batch_size)))


def phonebook_model_config(moe: MoEConfig, *, layers: int = 6,
                           heads: int | None = None) -> TransformerConfig:
    """A phonebook transformer: V = 40, 16-token sequences, head dim 32 unless heads is given."""
    heads = heads or max(1, moe.hidden // 32)
    return TransformerConfig(vocab=pb.VOCAB_SIZE, layers=layers, heads=heads, moe=moe,
                             max_seq_len=pb.SEQ_LEN)


def training_memory(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig) -> int:
    """Bytes a phonebook run needs at least: fp32 weights, gradients and AdamW's two moments
    (16 a parameter), the phonebook's tokens, and per layer one batch's scores over every
    expert (MoE / MoRE: the (tokens, M) softmax of the balancing loss; PEER: the two
    (tokens, H, sqrt M) key scores), kept for the backward."""
    m = model_cfg.moe
    tokens = min(cfg.batch_size, cfg.size) * pb.SEQ_LEN
    scores = 2 * m.heads * math.isqrt(m.experts) if isinstance(m, PEERConfig) else m.experts
    return (16 * model_cfg.total_params() + 8 * cfg.size * pb.SEQ_LEN
            + 4 * model_cfg.layers * tokens * (scores + 4 * m.hidden))


def check_fits_phonebook(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig) -> None:
    """UserError before any allocation when the run cannot fit on its device."""
    need = training_memory(model_cfg, cfg)
    check_fits(need, f"{model_cfg.moe.label} x {model_cfg.layers} layers "
               f"({model_cfg.total_params():,} parameters, {gib(16 * model_cfg.total_params())}"
               f" with gradients and AdamW's moments) on batches of "
               f"{min(cfg.batch_size, cfg.size):,}",
               "give a smaller model (experts, --hidden, --width, --layers, --top-k, "
               "--peer-heads) or --batch-size", resolve_device(cfg.device))


@dataclass
class PhonebookRun:
    name: str
    model: dict
    train: dict
    lr: float
    params_total: int
    flops_inference: int
    flops_training: int
    calibration: dict = field(default_factory=dict)     # lr -> char accuracy
    history: list = field(default_factory=list)         # one dict per evaluation
    reached: bool = False
    steps: int = 0
    seconds: float = 0.0
    exact_match: float = 0.0
    char_accuracy: float = 0.0
    hnorm: list = field(default_factory=list)           # per layer, whole training set

    def to_dict(self) -> dict:
        return asdict(self)


def _evaluate(model, book_tokens, eval_tokens, *, full: bool, dev, amp) -> dict:
    s = score(model, eval_tokens, device=dev, autocast_dtype=amp)
    tokens = book_tokens
    if not full and tokens.shape[0] > HNORM_SAMPLE:
        tokens = tokens[:HNORM_SAMPLE]  # entries are in random order already
    hnorm = routing_hnorm(model, tokens, device=dev, autocast_dtype=amp)
    return {"exact_match": s.exact_match, "char_accuracy": s.char_accuracy, "hnorm": hnorm}


def train_phonebook(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig, *,
                    progress: bool = True, on_eval: Callable | None = None,
                    desc: str | None = None) -> tuple[PhonebookRun, Transformer]:
    """Train one model on a phonebook; returns the run record and the trained model."""
    dev = resolve_device(cfg.device)
    check_fits_phonebook(model_cfg, cfg)
    amp = autocast_dtype(dev)
    book = pb.Phonebook(cfg.size, cfg.seed)
    tokens = book.tokens()
    eval_tokens = tokens[book.eval_indices(cfg.eval_entries)]
    calibration = {}
    lr = cfg.lr
    if lr is None:
        calibration = calibrate_lr(model_cfg, cfg, progress=progress)
        lr = max(calibration, key=calibration.get)
    name = desc or model_cfg.moe.label
    if calibration:
        progress_note(f"{name}: training with lr {lr:g}, the calibration's best",
                      enabled=progress)
    run = PhonebookRun(name=name, model=model_cfg.to_dict(), train=asdict(cfg), lr=lr,
                       params_total=model_cfg.total_params(),
                       flops_inference=model_cfg.moe.active_flops(),
                       flops_training=model_cfg.moe.active_flops(training=True),
                       calibration={str(k): v for k, v in calibration.items()})
    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg).to(dev)
    opt = make_optimizer(model, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    total = cfg.planned_steps()
    warmup = max(1, round(cfg.warmup_frac * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    order_gen = torch.Generator().manual_seed(cfg.seed + 1)
    steps_per_epoch = math.ceil(cfg.size / cfg.batch_size)
    start, loss_sum, loss_n, perm = time.perf_counter(), 0.0, 0, None
    bar = progress_bar(total, desc=name, enabled=progress)
    step = 0
    for step in range(1, total + 1):
        pos = (step - 1) % steps_per_epoch
        if pos == 0:
            perm = torch.randperm(cfg.size, generator=order_gen)
        batch = tokens[perm[pos * cfg.batch_size:(pos + 1) * cfg.batch_size]].to(dev)
        inputs, targets = pb.inputs_and_targets(batch, cfg.loss_on)
        with torch.autocast(device_type=dev.type, dtype=amp, enabled=amp is not None):
            out = model(inputs, targets)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        loss = out.loss.item()
        if not math.isfinite(loss):        # before the update: the weights stay finite
            raise UserError(f"{name}: step {step}: the loss is {loss:g}; lower the learning "
                            f"rate (--lr {lr:g})")
        opt.step()
        sched.step()
        loss_sum, loss_n = loss_sum + out.lm_loss.item(), loss_n + 1
        bar.update(1)
        timed_out = cfg.max_minutes is not None and \
            time.perf_counter() - start > 60 * cfg.max_minutes
        if step % cfg.eval_every == 0 or step == total or timed_out:
            ev = _evaluate(model, tokens, eval_tokens, full=False, dev=dev, amp=amp)
            run.history.append({"step": step, "epoch": step / steps_per_epoch,
                                "loss": loss_sum / loss_n, "seconds": time.perf_counter() - start,
                                **ev})
            loss_sum, loss_n = 0.0, 0
            bar.set_postfix(loss=f"{run.history[-1]['loss']:.3f}",
                            em=f"{ev['exact_match']:.3f}")
            run.reached = ev["exact_match"] >= cfg.threshold
            if on_eval is not None:
                on_eval(run)
            if run.reached or timed_out:
                break
    bar.close()
    final = _evaluate(model, tokens, eval_tokens, full=True, dev=dev, amp=amp)
    run.steps, run.seconds = step, time.perf_counter() - start
    run.exact_match, run.char_accuracy = final["exact_match"], final["char_accuracy"]
    run.hnorm, run.reached = final["hnorm"], final["exact_match"] >= cfg.threshold
    if on_eval is not None:
        on_eval(run)
    return run, model


def calibrate_lr(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig, *,
                 progress: bool = True) -> dict:
    """Short run per learning rate; returns {lr: char accuracy on the evaluation entries}."""
    name, grid, steps = model_cfg.moe.label, cfg.lr_grid, cfg.calibration_steps
    rates = ", ".join(f"{lr:g}" for lr in grid)
    progress_note(f"{name}: calibrating the learning rate over {rates} ({steps} steps each, "
                  f"{len(grid) * steps:,} in all, before training for at most "
                  f"{cfg.planned_steps():,} steps; --lr skips this)", enabled=progress)
    results, seconds = {}, 0.0
    for i, lr in enumerate(grid, 1):
        short = replace(cfg, lr=lr, max_steps=steps, max_minutes=None,
                        threshold=float("inf"), eval_every=steps)
        run, _ = train_phonebook(model_cfg, short, progress=progress,
                                 desc=f"{name} lr={lr:g} (calibration {i}/{len(grid)})")
        results[lr], seconds = run.char_accuracy, seconds + run.seconds
        more = f"; about {duration(seconds / i * (len(grid) - i))} more" if i < len(grid) else ""
        progress_note(f"{name}: lr {lr:g} gives digit accuracy {run.char_accuracy:.3f} "
                      f"({duration(run.seconds)}){more}", enabled=progress)
    return results


@dataclass
class CapacityResult:
    name: str
    sizes: list
    capacity: int | None                    # largest size that reached the threshold
    trials: list = field(default_factory=list)   # PhonebookRun dicts, in the order run

    def to_dict(self) -> dict:
        return asdict(self)


def capacity_search(model_cfg: TransformerConfig, sizes, cfg: PhonebookTrainConfig, *,
                    progress: bool = True, on_trial: Callable | None = None) -> CapacityResult:
    """Largest phonebook size on the grid whose run reaches the threshold.

    Binary search over the sorted grid, assuming that a model which memorises a phonebook
    also memorises every smaller one (each trial calibrates its own learning rate when
    cfg.lr is None).
    """
    grid = sorted(set(int(s) for s in sizes))
    if not grid or grid[0] < 1:
        raise ValueError(f"sizes must be positive integers, got {sizes!r}")
    result = CapacityResult(name=model_cfg.moe.label, sizes=grid, capacity=None)
    lo, hi = 0, len(grid) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        run, _ = train_phonebook(model_cfg, replace(cfg, size=grid[mid]), progress=progress,
                                 desc=f"{model_cfg.moe.label} size={grid[mid]}")
        result.trials.append(run.to_dict())
        if run.reached:
            result.capacity, lo = grid[mid], mid + 1
        else:
            hi = mid - 1
        if on_trial is not None:
            on_trial(result)
    return result
