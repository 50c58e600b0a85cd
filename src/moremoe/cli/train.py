"""The ``moremoe train`` command: thin parsing over ``moremoe.training.lm``."""
from __future__ import annotations

import argparse
import sys

from .args import _add_json, _distinct, _float_list, _path, _positive_float, _positive_int
from .memory import advise_on_memory
from ..report import emit, human, table

DESCRIPTION = """\
Pretrain the MoE / MoRE transformer on a prepared token directory (`moremoe data prepare`).
The run is a preset or a YAML file (sections model, optim, train, parallel; see
moremoe/training/config.py for every key), changed by --set section.key=value and the flags
below. Writes RUN/log.jsonl (loss, lr, grad norm, tokens/s, MFU; validation loss,
perplexity and H_norm per layer), RUN/summary.json and RUN/checkpoints/step_N
(model.safetensors + optimizer, scheduler, data position and RNG states).

Several GPUs:  torchrun --nproc_per_node 2 -m moremoe.cli train --preset ... (DDP; the
global batch is batch_size x GPUs x grad_accum). --set parallel.data=fsdp shards weights,
gradients and AdamW states over the GPUs (FSDP2); --set parallel.expert=E splits every
layer's experts over groups of E GPUs (expert parallelism: each GPU keeps its micro-batch
and sends the tokens to their experts' GPUs by all-to-all; E divides model.experts and the
GPUs), with DDP or FSDP2 for the rest. DDP runs the compiled model with CUDA graphs when
asked (--set train.compile_mode=reduce-overhead; not yet the default) and all-reduces the
gradients in buckets of --set parallel.bucket_mb=MB (>= 1 when compiled) during the
backward, in fp32 or with --set parallel.reduce_dtype=bf16 in bf16. Either way a step
equals one process on the global batch (bf16: to bf16's rounding of the averaged
gradients), and checkpoints hold the whole model, so a run resumes on another layout. The
memory plan per GPU is printed at start; --set train.activation_checkpointing=true (recompute each
block in the backward) and --set optim.moments=bf16 (bf16 AdamW moments, one Triton pass a
parameter on a GPU; the loss measured within run-to-run noise, benchmarks/NOTES.md) keep less,
and so does --set train.fused_loss=true (the output head and the loss in chunks of tokens:
the (tokens, vocabulary) logits are never stored).
The fused expert backward adds its weight gradients into .grad across micro-steps
(optim.expert_grads=auto, the default: one process, DDP or expert shards, with fp32
gradients; under DDP the trainer all-reduces those gradients during the last micro-step's
backward;
=autograd turns it off). --set optim.grads=bf16 (with optim.moments=bf16, one
process) keeps the gradients in bf16, 2 bytes a parameter, accumulated in bf16.

A run directory that already holds a run is continued with --resume (from its newest
complete checkpoint; incomplete ones are named and skipped) or started over with --force.
Running out of memory is one line naming the settings that make the run smaller.
A step whose loss or gradient norm is not finite stops the run before it updates the
weights (train.nan_policy=skip skips such steps instead).

Exit status: 0 the schedule finished; 75 stopped by --max-minutes or --stop-step (with a
checkpoint: --resume continues); 130 / 143 stopped by SIGINT / SIGTERM (checkpointed
first); 2 an error (one line; --debug for the traceback). Under torchrun every rank exits 0
after any of these stops, once rank 0 has written the checkpoint, log and summary
(summary.json's "stopped" says why): torchrun takes a non-zero rank for a failed job and
kills the others. A SIGINT / SIGTERM to torchrun reaches each rank once; torchrun then
exits 1 itself and SIGKILLs a rank still writing 30 s later. A signal repeated within a
second is one request (a scheduler that signals every process, and torchrun forwarding
it); a later second one interrupts at once."""

EXAMPLES = """\
examples:
  moremoe train --list-presets
  moremoe train --preset tiny-more --data data/tiny --out runs/tiny --device cpu
  moremoe train --preset h512-s64-moe256 --data data/fw --max-minutes 10 \\
      --set train.grad_accum=1 --set model.experts_impl=triton --set train.save_on_stop=false
  moremoe train --preset h512-s64-more1792 --data data/fw --out runs/more --resume
  torchrun --nproc_per_node 2 -m moremoe.cli train --preset h512-s64-more8192 --data data/fw \\
      --set parallel.expert=2 --set parallel.data=fsdp \\
      --set train.activation_checkpointing=true --set optim.moments=bf16   # 2 x 80 GB
  moremoe train --config my.yaml --set optim.lr=3e-4 --set optim.router_lr=1e-3
  moremoe train --preset h512-s64-more1792 --data data/fw --set train.profile_steps=10 \\
      --set train.compile=false      # the paper presets compile the model, CUDA graphs on 1 GPU"""


def _presets_table(rows: list[dict]) -> str:
    out = [[r["name"], r["kind"], r["hidden"], r["layers"], f"{r['heads']}/{r['kv_heads']}",
            r["experts"], r["width"], r["top_k"], r["rank"] or "-", r["seq_len"],
            human(r["params_total"]) + ("*" if r["vocab_from_data"] else ""),
            human(r["moe_flops_inference"]), human(r["train_flops_per_token"])]
            for r in rows]
    return (table(out, ["preset", "kind", "h", "L", "heads/kv", "M", "s", "k", "r", "T",
                        "params", "MoE FLOPs/layer", "train FLOPs/token"])
            + "\n* vocabulary from the data; shown at V = 50,257 (GPT-2)."
            + "\nMoE FLOPs/layer: active, inference (6khs + 6 router), as the paper's tables; "
              "train FLOPs/token: the whole model, forward + backward (for MFU).")


def _summary_table(s: dict) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    hn = s.get("hnorm") or []
    rows = [["model", f"{s['name']} ({human(s['params'])} params)"],
            ["stopped", f"{s['stopped']} at step {s['step']}/{s['planned_steps']}"],
            ["tokens", f"{s['tokens']:,}"],
            ["device", f"{s['device']} x{s['world']}"],
            ["mean step (after warm-up)", fmt(s["mean_step_ms"], ",.1f") + " ms"],
            ["tokens/s", fmt(s["tokens_per_s"], ",.0f")],
            ["MFU", "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}% of "
                                                f"{s['peak_tflops']:g} TFLOP/s per GPU"],
            ["peak memory per GPU", "-" if not s.get("peak_memory_gib_per_rank") else
             ", ".join(f"{g:.1f}" for g in s["peak_memory_gib_per_rank"]) + " GiB"],
            ["val loss / ppl", "-" if s["val_loss"] is None else
             f"{s['val_loss']:.4f} / {s['val_ppl']:.2f}"],
            ["H_norm per layer", ", ".join(f"{h:.3f}" for h in hn) or "-"],
            ["run directory", s["out"]]]
    return table(rows, ["summary", ""])


def cmd_train(args) -> int:
    if args.list_presets:
        from ..training.presets import preset_rows
        rows = preset_rows()
        emit(args, rows, _presets_table(rows))
        return 0
    from ..training.compose import build_run_config
    from ..training.lm import train
    from ..training.metrics import printer
    cfg = build_run_config(preset=args.preset, config_file=args.config,
                           overrides=args.set or [], data=args.data, out=args.out,
                           max_steps=args.max_steps, max_minutes=args.max_minutes,
                           stop_step=args.stop_step, device=args.device,
                           peak_tflops=args.peak_tflops)
    echo = printer(sys.stderr if args.json else sys.stdout)
    with advise_on_memory(*_sizing(cfg)):
        if args.lr_grid:
            from dataclasses import replace
            from pathlib import Path
            from ..training.checkpoint import check_run_dir, run_writes
            from ..training.lm import default_out
            from ..training.lr_grid import select_lr
            if args.grid_steps is None:
                raise ValueError("--lr-grid needs --grid-steps N (the steps of each candidate "
                                 "run)")
            check_run_dir(Path(cfg.train.out or default_out(cfg)), force=args.force,
                          writes=run_writes(cfg.train))
            best = select_lr(cfg, args.lr_grid, args.grid_steps, echo=echo)["lr"]
            cfg = replace(cfg, optim=replace(cfg.optim, lr=best))
        summary = train(cfg, resume=args.resume, force=args.force, echo=echo)
    if _is_rank0():
        emit(args, summary, _summary_table(summary))
    return summary["exit_code"]


def _sizing(cfg) -> tuple[str, str]:
    """What a run that runs out of memory holds, and the settings that make it smaller."""
    m, t = cfg.model, cfg.train
    what = (f"{m.name} (model.hidden={m.hidden}, model.layers={m.layers}) at "
            f"train.batch_size={t.batch_size} sequences of model.seq_len={m.seq_len} per "
            f"device and micro-step")
    halve = (f"the micro-batch (--set train.batch_size={t.batch_size // 2} --set "
             f"train.grad_accum={2 * t.grad_accum} keeps the global batch), "
             if t.batch_size > 1 else "")
    change = (f"lower {halve}the sequence length (--set model.seq_len) or the model's size, "
              f"or use more GPUs (torchrun --nproc_per_node N)")
    if cfg.parallel.data != "fsdp":
        change += " and shard the model over them (--set parallel.data=fsdp)"
    if cfg.parallel.expert == 1 and m.kind != "peer":
        change += (f" and split its experts over them (--set parallel.expert=E, a divisor of "
                   f"model.experts={m.experts})")
    less = ([] if t.activation_checkpointing else ["--set train.activation_checkpointing=true"])
    less += ["--set optim.moments=bf16"] if cfg.optim.moments == "fp32" else []
    less += [] if t.fused_loss else ["--set train.fused_loss=true"]
    if less:
        change += f", or keep less per GPU ({', '.join(less)})"
    return what, change


def _is_rank0() -> bool:
    import os
    return os.environ.get("RANK", "0") == "0"


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="pretrain the MoE/MoRE transformer on prepared text",
                       description=DESCRIPTION, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="a named configuration (see --list-presets)")
    src.add_argument("--config", type=_path, default=None, metavar="FILE.yaml",
                     help="YAML file with sections model/optim/train (and optional preset)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. train.batch_size=16 or optim.router_lr=3e-3 "
                        "(repeatable; values are YAML: null, true, [0.9, 0.95])")
    p.add_argument("--data", type=_path, default=None,
                   help="prepared data directory (train.data)")
    p.add_argument("--out", type=_path, default=None,
                   help="run directory (train.out; default runs/train/<preset>): new, empty "
                        "or a run; a folder of other files only with --force, never one "
                        "whose config.json a run would replace (an hf export, a checkpoint)")
    p.add_argument("--max-steps", type=_positive_int, default=None,
                   help="schedule length in optimizer steps (train.max_steps)")
    p.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="wall-clock budget of the training loop: stop cleanly, checkpoint "
                        "(unless train.save_on_stop=false) and report")
    p.add_argument("--stop-step", type=_positive_int, default=None,
                   help="stop at this step without shortening the schedule")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in the run "
                            "directory (starts fresh when the directory holds no run)")
    again.add_argument("--force", action="store_true",
                       help="start over in a run directory that holds a run, deleting its "
                            "checkpoints, log, summary and plot; or write the run into a "
                            "folder of other files, deleting nothing of theirs")
    p.add_argument("--lr-grid", type=_float_list, default=None, metavar="LR,LR,...",
                   help="pick optim.lr first: a --grid-steps run per rate in OUT/lr-grid/, "
                        "the lowest validation loss wins (OUT/lr_grid.json), e.g. "
                        "3e-4,1e-3,3e-3 (the paper's grid)")
    p.add_argument("--grid-steps", type=_positive_int, default=None,
                   help="optimizer steps of each --lr-grid run")
    p.add_argument("--device", default=None, help="auto (GPU when present), cpu or cuda[:N]")
    p.add_argument("--peak-tflops", type=_positive_float, default=None,
                   help="per-GPU peak for MFU (default: 989 on H100/H200, none on CPU)")
    p.add_argument("--list-presets", action="store_true",
                   help="print the presets with parameters and FLOPs, and exit")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON (progress lines go to stderr)")
    p.set_defaults(func=cmd_train)


def cmd_plot(args) -> int:
    from pathlib import Path
    from ..report import check_new_output
    from ..training.run_plot import plot_runs, read_events
    out = check_new_output(Path(args.out), "--out", args.force)
    runs, names = {}, args.names or []
    if names and len(names) != len(args.runs):
        raise ValueError(f"--names gives {len(names)} names for {len(args.runs)} runs")
    real = [Path(r).resolve() for r in args.runs]
    twice = next((r for i, r in enumerate(args.runs) if real[i] in real[:i]), None)
    if twice is not None:
        raise ValueError(f"RUN {twice} is given twice; give each run once")
    for i, run in enumerate(args.runs):      # every log read and checked before drawing
        name = names[i] if names else Path(run).name
        runs[name if name not in runs else f"{name} ({i})"] = read_events(run)
    steps = {n: max((e["step"] for e in ev if "step" in e), default=0) for n, ev in runs.items()}
    plot_runs(runs, out, title=" vs ".join(runs))
    emit(args, {"out": str(out), "runs": list(args.runs), "last_step": steps},
         f"wrote {out}: {', '.join(f'{n} (step {s})' for n, s in steps.items())}")
    return 0


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="overlay pretraining runs (loss, lr, balancing, H_norm)",
                       description="Training and validation loss, learning rates, balancing "
                       "loss and H_norm per layer against the step, of one or more `moremoe "
                       "train` runs on one figure (e.g. the MoE/MoRE pair). Each run also "
                       "keeps its own RUN/loss.png, refreshed at each validation.")
    p.add_argument("runs", type=_path, metavar="RUN", nargs="+",
                   help="run directories (with log.jsonl)")
    p.add_argument("--out", type=_path, required=True, metavar="PNG", help="figure to write")
    p.add_argument("--names", type=lambda t: _distinct([s for s in t.split(",") if s], t),
                   default=None,
                   help="comma list of legend names, one per run (default: folder names)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    _add_json(p)
    p.set_defaults(func=cmd_plot)
