"""What ``moremoe bench ep`` prints and draws from its rows: the table (the paper's columns:
router, experts, comm., total per flow, variant and M), the issue's targets read off the
rows (met or not), and ep.png, stacked bars of router / experts / comm per configuration,
MoE beside MoRE, the measured total marked on each (below the stack where communication
overlaps the experts)."""
from __future__ import annotations

from pathlib import Path

from ..report import save_figure, table
from .router_plots import _pyplot

FLOW_NAMES = {"a": "(a) replicated", "b": "(b) local", "one_gpu": "one GPU"}
VARIANT_NAMES = {"moe_torch": "MoE torch router", "moe_fused": "MoE fused router",
                 "more": "MoRE", "more_sharded": "MoRE sharded router",
                 "more_one_chunk": "MoRE, comm. not overlapped"}
STACK = (("router_ms", "router", "C3"), ("experts_ms", "experts", "C2"),
         ("comm_ms", "comm.", "C0"))
TARGET_M = 8192
# the targets at M = 8,192 (issue 37; the MoE ratios are issue 26's, the paper's table's)
TARGETS = {"a_forward": 3.0, "b_forward": 3.0, "b_train_share": 0.6, "exchange_gbps": 250.0,
           "exchange_of_peer": 0.70, "sharded_backward": 1.5, "a_over_torch": 3.0,
           "b_over_torch": 1.6, "merge_share": 0.10}


def latest(rows) -> dict:
    """{(E, flow, variant, M, phase): row}, the newest timed row of each point."""
    out = {}
    for r in rows:
        if r.get("bench") == "ep" and r.get("ms") is not None:
            out[(r["E"], r["flow"], r["variant"], r["M"], r["phase"])] = r
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def table_text(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r.get("oom"):
            out.append([FLOW_NAMES[r["flow"]], VARIANT_NAMES[r["variant"]], r["phase"],
                        f"{r['M']:,}", "OOM", "", "", "", "", ""])
            continue
        parts = sum(r.get(k) or 0.0 for k, _, _ in STACK)
        out.append([FLOW_NAMES[r["flow"]], VARIANT_NAMES[r["variant"]], r["phase"],
                    f"{r['M']:,}", _ms(r.get("router_ms")), _ms(r.get("merge_ms")),
                    _ms(r.get("experts_ms")), _ms(r.get("comm_ms")), _ms(r["ms"]),
                    _ms(parts)])
    return table(out, ["flow", "variant", "pass", "M", "router", "merge", "experts", "comm.",
                       "total ms", "sum of phases"]) + (
        "\n(ms; each phase timed alone; the total overlaps communication with the experts, "
        "so it can be below the sum of its phases)")


def _ratio(a, b):
    return a / b if a and b else None


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets at M = 8,192, per E present: what, value, target, met."""
    pts, out = latest(rows), []
    for E in sorted({key[0] for key in pts if key[1] != "one_gpu" and key[3] == TARGET_M}):
        def ms(flow, variant, phase="forward"):
            r = pts.get((E, flow, variant, TARGET_M, phase))
            return r and r["ms"]

        def add(what, value, target, low_is_good=True, unit=" ms"):
            met = None if value is None or target is None else (
                value <= target if low_is_good else value >= target)
            out.append({"E": E, "what": what, "value": value, "target": target, "met": met,
                        "le": low_is_good, "unit": unit})
        add("(a) MoRE forward", ms("a", "more"), TARGETS["a_forward"])
        add("(b) MoRE forward", ms("b", "more"), TARGETS["b_forward"])
        add("(b) MoRE forward+backward over one GPU's",
            _ratio(ms("b", "more", "forward+backward"),
                   ms("one_gpu", "more", "forward+backward")), TARGETS["b_train_share"],
            True, "x")
        b = pts.get((E, "b", "more", TARGET_M, "forward"), {})
        rate = _ratio(b.get("wire_bytes") and b["wire_bytes"] / 2 / 1e9,
                      b.get("comm_ms") and b["comm_ms"] / 1e3)      # out and back: /2
        peer = b.get("link_peer_copy_gbps")
        add("(b) exchange, GB/s a direction", rate, TARGETS["exchange_gbps"], False,
            " GB/s")
        add("(b) exchange over the peer copy", _ratio(rate, peer), TARGETS["exchange_of_peer"],
            False, "")

        def backward(variant):
            r = pts.get((E, "a", variant, TARGET_M, "forward+backward"), {})
            f = pts.get((E, "a", variant, TARGET_M, "forward"), {})
            return (r.get("router_ms") - f.get("router_ms")
                    if r.get("router_ms") is not None and f.get("router_ms") is not None
                    else None)
        add("sharded router's backward over the plain router's",
            _ratio(backward("more_sharded"), backward("more")), TARGETS["sharded_backward"],
            True, "x")
        for flow in ("a", "b"):
            add(f"({flow}) MoRE over MoE with the plain-torch router",
                _ratio(ms(flow, "moe_torch"), ms(flow, "more")), TARGETS[f"{flow}_over_torch"],
                False, "x")
            add(f"({flow}) MoRE over MoE with our fused router (reported)",
                _ratio(ms(flow, "moe_fused"), ms(flow, "more")), None, False, "x")
        sharded = pts.get((E, "a", "more_sharded", TARGET_M, "forward"), {})
        add("sharded router: merge / router phase",
            _ratio(sharded.get("merge_ms"), sharded.get("router_ms")), TARGETS["merge_share"],
            True, "")
    return out


def link_text(rows: list[dict]) -> str:
    """The newest run's link rates (every row of a run carries them)."""
    r = next((r for r in reversed(rows) if r.get("link_bytes")), None)
    if r is None:
        return ""
    rate = {k: "-" if r.get(f"link_{k}_gbps") is None else f"{r[f'link_{k}_gbps']:.0f}"
            for k in ("peer_copy", "send_recv", "all_to_all")}
    return (f"\nlink at {r['link_bytes'] / 2 ** 20:g} MiB a peer, GB/s a direction: peer copy "
            f"{rate['peer_copy']}, send/recv {rate['send_recv']}, all-to-all "
            f"{rate['all_to_all']}")


def summary_text(rows: list[dict]) -> str:
    lines = []
    for t in targets(rows):
        v, unit = t["value"], t["unit"]
        value = "not measured" if v is None else (
            f"{100 * v:.1f}%" if unit == "" else f"{v:.2f}{unit}")
        goal = "" if t["target"] is None else (
            f" (target {'<=' if t['le'] else '>='} "
            + (f"{100 * t['target']:.0f}%" if unit == "" else f"{t['target']}{unit}") + ": "
            + {True: "met", False: "missed", None: "-"}[t["met"]] + ")")
        lines.append(f"E={t['E']}, M={TARGET_M:,}: {t['what']}: {value}{goal}")
    return link_text(rows) + "\n" + "\n".join(
        lines or [f"targets: no expert-parallel rows at M={TARGET_M:,}"])


def render_ep(rows: list[dict], out_dir) -> list[Path]:
    pts = latest(rows)
    phases = [p for p in ("forward", "forward+backward") if any(k[4] == p for k in pts)]
    if not phases:
        return []
    plt = _pyplot()
    groups = sorted({k[:2] + (k[3],) for k in pts}, key=lambda g: (g[0], list(FLOW_NAMES)
                                                                   .index(g[1]), g[2]))
    fig, axes = plt.subplots(len(phases), 1, figsize=(max(9, 1.1 * len(groups) * 3), 5.5 *
                                                      len(phases)), squeeze=False)
    for ax, phase in zip(axes[:, 0], phases):
        x, ticks = 0.0, []
        for E, flow, M in groups:
            for variant in VARIANT_NAMES:
                r = pts.get((E, flow, variant, M, phase))
                if r is None:
                    continue
                bottom = 0.0
                for key, name, color in STACK:
                    v = r.get(key) or 0.0
                    ax.bar(x, v, bottom=bottom, color=color, width=0.8,
                           hatch="//" if variant.startswith("moe") else None)
                    bottom += v
                ax.plot([x - 0.4, x + 0.4], [r["ms"]] * 2, color="k", lw=1.5)
                ax.text(x, max(bottom, r["ms"]), _ms(r["ms"]), ha="center", va="bottom",
                        fontsize=6)
                where = FLOW_NAMES[flow] + (f" E={E}" if flow != "one_gpu" else "")
                ticks.append((x, f"{VARIANT_NAMES[variant]}\n{where}\nM={M:,}"))
                x += 1
            x += 0.7
        ax.set_xticks([p for p, _ in ticks], [t for _, t in ticks], fontsize=5, rotation=90)
        ax.set_ylabel("ms")
        ax.set_title(f"one layer, {phase} (hatched: MoE; {rows[-1].get('device', '')})",
                     fontsize=9)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, _, c in STACK]
        handles.append(plt.Line2D([], [], color="k", lw=1.5))
        ax.legend(handles, [n for _, n, _ in STACK] + ["total (measured)"], fontsize=7)
    path = Path(out_dir) / "ep.png"
    save_figure(fig, path)
    return [path]
