"""Training on the phonebook: one run from start to its stopping rule, and the learning-rate
calibration (paper Section 3.2, Appendix C.1). The capacity search and the sweeps, which
run many of these at once, are in search.py and pool.py.

Optimiser: AdamW (β1 0.9, β2 0.95, weight decay 0.01 on matrices, none on norms), constant
learning rate after a linear warmup over 5 % of the planned steps, batch 1,024. Training
stops early once exact match on 1,000 training entries reaches the threshold (0.9).
Evaluations (every eval_every steps) measure exact match and digit accuracy on those
entries, and H_norm per layer from the routing of the training steps since the last
evaluation (counted on the device as they run); the final evaluation measures H_norm as the
paper defines it, over one pass of the whole phonebook through the trained model.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from ..checks import UserError, check_fits, gib
from .score import score
from ..eval.routing import normalized_entropy, routing_hnorm
from ..model import Transformer, TransformerConfig
from ..nn.moe import MoEConfig
from ..nn.peer import PEERConfig
from . import task as pb
from ..runtime import duration, environment, progress_bar, progress_note, resolve_device
from .step import STEP_MODES, PhonebookStep


MAX_STEPS = 2 ** 53          # steps a schedule counts exactly (a float64 holds them)


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
    step: str = "auto"                      # graph (one CUDA graph a step), eager, auto

    def __post_init__(self):
        if self.loss_on not in pb.LOSS_ON:
            raise ValueError(f"loss_on must be one of {pb.LOSS_ON}, got {self.loss_on!r}")
        if self.step not in STEP_MODES:
            raise ValueError(f"step must be one of {STEP_MODES}, got {self.step!r}")
        for name in ("batch_size", "calibration_steps", "eval_every", "eval_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.calibration_steps > MAX_STEPS:
            raise ValueError(f"--calibration-steps {self.calibration_steps:,} is more than "
                             f"{MAX_STEPS:,} (2^53), the most steps a schedule counts exactly; "
                             f"give fewer")
        if self.planned_steps() > MAX_STEPS:
            how = ("--max-steps" if self.max_steps is not None else
                   f"--max-epochs {self.max_epochs:g} of {self.size:,} entries in batches of "
                   f"{self.rows:,}")
            raise ValueError(f"the run would last {self.planned_steps():.3g} steps ({how}), "
                             f"more than {MAX_STEPS:,} (2^53), the most a schedule counts "
                             f"exactly; give fewer")

    @property
    def rows(self) -> int:
        """Entries a batch holds: batch_size, or the whole of a smaller phonebook."""
        return min(self.batch_size, self.size)

    def planned_steps(self) -> int:
        """max_steps, else the steps of max_epochs passes over the phonebook."""
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.max_epochs * self.size / self.rows))

    def experiment(self) -> dict:
        """What decides a run's result (not where or how it is computed): the key of a
        finished run that a resumed search reuses."""
        d = asdict(self)
        for name in ("device", "step", "max_minutes"):
            d.pop(name)
        return d


def default_heads(hidden: int) -> int:
    """The attention heads of a phonebook transformer when none are given: head dim 32."""
    return max(1, hidden // 32)


def phonebook_model_config(moe: MoEConfig, *, layers: int = 6,
                           heads: int | None = None) -> TransformerConfig:
    """A phonebook transformer: V = 40, 16-token sequences, head dim 32 unless heads is given."""
    heads = heads or default_heads(moe.hidden)
    return TransformerConfig(vocab=pb.VOCAB_SIZE, layers=layers, heads=heads, moe=moe,
                             max_seq_len=pb.SEQ_LEN)


def training_memory(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig) -> int:
    """Bytes a phonebook run needs at least: fp32 weights, gradients and AdamW's two moments
    (16 a parameter), the phonebook's tokens, and per layer one batch's scores over every
    expert (MoE / MoRE: the (tokens, M) softmax of the balancing loss; PEER: the two
    (tokens, H, sqrt M) key scores), kept for the backward."""
    m = model_cfg.moe
    tokens = cfg.rows * pb.SEQ_LEN
    scores = 2 * m.heads * math.isqrt(m.experts) if isinstance(m, PEERConfig) else m.experts
    return (16 * model_cfg.total_params() + 8 * cfg.size * pb.SEQ_LEN
            + 4 * model_cfg.layers * tokens * (scores + 4 * m.hidden))


def check_fits_phonebook(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig) -> None:
    """UserError before any allocation when the run cannot fit on its device."""
    need = training_memory(model_cfg, cfg)
    check_fits(need, f"{model_cfg.moe.label} x {model_cfg.layers} layers "
               f"({model_cfg.total_params():,} parameters, {gib(16 * model_cfg.total_params())}"
               f" with gradients and AdamW's moments) on batches of "
               f"{cfg.rows:,}",
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
    hnorm: list = field(default_factory=list)           # per layer, whole phonebook
    step_mode: str = ""                                 # graph or eager
    diverged_at: int = 0                                # first step whose loss was not finite
    resumed_at: int = 0                                 # step a resume continued from
    env: dict = field(default_factory=dict)             # where it ended (runtime.environment)

    def to_dict(self) -> dict:
        return asdict(self)


def _evaluate(step: PhonebookStep, *, full: bool) -> dict:
    """Exact match and digit accuracy on the evaluation entries; H_norm per layer over the
    whole phonebook (full) or from the training steps' routing since the last read."""
    with step.on_stream():
        s = score(step.model, step.eval_tokens, device=step.device, autocast_dtype=step.amp)
        got = step.read()
        if full:
            hnorm = routing_hnorm(step.model, step.tokens_PS, device=step.device,
                                  autocast_dtype=step.amp)
        else:
            hnorm = [normalized_entropy(c) for c in got["counts"]]
    return {"exact_match": s.exact_match, "char_accuracy": s.char_accuracy, "hnorm": hnorm,
            "loss": got["loss"], "first_bad": got["first_bad"]}


class PhonebookTrainer:
    """One run (its record, its step, its stopping rule), moved on one evaluation interval
    at a time: advance() queues the interval's steps and returns at once, settle() waits for
    them, evaluates and says whether the run has ended. Several trainers on their own CUDA
    streams share a GPU this way (pool.py); train_phonebook alternates the two."""

    def __init__(self, model_cfg: TransformerConfig, cfg: PhonebookTrainConfig, lr: float, *,
                 name: str, calibration: dict | None = None,
                 stream: torch.cuda.Stream | None = None, state: dict | None = None):
        self.cfg = cfg
        dev = resolve_device(cfg.device)
        check_fits_phonebook(model_cfg, cfg)
        self.step = PhonebookStep(model_cfg, cfg, lr, device=dev, mode=cfg.step, stream=stream)
        self.run = PhonebookRun(
            name=name, model=model_cfg.to_dict(), train=asdict(cfg), lr=lr,
            params_total=model_cfg.total_params(), flops_inference=model_cfg.moe.active_flops(),
            flops_training=model_cfg.moe.active_flops(training=True),
            calibration={str(k): v for k, v in (calibration or {}).items()},
            step_mode=self.step.mode)
        self.total = cfg.planned_steps()
        self.done = False
        self._elapsed, self._t0 = 0.0, time.perf_counter()
        if state is not None:
            self.step.load_state_dict(state["step"])
            self.run = PhonebookRun(**{**state["run"], "resumed_at": self.step.steps})
            self._elapsed = self.run.seconds

    @property
    def seconds(self) -> float:
        return self._elapsed + time.perf_counter() - self._t0

    def advance(self, stop: Callable[[], bool] | None = None) -> None:
        """Queue the steps up to the next evaluation (or the last step); on the CPU, fewer
        once stop() says so (PhonebookStep.run)."""
        every = self.cfg.eval_every
        self.step.run(min(every - self.step.steps % every, self.total - self.step.steps), stop)

    def settle(self) -> bool:
        """Wait for the queued steps, evaluate, apply the stopping rule; True once ended."""
        cfg, run, steps = self.cfg, self.run, self.step.steps
        ev = _evaluate(self.step, full=False)
        run.history.append({"step": steps, "epoch": steps * cfg.rows / cfg.size,
                            "loss": ev["loss"], "seconds": self.seconds,
                            "exact_match": ev["exact_match"],
                            "char_accuracy": ev["char_accuracy"], "hnorm": ev["hnorm"]})
        run.steps, run.seconds = steps, self.seconds
        run.reached = ev["exact_match"] >= cfg.threshold
        run.diverged_at = run.diverged_at or ev["first_bad"]
        timed_out = cfg.max_minutes is not None and self.seconds > 60 * cfg.max_minutes
        if run.reached or steps >= self.total or timed_out or run.diverged_at:
            self._finish()
        return self.done

    def _finish(self) -> None:
        final = _evaluate(self.step, full=True)
        run = self.run
        run.exact_match, run.char_accuracy = final["exact_match"], final["char_accuracy"]
        run.hnorm, run.reached = final["hnorm"], final["exact_match"] >= self.cfg.threshold
        run.seconds = self.seconds
        run.env = environment(self.step.device)
        self.done = True

    def state_dict(self) -> dict:
        """The run's record and step state (at a settle): what a resume continues from."""
        self.run.seconds = self.seconds
        return {"step": self.step.state_dict(), "run": self.run.to_dict()}


def train_phonebook(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig, *,
                    progress: bool = True, on_eval: Callable | None = None,
                    desc: str | None = None) -> tuple[PhonebookRun, Transformer]:
    """Train one model on a phonebook (calibrating the learning rate first when cfg.lr is
    None); returns the run record and the trained model. A step whose loss is not finite
    is a UserError (the update it would have made is skipped, the weights stay finite)."""
    calibration, lr = {}, cfg.lr
    name = desc or model_cfg.moe.label
    if lr is None:
        calibration = calibrate_lr(model_cfg, cfg, progress=progress)
        lr = max(calibration, key=calibration.get)
        progress_note(f"{name}: training with lr {lr:g}, the calibration's best",
                      enabled=progress)
    trainer = PhonebookTrainer(model_cfg, cfg, lr, name=name, calibration=calibration)
    bar = progress_bar(trainer.total, desc=name, enabled=progress)
    while not trainer.done:
        before = trainer.step.steps
        trainer.advance()
        trainer.settle()
        bar.update(trainer.step.steps - before)
        last = trainer.run.history[-1]
        bar.set_postfix(loss=f"{last['loss']:.3f}", em=f"{last['exact_match']:.3f}")
        if on_eval is not None:
            on_eval(trainer.run)
    bar.close()
    if trainer.run.diverged_at:
        raise UserError(f"{name}: step {trainer.run.diverged_at}: the loss is not finite; "
                        f"lower the learning rate (--lr {lr:g})")
    return trainer.run, trainer.step.model


def calibration_config(cfg: PhonebookTrainConfig, lr: float) -> PhonebookTrainConfig:
    """The short run that scores one learning rate: calibration_steps steps, no early stop,
    one evaluation at the end."""
    return replace(cfg, lr=lr, max_steps=cfg.calibration_steps, max_minutes=None,
                   threshold=float("inf"), eval_every=cfg.calibration_steps)


def calibrate_lr(model_cfg: TransformerConfig, cfg: PhonebookTrainConfig, *,
                 progress: bool = True) -> dict:
    """Short run per learning rate; returns {lr: char accuracy on the evaluation entries}
    (a rate whose loss stops being finite scores what its run reached before)."""
    name, grid, steps = model_cfg.moe.label, cfg.lr_grid, cfg.calibration_steps
    rates = ", ".join(f"{lr:g}" for lr in grid)
    progress_note(f"{name}: calibrating the learning rate over {rates} ({steps} steps each, "
                  f"{len(grid) * steps:,} in all, before training for at most "
                  f"{cfg.planned_steps():,} steps; --lr skips this)", enabled=progress)
    results, seconds = {}, 0.0
    for i, lr in enumerate(grid, 1):
        trainer = PhonebookTrainer(model_cfg, calibration_config(cfg, lr),
                                   lr, name=f"{name} lr={lr:g} (calibration {i}/{len(grid)})")
        while not trainer.done:
            trainer.advance()
            trainer.settle()
        run = trainer.run
        results[lr], seconds = run.char_accuracy, seconds + run.seconds
        more = f"; about {duration(seconds / i * (len(grid) - i))} more" if i < len(grid) else ""
        progress_note(f"{name}: lr {lr:g} gives digit accuracy {run.char_accuracy:.3f} "
                      f"({duration(run.seconds)}){more}", enabled=progress)
    return results
