"""The paper's phonebook capacity experiments, as data and plans: the matched-FLOP dots of
Figure phonebook_capacity (Tables phonebook_configs_h and phonebook_configs_s, Appendix C.1)
with the capacities the paper reports, the rank points of Figure memorization_in_training
(M = 192, h = 128, s = 8), the grid of sizes, and the rows a measured search becomes.

The paper does not list its grid of sizes; PAPER_GRID holds every capacity it reports (10K,
30K, 100K, 150K, 200K, 300K, 400K, 500K, 1.2M) and 3K below them, so that each of its dots
is a point of our grid and each of ours is read the way the paper's were.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from ..model import TransformerConfig
from ..nn.moe import MoEConfig
from .trainer import PhonebookTrainConfig, phonebook_model_config
from .search import capacity

PAPER_GRID = (3_000, 10_000, 30_000, 100_000, 150_000, 200_000, 300_000, 400_000,
              500_000, 1_200_000)
TOP_K, RANK, LAYERS = 4, 16, 6


@dataclass(frozen=True)
class Point:
    """One dot pair of the paper: MoE-M against MoRE-M' at (h, s), and their capacities."""
    key: str
    hidden: int
    width: int
    moe_experts: int
    more_experts: int
    paper_moe: int
    paper_more: int
    sweeps: tuple           # the figure panels it belongs to: "h" (s = 8), "s" (h = 64)


POINTS = {p.key: p for p in (
    Point("h64-s8", 64, 8, 32, 96, 10_000, 30_000, ("h", "s")),
    Point("h128-s8", 128, 8, 32, 192, 30_000, 100_000, ("h",)),
    Point("h256-s8", 256, 8, 32, 384, 100_000, 300_000, ("h",)),
    Point("h512-s8", 512, 8, 32, 768, 200_000, 1_200_000, ("h",)),
    Point("h64-s16", 64, 16, 64, 224, 30_000, 100_000, ("s",)),
    Point("h64-s32", 64, 32, 128, 480, 150_000, 400_000, ("s",)),
    Point("h64-s64", 64, 64, 256, 992, 500_000, 1_200_000, ("s",)),
)}

# Figure memorization_in_training, left: MoRE at M = 192, h = 128, s = 8 against the rank,
# beside the MoE of the same shape, which MoRE matches "at r = 16" (the paper gives no
# numbers; its h = 128 dot, MoRE-192 at r = 16, memorises 100K). H_norm per layer against
# step is drawn for MoRE r = 32 and the MoE (middle, right).
RANK_SHAPE = {"experts": 192, "hidden": 128, "width": 8}
RANKS = (4, 8, 16, 32)
RANK_START = 100_000
DEFAULT_POINTS = ("h64-s8", "h128-s8", "h64-s16", "rank")


def point_models(point: Point) -> dict:
    """{"moe": model, "more": model} of a dot pair (the paper's s' = s, r = 16, L = 6)."""
    h, s = point.hidden, point.width
    return {"moe": phonebook_model_config(MoEConfig.moe(point.moe_experts, TOP_K, h, s),
                                          layers=LAYERS),
            "more": phonebook_model_config(MoEConfig.more(point.more_experts, TOP_K, h, s, RANK),
                                           layers=LAYERS)}


def rank_models() -> dict:
    """{"moe": MoE-192, r: MoRE-192 at rank r} of the rank figure."""
    M, h, s = RANK_SHAPE["experts"], RANK_SHAPE["hidden"], RANK_SHAPE["width"]
    models = {"moe": phonebook_model_config(MoEConfig.moe(M, TOP_K, h, s), layers=LAYERS)}
    for r in RANKS:
        models[r] = phonebook_model_config(MoEConfig.more(M, TOP_K, h, s, r), layers=LAYERS)
    return models


@dataclass(frozen=True)
class Search:
    """One capacity search of the reproduction: which figure it serves and what to compare."""
    name: str               # e.g. "h64-s8 MoRE-96", "rank r=4 MoRE-192"
    point: str              # a POINTS key, or "rank"
    arch: str               # "moe" or "more"
    model: TransformerConfig
    start: int
    paper: int | None       # the paper's capacity (None: the paper gives no number)


def searches(points, ranks=None) -> list[Search]:
    """The searches of the given points ("rank" for the rank figure: those of `ranks`, "moe"
    and ranks among RANKS, default all), in that order."""
    out = []
    for key in points:
        if key == "rank":
            for r, model in rank_models().items():
                if ranks is not None and r not in ranks:
                    continue
                arch = "moe" if r == "moe" else "more"
                label = "MoE-192" if r == "moe" else f"r={r} MoRE-192"
                out.append(Search(f"rank {label}", "rank", arch, model, RANK_START,
                                  RANK_START if r == 16 else None))
            continue
        point = POINTS[key]
        for arch, model in point_models(point).items():
            paper = point.paper_moe if arch == "moe" else point.paper_more
            out.append(Search(f"{key} {model.moe.name}", key, arch, model, paper, paper))
    return out


@dataclass(frozen=True)
class Run:
    """One search on one seed, as the executor runs it under `label`."""
    label: str
    search: Search
    cfg: PhonebookTrainConfig


def seeded(found: list[Search], cfg: PhonebookTrainConfig, seeds) -> list[Run]:
    """Each search on each seed, seed by seed. With one seed a run is labelled by its
    search's name (as every journal and report before seeds were a list); with several,
    "<name> (seed N)". The rows name the search alone and record the seed."""
    return [Run(s.name if len(seeds) == 1 else f"{s.name} (seed {seed})", s,
                replace(cfg, seed=seed)) for seed in seeds for s in found]


def plans(runs: list[Run], grid, on_trial=None, ahead: int = 1) -> dict:
    """{run label: capacity plan} starting at the paper's value, with the `ahead` next
    sizes up at once."""
    return {r.label: capacity(r.search.model, grid, r.cfg, name=r.label, start=r.search.start,
                              on_trial=None if on_trial is None else on_trial(r.label),
                              ahead=ahead)
            for r in runs}


def search_id(search: Search, grid, cfg: PhonebookTrainConfig) -> str:
    """The same search in any folder, session or resume (what a rows file is keyed by)."""
    text = json.dumps({"model": search.model.to_dict(), "grid": list(grid),
                       "train": cfg.experiment(), "start": search.start},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _trial_row(rec: dict) -> dict:
    last = rec["history"][-1] if rec["history"] else {}
    return {"size": rec["train"]["size"], "lr": rec["lr"], "calibration": rec["calibration"],
            "reached": rec["reached"], "exact_match": rec["exact_match"],
            "char_accuracy": rec["char_accuracy"], "steps": rec["steps"],
            "epochs": last.get("epoch", 0.0), "seconds": rec["seconds"],
            "diverged_at": rec["diverged_at"], "resumed_at": rec["resumed_at"],
            **({"device": rec["env"]["device"], "commit": rec["env"]["commit"]}
               if rec.get("env") else {})}


def _trials_env(trials: list, env: dict) -> dict:
    """Where the trials ran: the newest tags among the trials that carry them (a search
    replayed from its journal elsewhere, even on a CPU, keeps the GPU's; trials trained
    here carry this machine's), else env (journals from before trials were tagged)."""
    tags = [t["env"] for t in trials if t.get("env")]
    return max(tags, key=lambda e: e["date"]) if tags else env


def capacity_row(search: Search, result: dict, grid, cfg: PhonebookTrainConfig,
                 env: dict) -> dict:
    """One row of phonebook_capacity.jsonl: the configuration, our capacity beside the
    paper's, every trial (size, learning rate chosen, epochs, final exact match), the H_norm
    history of the run at the capacity, and where and how it was measured (the trials' own
    tags where they carry them, else env). A result marked
    unfinished (a stopped search) gives a row whose capacity is a lower bound."""
    m = search.model.moe
    trials = sorted(result["trials"], key=lambda t: t["train"]["size"])
    at = next((t for t in trials if t["train"]["size"] == result["capacity"]), None)
    return {"search": search_id(search, grid, cfg), "point": search.point, "arch": search.arch,
            "name": search.name, "model": m.label, "experts": m.experts, "top_k": m.top_k,
            "hidden": m.hidden, "width": m.width, "rank": m.rank,
            "layers": search.model.layers, "capacity": result["capacity"],
            "paper_capacity": search.paper, "grid": list(grid), "start": search.start,
            "seed": cfg.seed, "threshold": cfg.threshold, "max_epochs": cfg.max_epochs,
            "batch_size": cfg.batch_size, "lr_grid": list(cfg.lr_grid),
            "trials": [_trial_row(t) for t in trials],
            "history_at_capacity": [{k: h[k] for k in ("step", "epoch", "loss", "exact_match",
                                                       "hnorm")} for h in at["history"]]
            if at else [],
            "hnorm_at_capacity": at["hnorm"] if at else [],
            "step_mode": trials[0]["step_mode"] if trials else None,
            "unfinished": bool(result.get("unfinished")), **_trials_env(trials, env)}
