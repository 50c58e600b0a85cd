"""``moremoe demo``: which of a matched-active-FLOP MoE / MoRE pair memorises more, live.

Plans a matched pair small enough to run to the paper's stopping rule on a CPU: h = 32,
s = 8, k = 4, r = 8, one layer, by the paper's convention (the optimum's s' = 7 rounded up
to 8, M' kept): MoE-32 against MoRE-112, 3.5x the experts for 1.06x the active FLOPs (both
printed). Both train, with the same data, seed and learning rate, on a phonebook of 1,024
entries, between what the two can memorise in the demo's 800 epochs, each to the stopping
rule: exact match 0.9, or the epoch limit. A model that reaches 0.9 has memorised the
phonebook; one that does not, has not. That verdict (a capacity comparison, the same on 3
seeds at 1 and 2 threads: tests/test_demo_conclusion.py), the epochs each took and the
exact match each reached are printed beside experts, parameters, FLOPs, H_norm per layer and
the router's time per token, and under them the paper-scale capacities measured by
`moremoe phonebook reproduce` (benchmarks/results/*/phonebook_capacity.jsonl) beside the
paper's. About 2.5 minutes on a 2-core CPU.
"""
from __future__ import annotations

import json
import platform
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .. import accounting
from ..nn.moe import MoEConfig
from ..report import check_new_output, emit, human, table, write_json
from ..runtime import __version__, resolve_device
from .args import _add_json, _positive_float, _positive_int, _seed
from ..phonebook.plots import plot_phonebook_runs

THRESHOLD = 0.9


@dataclass(frozen=True)
class DemoConfig:
    hidden: int = 32
    width: int = 8
    top_k: int = 4
    rank: int = 8
    layers: int = 1
    size: int | None = None          # phonebook entries (default DEFAULT_SIZE)
    max_epochs: float = 800.0        # the stopping rule's epoch limit
    steps: int | None = None         # a step limit instead (checks and tests)
    lr: float = 3e-3
    batch_size: int = 256
    eval_every: int = 40
    seed: int = 0
    device: str = "auto"

    def resolved(self) -> "DemoConfig":
        return replace(self, size=self.size or DEFAULT_SIZE)


DEFAULT_SIZE = 1024


def _models(cfg: DemoConfig):
    from ..phonebook.trainer import phonebook_model_config
    plan = accounting.plan_matched(hidden=cfg.hidden, width=cfg.width, top_k=cfg.top_k,
                                   rank=cfg.rank, round_width=8, refit=False)
    moes = [MoEConfig.moe(plan.moe.experts, cfg.top_k, cfg.hidden, plan.moe.width),
            MoEConfig.more(plan.more.experts, cfg.top_k, cfg.hidden, plan.more.width,
                           cfg.rank)]
    return plan, [phonebook_model_config(m, layers=cfg.layers) for m in moes]


def run_demo(cfg: DemoConfig, *, out_dir: Path, progress: bool = True) -> dict:
    from ..bench.harness import router_seconds_per_token
    from ..nn.moe import MoELayer
    from ..phonebook.trainer import PhonebookTrainConfig
    from ..phonebook.pool import Executor
    from ..phonebook.search import trial
    cfg = cfg.resolved()
    dev = resolve_device(cfg.device)
    plan, models = _models(cfg)
    train_cfg = PhonebookTrainConfig(size=cfg.size, seed=cfg.seed, batch_size=cfg.batch_size,
                                     lr=cfg.lr, max_epochs=cfg.max_epochs, max_steps=cfg.steps,
                                     eval_every=cfg.eval_every, threshold=THRESHOLD,
                                     device=str(dev))
    result = {"command": "demo", "config": asdict(cfg), "plan": plan.to_dict(),
              "device": _device_name(dev), "torch": torch.__version__, "moremoe": __version__,
              "runs": []}
    json_path, png_path = out_dir / "demo.json", out_dir / "demo.png"
    names = [m.moe.name for m in models]
    device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    done = Executor([device], 1 if dev.type == "cpu" else 2, None, progress=progress).run(
        {name: trial(m, train_cfg, name) for name, m in zip(names, models)})
    for name, model in zip(names, models):
        router = MoELayer(model.moe).router.to(dev)
        result["runs"].append({**done[name],
                               "router_seconds_per_token": router_seconds_per_token(router)})
    result["capacities"] = measured_capacities()
    plot_phonebook_runs(result["runs"], png_path, title=f"{names[0]} vs {names[1]}, "
                        f"phonebook of {cfg.size:,} entries")
    result["files"] = {"json": str(json_path), "png": str(png_path)}
    write_json(json_path, result)
    return result


def measured_capacities() -> list[dict]:
    """The newest row of each search and seed in the source tree's committed capacity
    results (benchmarks/results/*/phonebook_capacity.jsonl), when the demo runs from a
    checkout; a finished search's row before any row of it stopped early."""
    root = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
    rows = {}
    for path in sorted(root.glob("*/phonebook_capacity.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                key = (row["name"], row["device"], row.get("seed", 0))
                had = rows.get(key)
                if had is None or had.get("unfinished") or not row.get("unfinished"):
                    rows[key] = row
    return sorted(rows.values(), key=lambda r: (r["hidden"], r["width"], r["rank"] or 0,
                                                r["arch"] != "moe", r["name"],
                                                r.get("seed", 0)))


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _evaluated(run: dict) -> int:
    """Entries the exact match is measured on: eval_entries of the phonebook, or all of a
    smaller phonebook (Phonebook.eval_indices)."""
    return min(run["train"]["size"], run["train"]["eval_entries"])


def _epochs(run: dict) -> float:
    return run["history"][-1]["epoch"] if run["history"] else 0.0


def verdict(result: dict) -> str:
    """Which model memorised the phonebook (reached the threshold) within the epoch limit."""
    moe, more = result["runs"]
    size, limit = result["config"]["size"], _limit(result)
    ratio = more["flops_inference"] / moe["flops_inference"]
    experts = more["model"]["moe"]["experts"] / moe["model"]["moe"]["experts"]
    head = (f"At {ratio:.2f}x the MoE's active FLOPs, {more['name']} holds {experts:.1f}x the "
            f"experts. ")
    fmt = "{name} {verb} (exact match {em:.3f} after {ep:.0f} epochs)"
    words = {True: "memorises it", False: f"does not within {limit}"}

    def say(run):
        return fmt.format(name=run["name"], verb=words[run["reached"]],
                          em=run["exact_match"], ep=_epochs(run))
    if more["reached"] != moe["reached"]:
        winner = more if more["reached"] else moe
        loser = moe if more["reached"] else more
        return (head + f"On a phonebook of {size:,} entries, {say(winner)}; {say(loser)}: "
                f"{winner['name']} memorises more.")
    if more["reached"]:
        return (head + f"Both memorise the {size:,} entries: {say(more)}; {say(moe)}. The "
                f"phonebook is below both capacities: give --size larger to separate them.")
    return (head + f"Neither memorises the {size:,} entries within {limit}: {say(more)}; "
            f"{say(moe)}. Give --size smaller or --max-epochs larger.")


def _limit(result: dict) -> str:
    cfg = result["config"]
    return f"{cfg['steps']:,} steps" if cfg.get("steps") else f"{cfg['max_epochs']:g} epochs"


def _capacity_text(row: dict) -> str:
    return ((">= " if row.get("unfinished") else "")
            + (f"{row['capacity']:,}" if row["capacity"] else "none on grid"))


def capacity_table(rows: list[dict]) -> str:
    """One line a search: its capacity on each seed measured ("k of n seeds" where they
    differ), and on how many seeds it equals the paper's."""
    if not rows:
        return ("\nNo measured paper-scale capacities in this tree: `moremoe phonebook "
                "reproduce` writes them (benchmarks/results/<device>/phonebook_capacity.jsonl).")
    searches: dict[str, list[dict]] = {}
    for r in rows:
        searches.setdefault(r["name"], []).append(r)
    lines = []
    for name, seeds in searches.items():
        n, paper = len(seeds), seeds[0]["paper_capacity"]
        counts = Counter(_capacity_text(r) for r in seeds)     # in the order first seen
        ours = "; ".join(f"{text} ({k} of {n} seed{'s' if n > 1 else ''})"
                         for text, k in counts.items())
        same = sum(r["capacity"] == paper and not r.get("unfinished") for r in seeds)
        where = ", ".join(dict.fromkeys(f"{r['device']}, {r['commit'][:7]}, {r['date'][:10]}"
                                        for r in seeds))
        lines.append([name, f"{paper:,}" if paper else "-", ours,
                      f"{same} of {n}" if paper else "-", where])
    more = ("\n>= : the search is not finished; it reached this size, the next is still to "
            "run." if any(r.get("unfinished") for r in rows) else "")
    return ("\n\nThe paper's capacities (L = 6, up to 1,500 epochs, exact match 0.9), measured "
            "by `moremoe phonebook reproduce` (--seed):\n"
            + table(lines, ["search", "paper", "moremoe", "= paper", "measured on"]) + more)


def format_demo(result: dict) -> str:
    cfg, (moe, more) = result["config"], result["runs"]

    def col(run):
        m = run["model"]["moe"]
        return [m["experts"], m["width"], m["rank"] or "-", human(run["params_total"]),
                f"{run['flops_inference']:,}", f"{run['flops_training']:,}",
                "yes" if run["reached"] else "no", f"{_epochs(run):.0f}",
                f"{run['exact_match']:.3f}", f"{run['char_accuracy']:.3f}",
                " ".join(f"{v:.2f}" for v in run["hnorm"]),
                f"{run['router_seconds_per_token'] * 1e9:.1f} ns", f"{run['seconds']:.0f} s"]
    labels = ["experts M", "expert width s", "router rank r", "total parameters",
              "active FLOPs/token/layer (inference)", "active FLOPs/token/layer (training)",
              f"memorised (exact match >= {THRESHOLD})", "epochs trained",
              f"exact match ({_evaluated(moe):,} entries)", "digit accuracy",
              "H_norm per layer", "router time per token", "training time"]
    rows = [[label, a, b] for label, a, b in zip(labels, col(moe), col(more))]
    head = (f"moremoe demo: does MoRE memorise more? A pair planned at matched active FLOPs "
            f"({result['device']}, torch {result['torch']})\n"
            f"phonebook of {cfg['size']:,} entries, L={cfg['layers']}, h={cfg['hidden']}, "
            f"k={cfg['top_k']}, batch {cfg['batch_size']}, lr {cfg['lr']:g}, same data and "
            f"seed; each trains until exact match {THRESHOLD} or {_limit(result)}\n")
    files = f"\nreport: {result['files']['json']}\nplot:   {result['files']['png']}"
    note = ("\nrouter time: the exact plain-torch routers of 16,384 tokens on this CPU; their "
            "products cost alike (the FLOPs above),\nbut at h = 32 the top-k over each "
            "router's M experts sets the time, and MoRE's M is larger"
            if result["device"].startswith("cpu") else "")
    return (head + table(rows, ["", moe["name"], more["name"]]) + note + "\n\n" + verdict(result)
            + capacity_table(result.get("capacities", [])) + files)


def cmd_demo(args) -> int:
    from ..phonebook.task import NAME_SPACE
    if args.steps is not None and args.max_epochs is not None:
        raise ValueError(f"--steps {args.steps} replaces the epoch limit, so --max-epochs "
                         f"{args.max_epochs:g} would not be read; give one of them")
    if args.size is not None and args.size > NAME_SPACE:
        raise ValueError(f"--size {args.size:,} exceeds the {NAME_SPACE:,} unique five-letter "
                         f"names a phonebook can hold")
    from ..model.checkpoint import check_not_a_run
    out_dir = Path(args.out) if args.out else Path("runs") / "demo"
    check_not_a_run(out_dir, "--out")
    check_new_output(out_dir, "--out", args.force, names=("demo.json", "demo.png"))
    cfg = DemoConfig(device=args.device, size=args.size, steps=args.steps, seed=args.seed,
                     **({"max_epochs": args.max_epochs} if args.max_epochs else {}))
    result = run_demo(cfg, out_dir=out_dir, progress=not args.no_progress)
    emit(args, result, format_demo(result))
    return 0


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job: does MoRE memorise more? a matched pair, live",
                       description="Plan a matched-FLOP MoE/MoRE pair small enough for a CPU "
                       "(h=32, s=8, k=4, r=8, one layer: MoE-32, MoRE-112), train both on the "
                       f"same {DEFAULT_SIZE:,}-entry phonebook to the paper's stopping rule "
                       f"(exact match {THRESHOLD}, or {DemoConfig.max_epochs:g} epochs here) and "
                       "say which memorises it; then the paper-scale capacities measured by "
                       "`moremoe phonebook reproduce` beside the paper's. Uses the GPU when one "
                       "is present; about 2.5 minutes on a 2-core CPU.")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda[:N]")
    p.add_argument("--size", type=_positive_int, default=None,
                   help=f"phonebook entries (default {DEFAULT_SIZE:,})")
    p.add_argument("--max-epochs", type=_positive_float, default=None,
                   help=f"the epoch limit (default {DemoConfig.max_epochs:g}; not with --steps)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="a step limit instead of the epoch limit (quick checks; not with "
                        "--max-epochs)")
    p.add_argument("--seed", type=_seed, default=0, help="phonebook, init and data-order seed")
    p.add_argument("--out", default=None, help="output folder (default runs/demo)")
    p.add_argument("--force", action="store_true",
                   help="replace the demo.json and demo.png of an earlier demo in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_json(p)
    p.set_defaults(func=cmd_demo)
