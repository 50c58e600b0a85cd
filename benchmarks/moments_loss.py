"""The loss with bf16 AdamW moments against fp32 ones: the same preset, data, seed and
schedule trained twice (optim.moments=fp32, then bf16), and with --grads a third time with
bf16 gradients too (optim.grads=bf16), the train and validation curves side by side in one
JSON and one plot.

    PYTHONPATH=src:tests python benchmarks/moments_loss.py OUT_DIR [--preset tiny-more]
        [--data DIR (default: the tests' prose, byte-level)] [--set key=value ...] [--reuse]
    python benchmarks/moments_loss.py --replot OUT_DIR/moments_loss.json

Prints the mean |Δ loss| over the logged steps, the last validation losses and the
run-to-run spread of two fp32 runs with different data seeds for scale (--noise); with
--autograd a run whose expert weight gradients go through autograd instead of the in-place
banks (the two should agree within the GPU's run-to-run bits)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moremoe.training.compose import build_run_config
from moremoe.training.lm import train


def _events(out: Path) -> list[dict]:
    log = out / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def _run(out: Path, preset: str, data: str, sets: list[str], reuse: bool = False) -> dict:
    events = _events(out) if reuse else []
    if not any(e["event"] == "end" for e in events):       # not a run that ended: train it
        cfg = build_run_config(preset=preset, overrides=sets, data=data, out=str(out))
        train(cfg, force=True, echo=lambda text: None)
        events = _events(out)
    return {"train": [(e["step"], e["loss"]) for e in events if e["event"] == "train"],
            "val": [(e["step"], e["val_loss"]) for e in events if e["event"] == "eval"]}


def _gap(a: list, b: list) -> float:
    pairs = [(x[1], y[1]) for x, y in zip(a, b) if x[1] is not None and y[1] is not None]
    return sum(abs(x - y) for x, y in pairs) / max(1, len(pairs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", help="the runs, moments_loss.json and .png")
    ap.add_argument("--replot", metavar="JSON",
                    help="draw the plot again from a moments_loss.json (no training)")
    ap.add_argument("--preset", default="tiny-more")
    ap.add_argument("--data")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--noise", action="store_true", help="also an fp32 run on another seed")
    ap.add_argument("--grads", action="store_true",
                    help="also bf16 gradients with the bf16 moments (optim.grads=bf16)")
    ap.add_argument("--autograd", action="store_true",
                    help="also fp32 moments and gradients with the experts' weight gradients "
                         "through autograd, not the in-place banks "
                         "(optim.expert_grads=autograd)")
    ap.add_argument("--reuse", action="store_true",
                    help="read a run whose OUT/<run>/log.jsonl ended instead of training it "
                         "again (the runs split over several calls)")
    a = ap.parse_args()
    if a.replot:
        replot(Path(a.replot))
        return
    if a.out is None:
        ap.error("give OUT_DIR (or --replot JSON)")
    out = Path(a.out)
    data = a.data
    if data is None:
        from prepared import write_token_dir
        data = str(write_token_dir(out / "data"))
    runs = {m: _run(out / m, a.preset, data, a.set + [f"optim.moments={m}"], a.reuse)
            for m in ("fp32", "bf16")}
    if a.noise:
        runs["fp32_seed1"] = _run(out / "fp32_seed1", a.preset, data,
                                  a.set + ["optim.moments=fp32", "train.seed=1"], a.reuse)
    if a.grads:
        runs["bf16_grads"] = _run(out / "bf16_grads", a.preset, data,
                                  a.set + ["optim.moments=bf16", "optim.grads=bf16"], a.reuse)
    if a.autograd:
        runs["fp32_autograd"] = _run(out / "fp32_autograd", a.preset, data,
                                     a.set + ["optim.moments=fp32",
                                              "optim.expert_grads=autograd"], a.reuse)
    summary = {"preset": a.preset, "sets": a.set,
               "mean_abs_train_gap_bf16": _gap(runs["fp32"]["train"], runs["bf16"]["train"]),
               "last_val": {k: r["val"][-1][1] for k, r in runs.items()}}
    if a.grads:
        summary["mean_abs_train_gap_bf16_grads"] = _gap(runs["fp32"]["train"],
                                                        runs["bf16_grads"]["train"])
    if a.autograd:
        summary["mean_abs_train_gap_autograd"] = _gap(runs["fp32"]["train"],
                                                      runs["fp32_autograd"]["train"])
    if a.noise:
        summary["mean_abs_train_gap_seed"] = _gap(runs["fp32"]["train"],
                                                  runs["fp32_seed1"]["train"])
    (out / "moments_loss.json").write_text(json.dumps({**summary, "runs": runs}, indent=1))
    print(json.dumps(summary))
    _plot(runs, out / "moments_loss.png", a.preset)


def _plot(runs: dict, path: Path, title: str) -> None:
    """Left: the curves; right: each run's train loss minus the fp32 run's at the same step
    (the seed's line is the noise the others are read against)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 4))
    base = dict(runs["fp32"]["train"])
    for name, r in runs.items():
        line, = ax.plot(*zip(*r["train"]), label=f"train, {name}")
        ax.plot(*zip(*r["val"]), "o--", color=line.get_color(), label=f"val, {name}")
        if name != "fp32":
            d = [(s, v - base[s]) for s, v in r["train"] if s in base and v is not None]
            dx.plot(*zip(*d), color=line.get_color(), label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: AdamW moments fp32 vs bf16")
    ax.legend(fontsize=7)
    dx.axhline(0, color="black", lw=0.5)
    dx.set_xlabel("step")
    dx.set_ylabel("train loss minus the fp32 run's")
    dx.set_title("against fp32 moments, same seed (fp32_seed1: another seed)")
    dx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(path: Path) -> None:
    """The plot again from a moments_loss.json (no training)."""
    saved = json.loads(path.read_text())
    _plot(saved["runs"], path.with_suffix(".png"), saved["preset"])


if __name__ == "__main__":
    main()
