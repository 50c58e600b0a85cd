"""Our fused low-rank inference router against the two anchor programs (../shared/anchors:
the paper's Algorithm 1 written plainly, and the faster router prototype), shape by shape,
with issue 54's targets: ours <= the prototype at every shape both ran, h = 512, M = 8,192,
k = 4 <= 1.2 ms, M = 512 <= 0.20 ms.

    python benchmarks/router_anchors_table.py OUT/router.jsonl OUT/fast_router.jsonl
    python benchmarks/router_anchors_table.py ROUTER FAST --json     # one JSON row a shape

ROUTER: `moremoe bench router` rows (inference, the fused low-rank router, its own
Algorithm 1 and the plain torch router). FAST: `fast_router.py`'s JSON lines (its best
prototype variant and its Algorithm 1 at each shape, the fastest configuration of each).
"ours" is the default configuration (the one-pass selection at k <= 8 since the fourteenth
session); "candidates" the fastest of the candidates pass's rows (`--sweeps tune`, config
path=candidates: the default before), when the run has them. Shapes are matched on (h, M, k,
r, N); every time is a median of device-event timings, and
only rows of one device are put side by side (a mix is refused).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = {(512, 8192, 4): 1.2, (512, 512, 4): 0.20}     # (h, M, k) -> ms, issue 54


def _lines(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise SystemExit(f"error: {path}:{n} is not a JSON line; give the bench's or "
                                 f"the anchor's output file") from None
    return rows


def ours(rows: list[dict]) -> tuple[dict, set]:
    """{(h, M, k, r, N): {impl: ms}} of the low-rank inference rows; the devices seen."""
    out, devices = {}, set()
    for r in rows:
        if r.get("bench") != "router" or r.get("phase") != "inference" or \
                r.get("router") != "lowrank" or r.get("ms") is None:
            continue
        key = (r["h"], r["M"], r["k"], r["r"], r["N"])
        got = out.setdefault(key, {})
        impl = r["impl"]
        if r.get("sweep") == "tune":   # ours is the default; the candidates pass apart
            if (r.get("config") or {}).get("path") != "candidates":
                continue
            impl = "candidates"
        got[impl] = min(r["ms"], got.get(impl, float("inf")))
        if r.get("floor_ms") is not None:
            got["floor"] = r["floor_ms"]
        devices.add(r.get("device"))
    return out, devices


def anchors(rows: list[dict]) -> tuple[dict, set]:
    """{(h, M, k, r, N): {"prototype": ms, "anchor_alg1": ms}}: each the fastest
    configuration of its variant family (prototype: the top-2 variants; the skeleton
    `floor_*` rows are no router)."""
    out, devices = {}, set()
    for r in rows:
        if "device" in r and "v" not in r:
            devices.add(r["device"])
            continue
        if r.get("ms") is None or "v" not in r:
            continue
        kind = ("prototype" if r["v"].startswith("top2f") else
                "anchor_alg1" if r["v"] == "alg1" else None)
        if kind is None:
            continue
        got = out.setdefault((r["h"], r["M"], r["k"], r["r"], r["N"]), {})
        got[kind] = min(r["ms"], got.get(kind, float("inf")))
    return out, devices


def join(router_rows: list[dict], fast_rows: list[dict]) -> list[dict]:
    a, dev_a = ours(router_rows)
    b, dev_b = anchors(fast_rows)
    devices = {d for d in dev_a | dev_b if d}
    if len(devices) > 1:
        raise SystemExit(f"error: the files hold rows of {len(devices)} devices "
                         f"({', '.join(sorted(devices))}); give the files of one run")
    out = []
    for key in sorted(set(a) | set(b)):
        h, M, k, r, N = key
        t = {**a.get(key, {}), **b.get(key, {})}
        row = {"h": h, "M": M, "k": k, "r": r, "N": N, "ours_ms": t.get("triton"),
               "candidates_ms": t.get("candidates"),
               "prototype_ms": t.get("prototype"), "alg1_ms": t.get("alg1"),
               "anchor_alg1_ms": t.get("anchor_alg1"), "unfused_ms": t.get("unfused"),
               "floor_ms": t.get("floor"), "target_ms": TARGETS.get((h, M, k))}
        mine, proto = row["ours_ms"], row["prototype_ms"]
        row["ours_over_prototype"] = mine / proto if mine and proto else None
        row["meets"] = None if mine is None else (
            (proto is None or mine <= proto) and
            (row["target_ms"] is None or mine <= row["target_ms"]))
        out.append(row)
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| h | M | k | ours | candidates | prototype | ours / prototype | "
             "Algorithm 1 (anchor) | Algorithm 1 (ours) | unfused | floor | target | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ours_over_prototype"] is None else f"{r['ours_over_prototype']:.2f}"
        met = {None: "-", True: "yes", False: "**no**"}[r["meets"]]
        lines.append(f"| {r['h']} | {r['M']:,} | {r['k']} | {_ms(r['ours_ms'])} | "
                     f"{_ms(r['candidates_ms'])} | {_ms(r['prototype_ms'])} | {ratio} | "
                     f"{_ms(r['anchor_alg1_ms'])} | "
                     f"{_ms(r['alg1_ms'])} | {_ms(r['unfused_ms'])} | {_ms(r['floor_ms'])} | "
                     f"{_ms(r['target_ms'])} | {met} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("router", type=Path, help="`moremoe bench router` rows (JSON lines)")
    ap.add_argument("fast", type=Path, help="fast_router.py's output (JSON lines)")
    ap.add_argument("--json", action="store_true", help="one JSON row a shape")
    args = ap.parse_args(argv)
    for p in (args.router, args.fast):
        if not p.is_file():
            raise SystemExit(f"error: {p}: no such file; give the JSON lines of one run")
    rows = join(_lines(args.router), _lines(args.fast))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
