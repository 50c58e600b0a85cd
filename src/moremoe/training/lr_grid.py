"""The paper's learning-rate selection for pretraining: a short run per candidate rate, the
one with the lowest validation loss kept for the full run.

Each candidate trains for `grid_steps` steps in RUN/lr-grid/lr_<rate>/ (a run directory of
its own: log, loss.png, checkpoints); a candidate that already finished there with the same
settings is read back, not trained again, so a resumed job does not redo its grid.
RUN/lr_grid.json records every candidate's validation loss and the choice.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..report import dumps, write_json
from .config import RunConfig
from .lm import train


def _grid_config(cfg: RunConfig, lr: float, steps: int, out: Path) -> RunConfig:
    t = cfg.train
    return replace(cfg, optim=replace(cfg.optim, lr=lr),
                   train=replace(t, out=str(out), max_steps=steps, stop_step=None,
                                 eval_every=min(t.eval_every, steps)))


def _finished(out: Path, cfg: RunConfig) -> dict | None:
    """The summary of a finished candidate run with these settings, else None."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if summary.get("finished") and saved == json.loads(dumps(cfg.to_dict())):
        return summary
    return None


def select_lr(cfg: RunConfig, lrs: list[float], grid_steps: int, *, echo=None) -> dict:
    """Train each candidate (or read its finished run) and pick the lowest validation loss;
    returns {"candidates": [...], "lr": best} and writes it to RUN/lr_grid.json."""
    if not lrs:
        raise ValueError("--lr-grid needs at least one learning rate")
    root = Path(cfg.train.out) / "lr-grid"
    rows = []
    for lr in lrs:
        out = root / f"lr_{lr:g}"
        run_cfg = _grid_config(cfg, lr, grid_steps, out)
        summary = _finished(out, run_cfg)
        if summary is None:
            if echo:
                echo(f"lr grid: {lr:g} for {grid_steps} steps in {out}")
            summary = train(run_cfg, resume=True, echo=echo)
        if summary.get("val_loss") is None:
            raise ValueError(f"the lr-grid run {out} has no validation loss: the data has no "
                             f"validation rows (moremoe data prepare --val-sequences N)")
        rows.append({"lr": lr, "val_loss": summary["val_loss"], "out": str(out),
                     "stopped": summary.get("stopped")})
    best = min(rows, key=lambda r: r["val_loss"])
    result = {"grid_steps": grid_steps, "candidates": rows, "lr": best["lr"]}
    write_json(Path(cfg.train.out) / "lr_grid.json", result)
    if echo:
        echo("lr grid: " + ", ".join(f"{r['lr']:g} -> {r['val_loss']:.4f}" for r in rows)
             + f"; training with lr {best['lr']:g}")
    return result
