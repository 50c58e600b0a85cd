"""A study's verdicts from its rows: every number with the seeds it rests on and their
spread, and each experiment's direction against the paper's.

Spread: over seeds, n, mean, sample standard deviation, min and max. A comparison of two
arms pairs their runs by seed (the same data order and initialisation seed) and gives the
gap a - b for each pair, and on how many pairs the gap has the paper's sign. Its verdict:
"same direction" or "opposite" as the mean gap has the paper's sign or not, and "outside
the noise" only when the two arms' seed ranges do not overlap (every seed of one below
every seed of the other), else "within the noise"; one seed gives "one seed, no spread"
(an anecdote, not a verdict).
"""
from __future__ import annotations

import math

from .plan import INITS, PAPER_PRESETS, PEER_PRESET, base_pair, experts_sweep

PAPER = {
    "pair": "MoRE 7-15 % lower PPL than its matched MoE on the first three pairs (40B "
            "tokens; tab:fineweb_p3_results), and the gap grows with the tokens "
            "(fig:gap_vs_tokens_ep_pair)",
    "experts": "MoRE (r = 64, h = 512, s = 56): PPL falls monotonically, 19.10 -> 17.05, as "
               "M goes 112 -> 1,792 (5B tokens; fig:more_experts)",
    "rank": "at matched FLOPs PPL falls as r shrinks and M grows, 18.35 -> 14.90 for r = "
            "256 -> 16 (10B tokens; fig:rank_sweeps)",
    "init": "variance-matched init lowers PPL at r = 16, 32, 64 (400M tokens; "
            "fig:initialization_ablation)",
    "router-lr": "the best router LR is the global LR at every rank (500M tokens; "
                 "fig:rlr_switch)",
    "paper": "1B tokens, h = 512: MoE-256 24.26, MoRE-1792 24.13, PEER 24.17 "
             "(tab:peer_quality)"}


def stats(values) -> dict:
    v = [x for x in values if x is not None]
    if not v:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"n": len(v), "mean": mean, "std": std, "min": min(v), "max": max(v)}


def verdict(a: list[float], b: list[float], gap_mean: float | None, *,
            paper_sign: int) -> str:
    """The verdict of the gap a - b (module docstring); paper_sign +1 when the paper finds
    b lower (a - b > 0), -1 when it finds a lower."""
    if gap_mean is None:
        return "not measured"
    direction = "same direction" if gap_mean * paper_sign > 0 else "opposite"
    if min(len(a), len(b)) < 2:
        return f"{direction}, one seed, no spread"
    apart = max(a) < min(b) or max(b) < min(a)
    return f"{direction}, {'outside' if apart else 'within'} the noise"


def compare(rows_a: dict, rows_b: dict, *, paper_sign: int, key: str = "val_loss") -> dict:
    """Arms a and b ({seed: row}): their spreads, the gap a - b paired by seed, and the
    gap in perplexity as a percentage of a's."""
    a = [r[key] for r in rows_a.values()]
    b = [r[key] for r in rows_b.values()]
    seeds = sorted(set(rows_a) & set(rows_b))
    gaps = [rows_a[s][key] - rows_b[s][key] for s in seeds]
    pct = [100 * (rows_a[s]["val_ppl"] - rows_b[s]["val_ppl"]) / rows_a[s]["val_ppl"]
           for s in seeds]
    g = stats(gaps)
    return {"a": stats(a), "b": stats(b), "a_ppl": stats(r["val_ppl"] for r in rows_a.values()),
            "b_ppl": stats(r["val_ppl"] for r in rows_b.values()), "gap": g,
            "gap_ppl_pct": stats(pct), "seeds": seeds,
            "paper_sign_seeds": sum(x * paper_sign > 0 for x in gaps),
            "verdict": verdict(a, b, g["mean"], paper_sign=paper_sign)}


def _arm(runs, rows, exp: str, arm: str, tokens: int | None = None) -> dict:
    """{seed: row} of the finished runs of one arm (at one budget) that have a loss: a run
    that diverged is no seed of its arm (the report lists it under "diverged")."""
    return {r.seed: rows[r.name] for r in runs if (exp, arm) in r.uses and r.name in rows
            and rows[r.name]["val_loss"] is not None
            and (tokens is None or r.tokens == tokens)}


def _mean_of(arm: dict, key: str):
    return stats(r[key] for r in arm.values())


def pair_report(settings, runs, rows) -> dict:
    from .plan import arm_label
    moe, more = (arm_label(m) for m in base_pair(settings))
    budgets = []
    for tokens in settings.budgets:
        a, b = _arm(runs, rows, "pair", moe, tokens), _arm(runs, rows, "pair", more, tokens)
        entry = {"tokens": tokens, **compare(a, b, paper_sign=+1)}
        for side, arm in (("a", a), ("b", b)):
            entry[f"{side}_tokens_per_param"] = _mean_of(arm, "tokens_per_param")["mean"]
            entry[f"{side}_epochs"] = _mean_of(arm, "epochs")["mean"]
            entry[f"{side}_wall_s"] = _mean_of(arm, "wall_s")["mean"]
            entry[f"{side}_params"] = next((r["params"] for r in arm.values()), None)
        budgets.append(entry)
    paired = [b["tokens"] for b in budgets if b["gap"]["n"]]
    longest = max(paired or settings.budgets)     # the longest budget measured so far
    curve = _gap_curve(_arm(runs, rows, "pair", moe, longest),
                       _arm(runs, rows, "pair", more, longest))
    trend = [b["gap"]["mean"] for b in budgets if b["gap"]["mean"] is not None]
    grows = (None if len(trend) < 2 else all(y > x for x, y in zip(trend, trend[1:])))
    return {"a": moe, "b": more, "budgets": budgets, "curve": curve, "curve_tokens": longest,
            "gap_grows_with_tokens": grows, "paper": PAPER["pair"]}


def _gap_curve(a: dict, b: dict) -> list[dict]:
    """At each fixed mark of the runs given (the longest budget measured): both arms'
    spreads and the paired gap."""
    def at(row):
        return {e["tokens"]: e["val_loss"] for e in row["evals"] if e["val_loss"] is not None}
    ea, eb = {s: at(r) for s, r in a.items()}, {s: at(r) for s, r in b.items()}
    marks = sorted(set().union(*ea.values(), *eb.values())) if ea or eb else []
    out = []
    for t in marks:
        va = [e[t] for e in ea.values() if t in e]
        vb = [e[t] for e in eb.values() if t in e]
        gaps = [ea[s][t] - eb[s][t] for s in set(ea) & set(eb) if t in ea[s] and t in eb[s]]
        out.append({"tokens": t, "a": stats(va), "b": stats(vb), "gap": stats(gaps)})
    return out


def _sweep(runs, rows, exp: str, arms: list[tuple], tokens: int) -> list[dict]:
    out = []
    for key, arm in arms:
        a = _arm(runs, rows, exp, arm, tokens)
        out.append({"x": key, "arm": arm, "loss": _mean_of(a, "val_loss"),
                    "ppl": _mean_of(a, "val_ppl"),
                    "params": next((r["params"] for r in a.values()), None)})
    return out


def _monotone_verdict(points: list[dict], *, falling: bool) -> str:
    """Whether the mean loss falls along the points (falling) and whether the two ends'
    seed ranges are apart."""
    means = [p["loss"]["mean"] for p in points if p["loss"]["n"]]
    if len(means) < 2:
        return "not measured"
    steps = [(y < x) == falling for x, y in zip(means, means[1:])]
    ends = [p for p in points if p["loss"]["n"]]
    first, last = ends[0]["loss"], ends[-1]["loss"]
    same = (last["mean"] < first["mean"]) == falling
    shape = ("monotone" if all(steps) else f"{sum(steps)} of {len(steps)} steps in that direction")
    if min(first["n"], last["n"]) < 2:
        noise = "one seed, no spread"
    else:
        noise = ("ends outside the noise" if last["max"] < first["min"] or first["max"] <
                 last["min"] else "ends within the noise")
    return f"{'same direction' if same else 'opposite'} ({shape}), {noise}"


def experts_report(settings, runs, rows) -> dict:
    from .plan import _Plan, _model, arm_label
    p = _Plan(settings)
    arms = [(M, arm_label(_model(settings, "more", M, p.more["width"], p.more["rank"])))
            for M in experts_sweep(p)]
    points = _sweep(runs, rows, "experts", arms, settings.sweep_tokens)
    return {"points": points, "verdict": _monotone_verdict(points, falling=True),
            "paper": PAPER["experts"]}


def rank_report(settings, runs, rows) -> dict:
    arms = sorted({(r.model["rank"], u[1]) for r in runs for u in r.uses if u[0] == "rank"},
                  reverse=True)
    points = _sweep(runs, rows, "rank", arms, settings.sweep_tokens)
    return {"points": points, "verdict": _monotone_verdict(points, falling=True),
            "paper": PAPER["rank"]}


def init_report(settings, runs, rows) -> dict:
    ranks = []
    for r in settings.init_ranks:
        vm, pe = (_arm(runs, rows, "init", f"r={r} {INITS[i]}", settings.sweep_tokens)
                  for i in INITS)
        ranks.append({"rank": r, **compare(pe, vm, paper_sign=+1)})
    return {"ranks": ranks, "a": "per-entry", "b": "variance-matched", "paper": PAPER["init"]}


def router_lr_report(settings, runs, rows) -> dict:
    arms = [(f, f"{f:g}x") for f in settings.router_lr_factors]
    points = _sweep(runs, rows, "router-lr", arms, settings.sweep_tokens)
    measured = [p for p in points if p["loss"]["n"]]
    if not measured:
        return {"points": points, "best": None, "verdict": "not measured",
                "paper": PAPER["router-lr"]}
    best = min(measured, key=lambda p: p["loss"]["mean"])
    others = [p for p in measured if p is not best]
    if best["loss"]["n"] < 2:
        noise = "one seed, no spread"
    else:
        noise = ("outside the noise" if others and all(best["loss"]["max"] < p["loss"]["min"]
                                                       for p in others) else "within the noise")
    direction = "same direction" if best["x"] == 1 else "opposite"
    return {"points": points, "best": best["x"], "verdict": f"{direction} (best at "
            f"{best['x']:g}x), {noise}", "paper": PAPER["router-lr"]}


def paper_report(settings, runs, rows) -> dict:
    names = PAPER_PRESETS + ((PEER_PRESET,) if settings.peer else ())
    models = []
    for preset in names:
        arm = _arm(runs, rows, "paper", preset)
        row = next(iter(arm.values()), None)
        models.append({"preset": preset, **({k: row[k] for k in (
            "name", "val_loss", "val_ppl", "tokens", "params", "wall_s", "mean_step_ms",
            "tokens_per_param", "epochs")} if row else {"name": preset})})
    a, b = (_arm(runs, rows, "paper", p) for p in PAPER_PRESETS)
    return {"models": models, **compare(a, b, paper_sign=+1), "paper": PAPER["paper"]}


REPORTS = {"pair": pair_report, "experts": experts_report, "rank": rank_report,
           "init": init_report, "router-lr": router_lr_report, "paper": paper_report}


def lr_report(runs, rows) -> dict:
    out = {}
    for r in runs:
        if r.kind == "lr":
            entry = out.setdefault(r.uses[0][1], {"candidates": [], "chosen": None})
            row = rows.get(r.name, {})
            entry["candidates"].append({"lr": r.lr, "val_loss": row.get("val_loss"),
                                        "done": r.name in rows,
                                        "diverged": row.get("diverged")})
    for entry in out.values():
        losses = [c for c in entry["candidates"] if c["val_loss"] is not None]
        if all(c["done"] for c in entry["candidates"]) and losses:
            entry["chosen"] = min(losses, key=lambda c: c["val_loss"])["lr"]
    return out


def study_report(settings, runs, rows, data: dict) -> dict:
    done = [r for r in runs if r.name in rows]
    envs = sorted({(rows[r.name].get("device"), rows[r.name].get("torch"),
                    rows[r.name].get("triton")) for r in done})
    return {"data": data, "runs": {"done": len(done), "total": len(runs)},
            "devices": [{"device": d, "torch": t, "triton": tr} for d, t, tr in envs],
            "commits": sorted({rows[r.name].get("commit") for r in done} - {None}),
            "lr": lr_report(runs, rows),
            "diverged": [{"run": r.name, "kind": r.kind, "lr": rows[r.name]["lr"],
                          "seed": r.seed,
                          "step": rows[r.name]["diverged"]} for r in done
                         if "diverged" in rows[r.name]],
            "experiments": {e: REPORTS[e](settings, runs, rows) for e in settings.experiments}}

