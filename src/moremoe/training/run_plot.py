"""Figures of pretraining runs from their RUN/log.jsonl: training and validation loss, the
learning rates, the balancing loss and H_norm per layer against the step; one run
(RUN/loss.png, refreshed at each validation) or several overlaid (`moremoe plot`)."""
from __future__ import annotations

import json
from pathlib import Path

from ..report import save_figure

LOG = "log.jsonl"


def read_events(run_dir: str | Path) -> list[dict]:
    """The events of a run's log; a last line cut short by a kill is skipped. ValueError
    naming the folder or file when it holds no log, a line elsewhere is not JSON, or no
    event has a step."""
    path = Path(run_dir) / LOG
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {LOG} (not a `moremoe train` run directory)")
    lines = path.read_text(errors="replace").splitlines()
    events = []
    for n, line in enumerate(lines, 1):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):            # only the last line can be cut short by a kill
                raise ValueError(f"{path}, line {n}: not JSON; the log is corrupt (not "
                                 f"written by `moremoe train`?)") from None
    if not any(isinstance(e, dict) and "step" in e for e in events):
        raise ValueError(f"{path} holds no events of a run yet; plot it once it has logged")
    return events


def _series(events: list[dict], event: str, key: str) -> tuple[list, list]:
    pts = [(e["step"], e[key]) for e in events
           if e.get("event") == event and e.get(key) is not None and "step" in e]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: dict[str, list[dict]], path: str | Path, *, title: str = "") -> Path:
    """runs: name -> events. Four panels; written atomically (a reader never sees half a
    PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, events) in enumerate(runs.items()):
        c = colors[i % len(colors)]
        axes[0].plot(*_series(events, "train", "loss"), color=c, alpha=0.6, label=f"{name} train")
        axes[0].plot(*_series(events, "eval", "val_loss"), color=c, marker="o", linestyle="--",
                     label=f"{name} validation")
        axes[1].plot(*_series(events, "train", "lr"), color=c, label=f"{name} lr")
        steps, router_lr = _series(events, "train", "router_lr")
        if router_lr:
            axes[1].plot(steps, router_lr, color=c, linestyle=":", label=f"{name} router lr")
        axes[2].plot(*_series(events, "train", "aux_loss"), color=c, label=name)
        steps, hnorm = _series(events, "eval", "hnorm")
        layers = len(hnorm[0]) if hnorm else 0
        for layer in range(layers):
            axes[3].plot(steps, [h[layer] for h in hnorm], color=c, marker=".",
                         alpha=0.35 + 0.65 * (layer + 1) / layers,
                         label=f"{name} L{layer}" if layer in (0, layers - 1) else None)
    for ax, ylabel, name in zip(axes, ("loss", "learning rate", "balancing loss", "H_norm"),
                                ("loss", "learning rate", "balancing (aux) loss",
                                 "H_norm per layer (validation)")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=100)


def refresh(run_dir: str | Path) -> str | None:
    """Re-render RUN/loss.png from the log so far; returns the reason when it could not
    (matplotlib missing, a full disk): a figure never stops a run."""
    run_dir = Path(run_dir)
    try:
        plot_runs({run_dir.name: read_events(run_dir)}, run_dir / "loss.png", title=str(run_dir))
    except Exception as err:      # noqa: BLE001 — any failure is reported, training goes on
        return f"{type(err).__name__}: {err}"
    return None
