"""A study's outputs beside its rows: OUT/report.json (study/report.py) and the figures
(study/plots.py)."""
from __future__ import annotations

from pathlib import Path

from ..report import write_json
from . import plots
from .report import study_report


def write_outputs(out, settings, runs, rows, data: dict) -> dict:
    """OUT/report.json and the figures (study/plots.py); returns the report. A figure that
    cannot be drawn (no matplotlib) is named in the report, never fatal."""
    out = Path(out)
    report = study_report(settings, runs, rows, data)
    figures, problems = {}, {}
    by_arm: dict = {}
    for r in runs:
        for exp, arm in r.uses:
            if r.name in rows:
                by_arm.setdefault(exp, {}).setdefault((arm, r.tokens), {})[r.seed] = rows[r.name]
    drawn = {"pair.png": lambda p: plots.plot_pair(report, by_arm.get("pair", {}), p),
             "ablations.png": lambda p: plots.plot_ablations(report, p),
             "paper.png": lambda p: plots.plot_paper(
                 report, {a: v for (a, _), v in by_arm.get("paper", {}).items()}, p)}
    for name, draw in drawn.items():
        if name == "pair.png" and "pair" not in settings.experiments or \
                name == "paper.png" and "paper" not in settings.experiments:
            continue
        try:
            if draw(out / name) is not None:
                figures[name] = str(out / name)
        except Exception as err:      # noqa: BLE001 - a figure never costs the report
            problems[name] = f"{type(err).__name__}: {err}"
    report["figures"], report["figure_problems"] = figures, problems
    write_json(out / "report.json", report)
    return report
