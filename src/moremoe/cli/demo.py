"""``moremoe demo``: a matched-active-FLOP MoE / MoRE pair trained on the same phonebook.

Plans the pair at the paper's smallest phonebook point (h = 64, s = 8, k = 4, r = 16) with
the paper's convention: MoE-32 against MoRE-96, the optimum's s' = 6 rounded up to 8 and M'
kept, which spends 1.12x the MoE's inference FLOPs (both are printed). Trains both with the
same data, seed, learning rate and step budget, and compares experts, total parameters,
active FLOPs, exact match, H_norm per layer and the router's inference time per token.
The defaults finish in a few minutes on a 2-core CPU; a GPU is used when present.
"""
from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import accounting
from ..bench.harness import router_seconds_per_token
from ..nn.moe import MoEConfig
from ..report import check_new_output, emit, human, table, write_json
from ..runtime import __version__, resolve_device
from ..training.phonebook import PhonebookTrainConfig, phonebook_model_config, train_phonebook
from .args import _add_json, _positive_int
from .plots import plot_phonebook_runs


@dataclass(frozen=True)
class DemoConfig:
    hidden: int = 64
    width: int = 8
    top_k: int = 4
    rank: int = 16
    layers: int = 2
    size: int | None = None      # phonebook entries (default 2,048)
    steps: int | None = None     # training steps per model (default 600)
    lr: float = 1e-3
    batch_size: int = 1024
    eval_every: int = 50
    seed: int = 0
    device: str = "auto"

    def resolved(self) -> "DemoConfig":
        from dataclasses import replace
        return replace(self, size=self.size or 2048, steps=self.steps or 600)


def run_demo(cfg: DemoConfig, *, out_dir: Path, progress: bool = True) -> dict:
    cfg = cfg.resolved()
    dev = resolve_device(cfg.device)
    plan = accounting.plan_matched(hidden=cfg.hidden, width=cfg.width, top_k=cfg.top_k,
                                   rank=cfg.rank, round_width=8, refit=False)
    moes = [MoEConfig.moe(plan.moe.experts, cfg.top_k, cfg.hidden, plan.moe.width),
            MoEConfig.more(plan.more.experts, cfg.top_k, cfg.hidden, plan.more.width, cfg.rank)]
    train_cfg = PhonebookTrainConfig(size=cfg.size, seed=cfg.seed, batch_size=cfg.batch_size,
                                     lr=cfg.lr, max_steps=cfg.steps, eval_every=cfg.eval_every,
                                     device=str(dev))
    result = {"command": "demo", "config": asdict(cfg), "plan": plan.to_dict(),
              "device": _device_name(dev), "torch": torch.__version__, "moremoe": __version__,
              "runs": []}
    json_path, png_path = out_dir / "demo.json", out_dir / "demo.png"
    for moe in moes:
        model_cfg = phonebook_model_config(moe, layers=cfg.layers)
        run, model = train_phonebook(model_cfg, train_cfg, progress=progress,
                                     desc=moe.name)
        record = run.to_dict()
        record["router_seconds_per_token"] = router_seconds_per_token(model.blocks[0].moe.router)
        result["runs"].append(record)
        write_json(json_path, result)
    plot_phonebook_runs(result["runs"], png_path, title=f"{moes[0].name} vs {moes[1].name}, "
                        f"phonebook of {cfg.size:,} entries")
    result["files"] = {"json": str(json_path), "png": str(png_path)}
    write_json(json_path, result)
    return result


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _evaluated(run: dict) -> int:
    """Entries the exact match is measured on: eval_entries of the phonebook, or all of a
    smaller phonebook (Phonebook.eval_indices)."""
    return min(run["train"]["size"], run["train"]["eval_entries"])


def format_demo(result: dict) -> str:
    cfg, (moe, more) = result["config"], result["runs"]

    def col(run):
        m = run["model"]["moe"]
        return [m["experts"], m["width"], m["rank"] or "-", human(run["params_total"]),
                f"{run['flops_inference']:,}", f"{run['flops_training']:,}",
                f"{run['exact_match']:.3f}", f"{run['char_accuracy']:.3f}",
                " ".join(f"{v:.2f}" for v in run["hnorm"]),
                f"{run['router_seconds_per_token'] * 1e9:.1f} ns", f"{run['seconds']:.0f} s"]
    labels = ["experts M", "expert width s", "router rank r", "total parameters",
              "active FLOPs/token/layer (inference)", "active FLOPs/token/layer (training)",
              f"exact match ({_evaluated(moe):,} entries)", "digit accuracy", "H_norm per layer",
              "router time per token", "training time"]
    rows = [[label, a, b] for label, a, b in zip(labels, col(moe), col(more))]
    head = (f"moremoe demo: the paper's first phonebook pair, planned at matched active FLOPs "
            f"({result['device']}, torch {result['torch']})\n"
            f"phonebook {cfg['size']:,} entries, {cfg['layers']} layers, h={cfg['hidden']}, "
            f"k={cfg['top_k']}, batch {cfg['batch_size']}, lr {cfg['lr']:g}, "
            f"{cfg['steps']} steps each, same data and seed\n")
    verdict = (f"\nAt {more['flops_inference'] / moe['flops_inference']:.2f}x the MoE's active "
               f"FLOPs, MoRE holds {more['model']['moe']['experts'] / moe['model']['moe']['experts']:.0f}x "
               f"the experts and reaches exact match {more['exact_match']:.3f} against "
               f"{moe['exact_match']:.3f}.")
    files = f"\nreport: {result['files']['json']}\nplot:   {result['files']['png']}"
    return head + table(rows, ["", moe["name"], more["name"]]) + verdict + files


def cmd_demo(args) -> int:
    from ..tasks.phonebook import NAME_SPACE
    if args.size is not None and args.size > NAME_SPACE:
        raise ValueError(f"--size {args.size:,} exceeds the {NAME_SPACE:,} unique five-letter "
                         f"names a phonebook can hold")
    out_dir = Path(args.out) if args.out else Path("runs") / "demo"
    check_new_output(out_dir, "--out", args.force, names=("demo.json", "demo.png"))
    result = run_demo(DemoConfig(device=args.device, size=args.size, steps=args.steps),
                      out_dir=out_dir, progress=not args.no_progress)
    emit(args, result, format_demo(result))
    return 0


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job: a matched MoE / MoRE pair on a phonebook",
                       description="Plan a matched-FLOP MoE/MoRE pair at h=64, train both on "
                       "the same phonebook and compare experts, parameters, FLOPs, exact match, "
                       "H_norm and router time per token. Uses the GPU when one is present; "
                       "a few minutes on a 2-core CPU.")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda[:N]")
    p.add_argument("--size", type=_positive_int, default=None, help="phonebook entries")
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps per model")
    p.add_argument("--out", default=None, help="output folder (default runs/demo)")
    p.add_argument("--force", action="store_true",
                   help="replace the demo.json and demo.png of an earlier demo in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_json(p)
    p.set_defaults(func=cmd_demo)
