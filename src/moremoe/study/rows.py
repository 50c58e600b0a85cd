"""A study's results: OUT/rows.jsonl, one row per finished run, and the learning rates the
selection runs chose.

A row is everything the report and a reader need, so it outlives the run's folder (whose
checkpoints do not leave a GPU machine): the model, its parameters and FLOPs, the learning
rates, the seed, the tokens, tokens per parameter and epochs, the validation loss at every
fixed mark (each eval_every steps, and the end), H_norm per layer, the time, the device,
versions and commit, and the data's and corpus's fingerprints. Rows are appended one line at
a time (the last row of a run wins), so a study killed between runs loses none.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..report import dumps
from ..training.run_plot import read_events

ROWS = "rows.jsonl"


def read_rows(out: str | Path) -> dict[str, dict]:
    """The rows of a study by run name (a later row of a run replaces an earlier one); a
    last line cut short by a kill is skipped. ValueError naming the line otherwise."""
    path = Path(out) / ROWS
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    rows = {}
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue
            raise ValueError(f"{path}, line {n}: not JSON; the file is corrupt (restore it "
                             f"from where it was committed)") from None
        problem = row_problem(row)
        if problem:
            raise ValueError(f"{path}, line {n}: not a study row of this version ({problem}): "
                             f"the file was edited; restore it from where it was committed, "
                             f"or delete the line (its run trains again)")
        rows[row["run"]] = row
    return rows


_NUMBER = (int, float)
_MAYBE = (int, float, type(None))        # a loss that was not finite is null (strict JSON)
# what the report and the next command read of a row, and of each of its evaluations
ROW = {"run": str, "kind": str, "config": str, "model": dict, "seed": int, "lr": _NUMBER,
       "budget": int, "tokens": int, "params": int, "val_loss": _MAYBE,
       "val_ppl": _MAYBE, "evals": list, "tokens_per_param": _NUMBER, "epochs": _NUMBER,
       "wall_s": _NUMBER, "data": dict}
EVAL = {"step": int, "tokens": int, "val_loss": _MAYBE}
# a run that diverged (a non-finite loss or gradient stopped it): its row says where, and
# counts as no result (a selection candidate that lost; no seed of its arm)
DIVERGED = {"run": str, "kind": str, "config": str, "model": dict, "seed": int,
            "lr": _NUMBER, "budget": int, "diverged": int, "val_loss": type(None),
            "evals": list, "data": dict}


def row_problem(row) -> str | None:
    """What is missing or of the wrong type in a study row (None when it reads)."""
    if not isinstance(row, dict):
        return "not an object"
    fields = DIVERGED if "diverged" in row else ROW
    for fields, where in ((fields, row), *((EVAL, e) for e in row.get("evals") or ())):
        if not isinstance(where, dict):
            return "an evaluation is not an object"
        for key, types in fields.items():
            if key not in where:
                return f"no {key!r}"
            if not isinstance(where[key], types) or isinstance(where[key], bool):
                return f"{key!r} is {json.dumps(where[key])[:40]}"
    return None


def append_row(out: str | Path, row: dict) -> None:
    """One row at the end of OUT/rows.jsonl, synced; a last line a kill cut short (which
    read_rows skips) is ended first, so that this row stays a line of its own."""
    path = Path(out) / ROWS
    with open(path, "a+b") as f:
        cut = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        f.write((("\n" if cut else "") + dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def finished_summary(run_dir: Path) -> dict | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("finished") else None


def run_row(run, run_dir: Path, summary: dict, *, lr: float, router_lr: float,
            eval_every: int, val_sequences: int, layer_flops: int) -> dict:
    """The row of a finished run from its summary and log (module docstring)."""
    events = read_events(run_dir)
    per_step = summary["global_batch"] * summary["seq_len"]
    evals = {}
    for e in events:            # the fixed marks, and the end (a stop between marks: not)
        if e.get("event") == "eval" and (e["step"] % eval_every == 0
                                         or e["step"] == summary["step"]):
            evals[e["step"]] = {"step": e["step"], "tokens": e["step"] * per_step,
                                "val_loss": e["val_loss"], "val_ppl": e["val_ppl"]}
    ends = [e for e in events if e.get("event") == "end"]
    return {
        "run": run.name, "kind": run.kind, "config": run.config, "model": run.model,
        "name": summary["name"], "seed": run.seed, "lr": lr, "router_lr": router_lr,
        "router_lr_factor": run.router_lr_factor, "budget": run.tokens,
        "tokens": summary["tokens"], "steps": summary["step"], "params": summary["params"],
        "layer_flops_inference": layer_flops, "train_flops_per_token":
            summary["flops_per_token"], "tokens_per_param": summary["tokens_per_param"],
        "epochs": summary["epochs"], "val_loss": summary["val_loss"],
        "val_ppl": summary["val_ppl"], "val_sequences": val_sequences,
        "evals": [evals[k] for k in sorted(evals)], "hnorm": summary["hnorm"],
        "expert_coverage": summary["expert_coverage"],
        "wall_s": sum(e.get("wall_s") or 0 for e in ends), "processes": len(ends),
        "tokens_per_s": summary["tokens_per_s"], "mean_step_ms": summary["mean_step_ms"],
        "mfu": summary["mfu"], "peak_memory_gib": summary["peak_memory_gib"],
        "data": summary["data"],
        **{k: summary.get(f"env_{k}") for k in ("device", "torch", "triton", "commit",
                                                "date")}}


def diverged_at(run_dir: Path) -> int | None:
    """The step at which a non-finite loss or gradient stopped the run in run_dir (its
    log's last "nonfinite" event under train.nan_policy=stop, or a skip limit reached), or
    None when it did not stop so."""
    events = [e for e in read_events(run_dir) if e.get("event") in ("nonfinite", "train",
                                                                      "resume")]
    last = events[-1] if events else {}
    return last["step"] if last.get("event") == "nonfinite" and isinstance(
        last.get("step"), int) else None


def diverged_row(run, lr: float, step: int, run_dir: Path, *, tokens_per_step: int,
                 data: dict) -> dict:
    """The row of a run that diverged at `step`: where, the evaluations before it, and
    where it ran (the device of its log's start, this machine's versions and commit)."""
    import torch
    from ..runtime import environment
    events = read_events(run_dir)
    start = next((e for e in reversed(events) if e.get("event") == "start"), {})
    device = torch.device("cuda" if str(start.get("device", "")).startswith("cuda")
                          else "cpu")
    evals = [{"step": e["step"], "tokens": e["step"] * tokens_per_step,
              "val_loss": e["val_loss"], "val_ppl": e["val_ppl"]}
             for e in events if e.get("event") == "eval"]
    return {"run": run.name, "kind": run.kind, "config": run.config, "model": run.model,
            "seed": run.seed, "lr": lr, "router_lr_factor": run.router_lr_factor,
            "budget": run.tokens, "diverged": step, "tokens": step * tokens_per_step,
            "params": start.get("params"), "val_loss": None, "val_ppl": None,
            "evals": evals, "data": data, **environment(device)}


def _selection(rows: dict[str, dict], runs, config: str) -> list | None:
    """The selection runs of `config` once each has its row; None before."""
    mine = [r for r in runs if r.kind == "lr" and r.uses[0][1] == config]
    if not mine or any(r.name not in rows for r in mine):
        return None
    return mine


def chosen_lr(rows: dict[str, dict], runs, config: str) -> float | None:
    """The rate the selection runs of `config` chose (lowest final validation loss; a
    candidate that diverged loses), once every one of them has its row; None before, and
    None when every candidate diverged (no_lr)."""
    mine = _selection(rows, runs, config)
    trained = [r for r in mine or () if rows[r.name]["val_loss"] is not None]
    return min(trained, key=lambda r: rows[r.name]["val_loss"]).lr if trained else None


def no_lr(rows: dict[str, dict], runs, config: str) -> bool:
    """Every selection run of `config` has its row and every one diverged."""
    mine = _selection(rows, runs, config)
    return bool(mine) and all(rows[r.name]["val_loss"] is None for r in mine)
