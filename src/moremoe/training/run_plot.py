"""Figures of pretraining runs from their RUN/log.jsonl: training and validation loss, the
learning rates, the balancing loss and H_norm per layer against the step; one run
(RUN/loss.png, refreshed at each validation) or several overlaid (`moremoe plot`)."""
from __future__ import annotations

import json
from pathlib import Path

from ..report import save_figure

LOG = "log.jsonl"
NUMBERS = ("loss", "val_loss", "lr", "router_lr", "aux_loss")     # the plotted series


def read_events(run_dir: str | Path) -> list[dict]:
    """The events of a run's log; a last line cut short by a kill is skipped. ValueError
    naming the folder or file, and the line and field, when it holds no log, a line
    elsewhere is not JSON or not an event the figure can draw (_check_event), or no event
    has a step: all before anything is drawn."""
    path = Path(run_dir) / LOG
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {LOG} (not a `moremoe train` run directory)")
    lines = path.read_text(errors="replace").splitlines()
    events, layers = [], None             # layers: (line, H_norm count) of the first eval
    for n, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if n < len(lines):            # only the last line can be cut short by a kill
                raise ValueError(f"{path}, line {n}: not JSON; the log is corrupt (not "
                                 f"written by `moremoe train`?)") from None
            continue
        _check_event(event, f"{path}, line {n}")
        if event.get("event") == "eval" and event.get("hnorm") is not None:
            layers = layers or (n, len(event["hnorm"]))
            if len(event["hnorm"]) != layers[1]:
                raise ValueError(f"{path}, line {n}: hnorm has {len(event['hnorm'])} layers "
                                 f"where line {layers[0]} has {layers[1]}; one log holds one "
                                 f"model (not written by `moremoe train`?)")
        events.append(event)
    if not any("step" in e for e in events):
        raise ValueError(f"{path} holds no events of a run yet; plot it once it has logged")
    return events


def _check_event(event, where: str) -> None:
    """A line the figure can draw: a JSON object whose step is an integer >= 0, plotted
    series numbers or null, hnorm a list of numbers (H_norm per layer) or null."""
    def shown(v) -> str:
        return json.dumps(v)[:40]

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if not isinstance(event, dict):
        raise ValueError(f"{where}: expected a JSON object (one event), got {shown(event)}; "
                         f"the log is corrupt (not written by `moremoe train`?)")
    step = event.get("step", 0)
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ValueError(f"{where}: step must be an integer >= 0, got {shown(step)}")
    for key in NUMBERS:
        if event.get(key) is not None and not number(event[key]):
            raise ValueError(f"{where}: {key} must be a number or null, got "
                             f"{shown(event[key])}")
    hnorm = event.get("hnorm")
    if hnorm is not None and not (isinstance(hnorm, list) and all(map(number, hnorm))):
        raise ValueError(f"{where}: hnorm must be a list of numbers (H_norm per layer) or "
                         f"null, got {shown(hnorm)}")


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
