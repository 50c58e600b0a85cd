"""``moremoe phonebook reproduce``: the paper's phonebook capacity experiments with the paper's
protocol (moremoe.phonebook.paper), every search at once over the GPUs given, the
rows and the figures in the paper's layout with the paper's values beside ours."""
from __future__ import annotations

import json
from pathlib import Path

from ..report import table
from .args import (EPILOG, SEED_MAX, _add_json, _distinct, _fraction, _int_list,
                   _positive_float, _positive_int, _seed)
from .phonebook_run import (add_execution_args, capacity_text, devices, execute, finish,
                            outputs)

ROWS = "phonebook_capacity.jsonl"


def _points(text: str) -> list[str]:
    import argparse
    from ..phonebook.paper import POINTS
    known = [*POINTS, "rank"]
    keys = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in keys if k not in known]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"expected points among {', '.join(known)}, got "
                                         f"{text!r}")
    return _distinct(keys, text)


def _ranks(text: str) -> list:
    import argparse
    from ..phonebook.paper import RANKS
    known = ["moe", *map(str, RANKS)]
    keys = [k.strip().lower() for k in text.split(",") if k.strip()]
    bad = [k for k in keys if k not in known]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"expected ranks among {', '.join(known)}, got "
                                         f"{text!r}")
    return [k if k == "moe" else int(k) for k in _distinct(keys, text)]


def _seeds(text: str) -> list[int]:
    import argparse
    try:
        seeds = [_seed(t.strip()) for t in text.split(",") if t.strip()] or [_seed(text)]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a seed or comma-separated seeds in "
                                         f"[0, {SEED_MAX}] like 1,2, got {text!r}") from None
    return _distinct(seeds, text)


def _train_config(args):
    from ..phonebook.trainer import PhonebookTrainConfig
    return PhonebookTrainConfig(size=args.grid[0], seed=args.seed[0], max_epochs=args.max_epochs,
                                threshold=args.threshold, eval_every=args.eval_every,
                                calibration_steps=args.calibration_steps, device=args.device,
                                step=args.step)


def _row_keys(row: dict) -> tuple:
    """(the search on its device, the same as far as an unfinished row went)."""
    where = (row.get("search"), row.get("device"))
    return where, (*where, row.get("capacity"), len(row.get("trials", [])))


def _append_rows(path: Path, rows: list[dict]) -> int:
    """Append the rows a results file lacks: a finished search once per device; a stopped
    one (its capacity a lower bound) while no finished row of it is there, once for each
    point it reached. Returns how many were added."""
    finished, partial = set(), set()
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                where, went = _row_keys(row)
                (partial.add(went) if row.get("unfinished") else finished.add(where))
    new = [r for r in rows if _row_keys(r)[0] not in finished
           and not (r.get("unfinished") and _row_keys(r)[1] in partial)]
    if new:
        from ..report import dumps
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.writelines(dumps(r) + "\n" for r in new)
    return len(new)


def _failed_starts(runs: list, report: dict) -> list[dict]:
    """The rank searches (on each seed) that did not memorise their start: its trial ended
    below the threshold (the rank figure draws them below that size)."""
    out = []
    for run, got in zip(runs, report["searches"]):
        s = run.search
        start = next((t for t in got["trials"] if t["train"]["size"] == s.start), None)
        if s.point == "rank" and s.arch == "more" and got["capacity"] is None \
                and start is not None and not start["reached"]:
            out.append({"rank": s.model.moe.rank, "size": s.start, "seed": run.cfg.seed,
                        "exact_match": start["exact_match"], "stopped": False,
                        "epoch": start["steps"] * start["train"]["batch_size"] / s.start})
    return out


def _check_rows_file(path: Path) -> None:
    """--rows names a file this command can append to: none yet, empty, or rows of
    `phonebook reproduce` (checked before any training, not after it)."""
    from ..bench.harness import read_jsonl
    from ..report import check_output_file
    check_output_file(path, "--rows")
    if not path.is_file() or not path.stat().st_size:
        return
    try:
        rows = read_jsonl(path)
    except ValueError as err:
        raise ValueError(f"--rows {err}: not a phonebook capacity rows file; give another "
                         f"file") from None
    bad = [i for i, r in enumerate(rows, 1) if not {"search", "capacity", "device"} <= set(r)]
    if bad:
        raise ValueError(f"--rows {path}: {len(bad)} of its {len(rows)} rows (the first: row "
                         f"{bad[0]}) are not rows of `phonebook reproduce`; give another file")


def _check_first_trials_fit(found: list, args, cfg) -> None:
    """Each search's first trials (its start and the --ahead sizes above it) fit on the
    device, checked before anything in --out is touched: a refusal after --force cleared the
    earlier work would lose it for nothing. A larger size a search reaches later is checked
    when it trains."""
    from dataclasses import replace

    from ..runtime import resolve_device
    from ..phonebook.trainer import check_fits_phonebook
    for dev in {str(resolve_device(d)) for d in devices(args)}:
        for s in found:
            for size in [n for n in args.grid if n >= s.start][:1 + args.ahead]:
                check_fits_phonebook(s.model, replace(cfg, size=size, device=dev))


def cmd_phonebook_reproduce(args) -> int:
    from ..runtime import environment, resolve_device
    from ..phonebook import paper
    from ..phonebook.search import unfinished
    from ..phonebook.paper_plots import plot_rank_figure, plot_reproduction
    if args.ranks is not None and "rank" not in args.points:
        raise ValueError("--ranks chooses among the rank point's searches: add rank to "
                         "--points, or drop --ranks")
    if args.rows is not None:
        _check_rows_file(Path(args.rows))
    # --rows naming OUT's rows file makes it the user's: appended to at the end, as --rows
    # is, never rewritten with this run's rows alone
    own_rows = args.rows is not None and args.out is not None and \
        Path(args.rows).resolve() == (Path(args.out) / ROWS).resolve()
    writes = ([] if own_rows else [ROWS]) + (["rank.png"] if "rank" in args.points else [])
    cfg = _train_config(args)
    found = [s for s in paper.searches(args.points, args.ranks)
             if args.arch in ("both", s.arch)]
    runs = paper.seeded(found, cfg, args.seed)
    _check_first_trials_fit(found, args, cfg)     # before --force clears the earlier work
    json_path, png_path = outputs(args, "phonebook-reproduce", "reproduce", writes)
    rank_png, rows_path = json_path.parent / "rank.png", json_path.parent / ROWS
    partial = {}
    report = {"command": "phonebook reproduce", "points": args.points, "arch": args.arch,
              "grid": args.grid,
              "train": cfg.experiment(), "seeds": args.seed, "searches": [], "rows": [],
              "files": {"json": str(json_path), "png": str(png_path), "rank": str(rank_png),
                        "rows": str(rows_path)}}
    env = environment(resolve_device(args.device))

    def noted(name):
        return lambda result: partial.__setitem__(name, result.to_dict())

    def render(results, in_round):
        report["searches"] = [
            {"name": r.label, "point": r.search.point, "arch": r.search.arch,
             "paper": r.search.paper, "seed": r.cfg.seed,
             **(results[r.label].to_dict() if r.label in results else
                unfinished(r.label, partial.get(r.label), in_round.get(r.label, [])))}
            for r in runs]
        # a stopped search that reached a size gives a row too: its capacity a lower bound
        report["rows"] = [paper.capacity_row(r.search, got, args.grid, r.cfg, env)
                          for r, got in ((r, results[r.label].to_dict() if r.label in results
                                          else report["searches"][i])
                                         for i, r in enumerate(runs))
                          if got["capacity"] is not None or r.label in results]
        if not own_rows:
            from ..report import dumps, write_atomic
            write_atomic(rows_path, "".join(dumps(r) + "\n" for r in report["rows"]).encode())
        plot_reproduction(report["rows"], png_path)
        if "rank" in args.points:
            plot_rank_figure(report["rows"], rank_png, _failed_starts(runs, report))
    ex = execute(args, paper.plans(runs, args.grid, noted, ahead=args.ahead), json_path,
                 report, render)
    if args.rows is not None:
        report["rows_appended"] = _append_rows(Path(args.rows), report["rows"])
    lines = [[s["name"], f"{s['paper']:,}" if s["paper"] else "-",
              capacity_text(s),
              ", ".join(f"{t['train']['size']:,}: {t['exact_match']:.2f}" for t in
                        sorted(s["trials"], key=lambda t: t["train"]["size"])),
              "unfinished" if s.get("unfinished") else "done"] for s in report["searches"]]
    text = (table(lines, ["search", "paper", "moremoe", "trials (size: exact match)", ""])
            + f"\nreport: {json_path}\nrows:   {rows_path}\nplots:  {png_path}"
            + (f", {rank_png}" if "rank" in args.points else ""))
    return finish(args, ex, report, text)


def add_reproduce_parser(psub) -> None:
    from ..phonebook.paper import DEFAULT_POINTS, PAPER_GRID, POINTS
    p = psub.add_parser(
        "reproduce", epilog=EPILOG, help="the paper's phonebook capacities, measured",
        description="The paper's phonebook capacity experiments with its protocol (learning "
        "rate calibrated over 1e-4, 3e-4, 1e-3 on 200 steps; batch 1,024; constant rate after "
        "a 5 % warmup; up to 1,500 epochs; stop at exact match 0.9 on 1,000 training "
        "entries; L = 6, k = 4, r = 16): for each point, the largest phonebook size on the "
        "grid the MoE and the matched MoRE memorise, each search starting at the paper's "
        "value. Every search runs at once, several runs on each GPU, over every GPU. Writes "
        "OUT/reproduce.json, OUT/phonebook_capacity.jsonl (one row per search: a stopped one "
        "that reached a size too, marked unfinished, its capacity a lower bound), "
        "OUT/reproduce.png (capacity against h and s, the paper's values beside ours) and, "
        "with the rank point, OUT/rank.png; an OUT that holds one of them already is "
        "refused unless --force (start afresh) or --resume. Long: --stop-after and --resume carry it over several "
        "sessions.")
    p.add_argument("--points", type=_points, default=list(DEFAULT_POINTS),
                   help=f"dot pairs to measure, among {', '.join(POINTS)}, and rank (MoRE-192 "
                        f"at r = 4, 8, 16, 32 beside MoE-192, h = 128, s = 8) (default "
                        f"{','.join(DEFAULT_POINTS)})")
    p.add_argument("--arch", choices=("moe", "more", "both"), default="both",
                   help="the MoE searches, the MoRE ones, or both (default)")
    p.add_argument("--ranks", type=_ranks, default=None,
                   help="with the rank point, which of its searches: moe and ranks among "
                        "4, 8, 16, 32 (default all; r = 16 is the h128-s8 dot's MoRE-192, and "
                        "the rank figure takes that row when the rank point has none)")
    p.add_argument("--ahead", type=int, choices=(0, 1, 2), default=1,
                   help="sizes above the start trained at the same time as it (default 1: "
                        "the next size up; 0 trains the start alone first, which gives each "
                        "run more of the GPU when the device time is short)")
    p.add_argument("--grid", type=_int_list, default=list(PAPER_GRID),
                   help="phonebook sizes (default: the paper's reported capacities and 3,000)")
    p.add_argument("--seed", type=_seeds, default=[0],
                   help="phonebook, init and data-order seed (default 0); several, like 1,2, "
                        "run every search on each seed at once, sharing the GPUs' streams "
                        "(each row records its seed; the demo's table counts them)")
    p.add_argument("--max-epochs", type=_positive_float, default=1500.0)
    p.add_argument("--threshold", type=_fraction, default=0.9,
                   help="the exact match a trial must reach, in (0, 1] (default 0.9, the "
                        "paper's)")
    p.add_argument("--calibration-steps", type=_positive_int, default=200)
    p.add_argument("--eval-every", type=_positive_int, default=100,
                   help="steps between evaluations (default 100)")
    p.add_argument("--rows", default=None,
                   help="also append the finished searches' rows to this JSON-lines file "
                        "(those it lacks: same search, same device), e.g. "
                        "benchmarks/results/<device>/phonebook_capacity.jsonl; naming "
                        "OUT/phonebook_capacity.jsonl makes that file this one: appended to, "
                        "never rewritten")
    add_execution_args(p)
    _add_json(p)
    p.set_defaults(func=cmd_phonebook_reproduce)
