"""The ``moremoe bench`` commands: thin parsing over ``moremoe.bench``."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..checks import UserError
from .args import _add_json, _distinct, _int_at_least, _int_list
from .bench_points import EXPERT_SHAPES, expert_points
from ..report import check_output_file, table
from ..report import emit as _emit
from ..runtime import eta_text


def _bench_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        pt = f"h={r['h']} M={r['M']} r={r['r']} k={r['k']} B={r['B']}"
        name = ("MoRE" if r["router"] == "lowrank" else "MoE") + (
            {"triton": " fused", "alg1": " Alg. 1"}.get(r["impl"], " unfused")) + _config(r)
        ms = _value(r)
        floor = f"{r['floor_ms']:.3f}" if r.get("floor_ms") else "-"
        ratio = f"{r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else "-"
        mem = f"{r['peak_bytes'] / 2 ** 20:,.0f}" if r.get("peak_bytes") is not None else "-"
        vs = [f"{r[key]:.2f}x" if r.get(key) else "-"
              for key in ("speedup_vs_unfused", "speedup_vs_alg1")]
        out.append([r["sweep"], pt, name, r["phase"], ms, floor, ratio, *vs, mem])
    return table(out, ["sweep", "point", "router", "phase", "ms", "floor ms", "/floor",
                       "vs unfused", "vs Alg. 1", "peak MiB"])


def _plot_only(args, name: str, render) -> int:
    """Render the plots of an existing results file, refusing one that holds no rows or
    rows of another benchmark (harness.read_rows_of); --json prints the plots' paths."""
    from ..bench import harness
    path = args.plot_only
    rows = harness.read_rows_of(path, name, "--plot-only")
    if render is None:
        raise ValueError(f"--plot-only {path}: `moremoe bench {name}` draws no plots; its "
                         f"rows are the results")
    try:
        paths = render(rows, Path(path).parent)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"--plot-only {path}: cannot plot these rows of `moremoe bench "
                         f"{name}` ({type(err).__name__}: {err})") from err
    if not paths:
        raise ValueError(f"--plot-only {path}: nothing to plot in its {len(rows)} rows of "
                         f"`moremoe bench {name}`")
    _emit(args, {"plots": [str(p) for p in paths], "rows": len(rows), "file": str(path)},
          "\n".join(str(p) for p in paths))
    return 0


def _run_bench(args, name: str, runner, render) -> int:
    """Measure with runner, append each row to benchmarks/results/<device>/<name>.jsonl as
    it lands, render the plots beside it, print a table (or JSON)."""
    if args.plot_only:
        return _plot_only(args, name, render)
    import torch
    from ..bench import harness
    from ..kernels import HAS_TRITON, INTERPRET
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    out = check_output_file(Path(args.out) if args.out else (
        Path("benchmarks/results") / harness.device_slug(device) / f"{name}.jsonl"), "--out")
    if out.is_file() and out.stat().st_size:    # rows are appended: never to another's file
        harness.read_rows_of(out, name, "--out")
    if not HAS_TRITON or not (cuda or (args.quick and INTERPRET)):
        raise UserError(f"bench {name} needs Triton and a CUDA GPU (or --quick with "
                         f"TRITON_INTERPRET=1 for a code-path check on the CPU)")
    rows, start = [], time.monotonic()

    def progress(i, n, row):
        if args.no_progress:
            return
        ms = "OOM" if row.get("oom") else row.get("error") or (
            f"{row['ms']:.3f} ms" if row.get("ms") is not None
            else f"{(row.get('peak_bytes') or 0) / 2**20:,.0f} MiB")
        point = " ".join(f"{k}={row[k]}" for k in ("h", "M", "r", "s", "k", "B") if k in row)
        what = row.get("variant") or row.get("router") or row.get("model")
        print(f"[{i}/{n}] {row.get('sweep', name)} {what}/{row.get('impl', '')} "
              f"{row.get('phase', '')} {point}: {ms} "
              f"({eta_text(i, n, time.monotonic() - start)})", file=sys.stderr, flush=True)

    for row in runner(device, progress=progress, **args.runner_kwargs):
        rows.append(row)
        harness.append_jsonl(out, [row])
    all_rows = harness.read_jsonl(out)               # this run's and earlier runs' rows
    paths = render(all_rows, out.parent) if render else []
    extra = args.summarize(all_rows) if args.summarize else ""
    _emit(args, {"rows": rows, "file": str(out), "plots": [str(p) for p in paths]},
          args.table(rows) + extra + f"\nrows: {out}\nplots: " + ", ".join(map(str, paths)))
    return 0


def _layer_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        val = (_value(r, "{:.3f} ms") if r.get("ms") is not None or r.get("oom")
               or r.get("error") else f"{(r.get('peak_bytes') or 0) / 2**20:,.0f} MiB")
        ratio = f"{r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else "-"
        design = (f"{r['ratio_to_design_floor']:.1f}x" if r.get("ratio_to_design_floor")
                  else "-")
        out.append([r.get("sweep", r["bench"]), r["variant"] + _config(r), r.get("phase", ""),
                    f"h={r['h']} M={r['M']} s={r['s']} N={r['N']}", val, ratio, design])
    return table(out, ["sweep", "variant", "phase", "point", "value", "/floor", "/design"])


def _matched(rows):
    from ..bench.layer import matched_wallclock
    from ..bench.layer_summary import layer_text
    m = matched_wallclock(rows)
    if not m or m["more_M"] is None:
        return layer_text(rows)
    return layer_text(rows) + (
        f"\nmatched wall-clock at h={m['h']}: MoE M=512 takes {m['moe_ms']:.2f} ms; MoRE "
        f"fits M={m['more_M']} ({m['ratio']:.0f}x the experts) in that time")


def _decode_summary(rows):
    from ..bench.layer_summary import decode_text
    return decode_text(rows)


# the sweeps of `bench layer` (moremoe.bench.layer.LAYER_SWEEPS; named here so --help does
# not import torch)
LAYER_SWEEPS = ("grid", "wide_s", "match", "memory")


def _router_sweeps(text: str) -> list[str]:
    from ..bench.router import SWEEP_NAMES
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in SWEEP_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown sweep(s) {', '.join(bad) or repr(text)}; "
                                         f"expected a comma list of {', '.join(SWEEP_NAMES)}")
    return _distinct(names, text)


def _config(r: dict) -> str:
    """' [BM=64 C=0: 0.95x default]' for a row of a tuning sweep, else ''."""
    if "config" not in r:
        return ""
    text = " ".join(f"{k}={v}" for k, v in r["config"].items()) or "default"
    if r["config"] and r.get("speedup_vs_default"):
        text += f": {r['speedup_vs_default']:.2f}x default"
    return f" [{text}" + ("; not the exact selection]" if r.get("same_as_exact") is False
                          else "]")


def _value(r: dict, fmt: str = "{:.3f}") -> str:
    return "OOM" if r.get("oom") else "error" if r.get("error") else fmt.format(r["ms"])


def _subset_arg(flag: str, allowed, aliases: dict | None = None):
    """A parser of a comma-separated subset of allowed() (called when parsing, so that
    --help imports nothing heavy), or of one of the aliases' names (name -> its subset)."""
    aliases = aliases or {}

    def parse(text: str) -> list[str]:
        if text in aliases:
            return list(aliases[text])
        names = [t for t in text.split(",") if t]
        options = list(allowed())
        if not names or any(t not in options for t in names):
            also = "".join(f", or {a}" for a in aliases)
            raise argparse.ArgumentTypeError(f"{flag} got {text!r}, expected a comma-separated "
                                             f"subset of {', '.join(options)}{also}")
        return _distinct(names, text)
    return parse


def _pair_names():
    """The pairs --pairs takes: the tiny one is --quick's (its vocabulary is the data's)."""
    from ..training.presets import PAIRS
    return [name for name in PAIRS if name != "tiny"]


def _phonebook_points() -> list[str]:
    from ..phonebook.paper import POINTS
    return list(POINTS)


_layer_sweeps = _subset_arg("--sweeps", lambda: LAYER_SWEEPS)
_pairs_arg = _subset_arg("--pairs", _pair_names)
MODEL_PAIRS = ("h512-s64", "h512-s128", "h512-s64-x8", "h1024-s32")   # --pairs' default
# `bench model`'s phases and decode modes (moremoe.bench.model.PHASES, DECODE_MODES)
MODEL_PHASES, DECODE_MODES = ("prefill", "decode"), ("eager", "captured", "compiled")
MODES = ("eager", "graph", "compiled")           # bench phonebook (no torch here)
_phases_arg = _subset_arg("--phases", lambda: MODEL_PHASES, {"both": MODEL_PHASES})
_modes_arg = _subset_arg("--decode-modes", lambda: DECODE_MODES)


def _model_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        shape = f"{r['B']}x{r['T']}" if r["phase"] == "prefill" else f"B={r['B']}"
        phase = r["phase"] + (f" {r['mode']}" if r.get("mode") else "")
        if r.get("oom"):
            out.append([r["model"], phase, shape, "OOM", *["-"] * 7])
            continue
        c = r.get("components") or {}
        floor = f"{r['floor_ms']:.3f}" if r.get("floor_ms") else "-"
        ratio = f"{r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else "-"
        out.append([r["model"], phase, shape, f"{r['ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                    floor, ratio, *(f"{c[k]:.2f}" if k in c else "-"
                                    for k in ("attention", "router", "experts", "rest"))])
    return table(out, ["model", "phase", "batch", "ms (per step in decode)", "tokens/s",
                       "floor ms", "/floor", "attention", "router", "experts", "rest"])


def _model_summary(rows) -> str:
    from ..bench.model import ratios
    lines = []
    for r in ratios(rows):
        shape = f"{r['B']}x{r['T']}" if r["phase"] == "prefill" else f"B={r['B']}"
        comp = ", ".join(f"{k} {v:.2f}x" for k, v in r["components"].items() if v)
        what = r["phase"] + (f" {r['mode']}" if r.get("mode") else "")
        lines.append(f"{r['pair']} {what} {shape}: MoRE/MoE {r['ratio']:.3f} "
                     f"({r['more_ms']:.3f} / {r['moe_ms']:.3f} ms" + (f"; {comp})" if comp
                                                                     else ")"))
    return "\n" + "\n".join(lines) if lines else ""


def _pair_configs(names: list[str], quick: bool):
    from ..training.presets import PAIRS, get_preset
    out = []
    for pair in (["tiny"] if quick else names):
        models = []
        for preset in PAIRS[pair]:
            spec = get_preset(preset).model
            tc = spec.transformer_config(vocab=512 if quick else None)
            if quick:                      # the code path only: short sequences, 2 layers
                from dataclasses import replace
                tc = replace(tc, max_seq_len=64)
            models.append((preset, spec.kind, tc))
        out.append((pair, models))
    return out


def _peer_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        val = "OOM" if r.get("oom") else f"{r['ms']:.3f}"
        floor = f"{r['floor_ms']:.3f}" if r.get("floor_ms") else "-"
        ratio = f"{r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else "-"
        mem = f"{r['peak_bytes'] / 2 ** 20:,.0f}" if r.get("peak_bytes") is not None else "-"
        out.append([r["variant"], r["layer"], r["phase"], f"{r['N']:,}", val, floor, ratio,
                    mem])
    return table(out, ["variant", "layer", "phase", "N", "ms", "floor ms", "/floor",
                       "peak MiB"])


def _peer_summary(rows) -> str:
    from ..bench.peer import summary_text
    return summary_text(rows)


def _router_runner(args):
    """The router sweeps, then (--sweeps tune) the block configurations of bench/tune.py."""
    from ..bench import router

    def run(device, progress, quick):
        sweeps = [s for s in args.sweeps if s != "tune"]
        if sweeps:
            yield from router.run(sweeps, device=device, training=not args.no_training,
                                  progress=progress, quick=quick)
        if "tune" in args.sweeps:
            from ..bench.tune import router_tune
            yield from router_tune(device, quick=quick, progress=progress)
    return run


def cmd_bench(args) -> int:
    from ..bench import layer, layer_plots, router_plots
    quick = {"quick": args.quick}
    if args.bench_command == "ep":
        from .bench_ep import run_ep
        return run_ep(args)
    if args.bench_command == "peer":
        from ..bench import peer, peer_plots
        args.table, args.summarize = _peer_table, _peer_summary
        args.runner_kwargs = {**quick, "tokens": args.tokens}
        return _run_bench(args, "peer", peer.run_peer, peer_plots.render_peer)
    if args.bench_command == "phonebook":
        from ..phonebook import bench as pb
        args.table, args.summarize = pb.phonebook_table, None
        if args.quick and args.points:
            raise UserError(f"--points {','.join(args.points)} would not be measured: "
                            f"--quick times a tiny pair only; drop one of them")
        args.runner_kwargs = {**quick, "modes": args.modes, "points": args.points}
        return _run_bench(args, "phonebook", pb.run_phonebook, None)
    if args.bench_command == "model":
        from ..bench import model, model_plots
        args.table, args.summarize = _model_table, _model_summary
        if args.quick and args.pairs is not None:
            raise UserError(f"--pairs {','.join(args.pairs)} would not be measured: --quick "
                            f"measures the tiny pair only; drop one of them")
        pairs = args.pairs or list(MODEL_PAIRS)
        args.runner_kwargs = {**quick, "pairs": _pair_configs(pairs, args.quick),
                              "phases": args.phases, "modes": args.decode_modes,
                              "batches": args.batches, "new_tokens": args.new_tokens}
        return _run_bench(args, "model", model.run_model, model_plots.render_model)
    if args.bench_command == "router":
        unread = [w for w in args.sweeps or () if w != "tune"] if args.quick else []
        if unread:                  # --quick runs one small sweep in their place (tune: its own)
            raise UserError(f"--sweeps {','.join(unread)} would not be measured: --quick "
                            f"runs a small sweep of its own (with tune, tune's); drop one "
                            f"of them")
        args.sweeps = args.sweeps or ["M", "r", "k", "B", "paper"]
    spec = {"router": (_router_runner(args), router_plots.render, _bench_table, None),
            "layer": (layer.run_layer, layer_plots.render_layer, _layer_table, _matched),
            "decode": (layer.run_decode, layer_plots.render_decode, _layer_table, _decode_summary),
            "experts": (layer.run_experts, None, _layer_table, None)}
    runner, render, args.table, args.summarize = spec[args.bench_command]
    args.runner_kwargs = quick
    if args.bench_command == "experts" and args.tune:
        from ..bench.tune import run_experts_tune
        runner = run_experts_tune
    if args.bench_command == "layer":
        args.runner_kwargs = {**quick, "sweeps": args.sweeps, "expert_counts": args.experts}
    if args.bench_command == "decode":
        args.runner_kwargs = {**quick, "expert_counts": args.experts, "hidden": args.hidden}
    if args.bench_command == "experts" and not args.tune and not args.quick:
        args.runner_kwargs = {**quick, "points": expert_points(args.shapes)}
    return _run_bench(args, args.bench_command, runner, render)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on the GPU (results as JSON lines + plots)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    # name: (the one-line summary `moremoe bench --help` lists, the rest of its description)
    benchmarks = {
        "router": ("fused vs unfused routers, inference and training",
                   "the fused low-rank router, its unfused reference, the paper's Algorithm 1 "
                   "(inference), the fused and unfused standard router, inference and training "
                   "(forward + backward with the balancing loss, with peak memory), each fused "
                   "row with its speedup over the unfused router and Algorithm 1; sweeps of M "
                   "(h=512 and 2048), r, k, the batch size, and the paper's router points "
                   "(h=2048, M=4096, r=16 over B)"),
        "layer": ("whole-layer prefill over h x M, MoE vs MoRE",
                  "MoE (unfused and fused standard router) and MoRE, wider experts at h=512, "
                  "forward+backward peak memory, and the matched wall-clock point"),
        "decode": ("one layer's decode step at B in {4, 16, 64, 256} over h x M",
                   "MoE vs MoRE, and a schedule that walks the range of expert ids"),
        "experts": ("the grouped expert kernels alone, forward and backward",
                    "at the paper's, the presets', the study's and the phonebook's shapes "
                    "(--shapes): achieved TFLOP/s, ratio to the floor (/floor: each input read "
                    "once, each output written once) and to our design's floor (/design: "
                    "also the deterministic combine's (N k, h) pair rows written and read "
                    "back, a token's row read once a slot), the kernels' share "
                    "of the time; at M <= 1024 the torch._grouped_mm experts (the torchtitan "
                    "way) beside them"),
        "model": ("whole models: prefill and KV-cache decode by component",
                  "the paper's whole-model tables: prefill of matched MoE / MoRE pairs of "
                  "12-layer presets at B x T = 64 x 1024 and 256 x 1024 and decode "
                  "milliseconds per step at batch 1, 8, 64 (128 new tokens) eager (the "
                  "key/value cache and a Python loop), captured (the static cache, one "
                  "CUDA-graph replay a step) and compiled (torch.compile'd, then captured), "
                  "each decode row against the step's byte floor (the weights and cache it "
                  "reads, at the measured copy rate); eager and prefill rows with a breakdown "
                  "into attention, router, experts and the rest (stacked bars in model.png, "
                  "the decode modes in model_decode.png) and the MoRE/MoE ratio"),
        "peer": ("PEER vs MoRE and MoE at matched active FLOPs",
                 "the paper's Appendix B table: one layer's forward and forward+backward at "
                 "4,096 ... 262,144 tokens, MoRE-1792, MoE-256 and PEER-388^2 (kappa = 56 as "
                 "the paper matches it, 4 at inference coefficients) with its fused kernels "
                 "(retrieval and experts) and its torch path, its fused retrieval alone, the "
                 "PEER/MoRE ratios beside the paper's (peer.png)"),
        "phonebook": ("the phonebook training step: eager, one CUDA graph, runs at once",
                      "ms a step of MoE-32, MoRE-96 (h=64, s=8) and MoRE-768 (h=512), L=6, "
                      "batch 1,024: eager, graph, compiled (then captured), with the kernels a step "
                      "launches; the trainer's loop; "
                      "steps a second of 1-8 runs on CUDA streams and of 2, 4 processes"),
        "ep": ("expert parallelism on E GPUs: router, experts, comm per phase",
               "the paper's Appendix F.3 table, launched as `torchrun --nproc_per_node E -m "
               "moremoe.cli bench ep`: one layer at h=512, s=64, k=4, r=64, bf16, N=262,144 "
               "tokens (global), M in 2,048, 8,192, 16,384, for MoE with the plain-torch "
               "router, MoE with the fused standard router, MoRE and MoRE with the sharded "
               "router, with the tokens replicated (a) or local to each GPU (b), and the "
               "whole layer on one GPU in the same run; forward and forward+backward; the "
               "time of each phase (router, experts with their local dispatch, "
               "communication) and of the layer, the issue's targets met or not (rank 0 "
               "writes the rows; ep.png stacks the phases, MoE beside MoRE)")}
    for name, (summary, details) in benchmarks.items():
        pb = bsub.add_parser(name, help=summary,
                             description=f"{summary}: {details}. Each row is appended to "
                             f"benchmarks/results/<device>/{name}.jsonl as it is measured "
                             "(device, versions, commit, date, the measured ceilings); plots "
                             "are rendered beside it.")
        if name == "router":
            pb.add_argument("--sweeps", type=_router_sweeps, default=None,
                            help="which sweeps: M (at h=512 and 2048), r, k, B, paper "
                                 "(h=2048, M=4096, r=16 over B) (default all of these); "
                                 "tune: the fused routers' block configurations beside "
                                 "their defaults, inference (to rerun on a new GPU); with "
                                 "--quick only tune (--quick runs a small sweep of its own)")
            pb.add_argument("--no-training", action="store_true", help="inference rows only")
        if name == "layer":
            pb.add_argument("--sweeps", type=_layer_sweeps, default=list(LAYER_SWEEPS),
                            help="which sweeps: grid (h x M prefill), wide_s (s in 128, 256, "
                                 "512 at h=512), match (MoRE at M up to 32,768 for the matched "
                                 "wall-clock point), memory (forward+backward peak over h x M);"
                                 " default all")
        if name in ("layer", "decode"):
            pb.add_argument("--experts", type=_int_list, default=None, metavar="M,M,...",
                            help="the expert counts" + (" of the grid and memory sweeps"
                                                        if name == "layer" else "")
                            + " (default 64,128,...,8192)")
        if name == "experts":
            pb.add_argument("--shapes", type=_subset_arg("--shapes", lambda: EXPERT_SHAPES),
                            default=list(EXPERT_SHAPES),
                            help="whose expert shapes, each at its own micro-batch: paper "
                                 "(h=512, N=262,144: M=8192 at s=64, 128, 512; M=512, 1024), "
                                 "presets (every training preset's), study (the study "
                                 "pair's), phonebook (the h=64 pair's and MoRE-768's, 16,384 "
                                 "tokens); default all. Each row carries its kernels' share "
                                 "of the device time (what limits it)")
            pb.add_argument("--tune", action="store_true",
                            help="instead, time the kernels' block configurations beside "
                                 "their defaults, forward and backward, at h=512, M=8192 "
                                 "(s=64, 128) and the h512 pair's training micro-batch, "
                                 "there also with Zipf-skewed routing (hot experts, as in "
                                 "a run's first steps; rows say which) (to rerun on a new "
                                 "GPU)")
        if name == "phonebook":
            pb.add_argument("--modes", type=_subset_arg("--modes", lambda: MODES),
                            default=list(MODES), help="step modes of the one-run rows "
                            "(default all; compiled compiles each model, tens of seconds)")
            pb.add_argument("--points", type=_subset_arg("--points", _phonebook_points),
                            default=None, help="time the MoE and the MoRE of these paper "
                            "points (e.g. h128-s8,h256-s8,h64-s32), their loop rows with "
                            "the time of a whole trial at the paper's capacity and the next "
                            "size (default: the h64-s8 pair and MoRE-768)")
        if name == "peer":
            pb.add_argument("--tokens", type=_int_list, default=None, metavar="N,N,...",
                            help="tokens a step (default 4096,16384,65536,262144)")
        if name == "decode":
            pb.add_argument("--hidden", type=_int_list, default=None, metavar="H,H,...",
                            help="the hidden sizes h (default 64,128,...,4096)")
        if name == "model":
            pb.add_argument("--pairs", type=_pairs_arg, default=None,
                            help="matched preset pairs, comma-separated: h512-s64 (MoE-256 / "
                                 "MoRE-1792, the paper's), h512-s128, h512-s64-x8 (MoE-1024 / "
                                 "MoRE-8192), h1024-s32 (default all four; a model that does "
                                 "not fit gives OOM rows), h512-s56-same (MoE-1792 with the "
                                 "standard router at MoRE-1792's shape / MoRE-1792); "
                                 "--quick measures the tiny pair (tiny-moe / tiny-more) "
                                 "instead")
            pb.add_argument("--phases", type=_phases_arg, default=list(MODEL_PHASES),
                            help="prefill, decode, or both (= prefill,decode; the "
                                 "default)")
            pb.add_argument("--decode-modes", type=_modes_arg, default=list(DECODE_MODES),
                            help="eager, captured, compiled, comma-separated (default all; "
                                 "compiled compiles once per model, tens of seconds)")
            pb.add_argument("--batches", type=_int_list, default=None, metavar="B,B,...",
                            help="decode batch sizes (default 1,8,64)")
            pb.add_argument("--new-tokens", type=_int_at_least(2), default=None,
                            help="decode steps a row (default 128)")
        pb.add_argument("--quick", action="store_true",
                        help="tiny sizes: checks the code path (also on CPU with "
                             "TRITON_INTERPRET=1)")
        pb.add_argument("--out", default=None, help="JSON-lines file to append to")
        pb.add_argument("--plot-only", default=None, metavar="JSONL",
                        help="only render the plots of an existing results file")
        pb.add_argument("--no-progress", action="store_true",
                        help="no line per measured row on stderr")
        _add_json(pb)
        pb.set_defaults(func=cmd_bench)
