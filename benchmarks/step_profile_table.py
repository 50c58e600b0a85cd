"""Where a training step's milliseconds go (issue 36, part 1): the profiler tables that
`benchmarks/train_pair.sh` writes (PROFILE_STEPS steps after warm-up, sorted by self CUDA
time) turned into one table per preset: component, phase (forward, backward, optimizer),
ms a step, share of the step's GPU time, and the component's floor where one can be named
(FLOPs at the measured bf16 matmul rate, bytes at the measured copy bandwidth).

The compiled model's forward and backward each run as one CUDA graph per micro-step
("## Call CompiledFxGraph"): the profiler charges every kernel inside to that row and
lists the kernels again by name. The phase totals come from those rows (the larger is the
backward); the kernels are itemised from their own rows, and what the table does not
itemise in a phase is its "rest" (the profile lists its 40 largest rows only).

    python benchmarks/step_profile_table.py RESULTS_DIR [--copy-tbps 4.25 --tflops 708]

RESULTS_DIR holds <preset>_x1_profile.txt and <preset>_x1.json (train_pair.sh KEEP=all);
prints markdown."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# (component, phase, pattern on the kernel's name); the first match wins
COMPONENTS = [
    # _reduce_kernel also adds the router's split sparse-gradient pieces (a few µs)
    ("experts: weight gradients (_piece, _reduce)", "backward", r"^_(dw|piece|reduce)_kernel"),
    ("experts: input gradients (_dx, _down_bwd)", "backward", r"^_(dx|down_bwd)_kernel"),
    ("experts: forward (_gate_up, _down)", "forward", r"^_(gate_up|down)_kernel"),
    ("experts: rows gathered and combined", "both", r"^_(combine_pairs|gather\w*|scatter\w*)_kernel"),
    ("router: selection (_exact, _candidates, _pick)", "forward",
     r"^_(exact|candidates|pick|merge)_kernel"),
    ("router: balance statistics (_psum)", "forward", r"^_psum_kernel"),
    ("router: backward (_sparse_cols, _bwd_cols, _bwd_rows)", "backward",
     r"^_(sparse_cols|bwd_cols|bwd_rows)_kernel"),
    ("attention forward (cuDNN)", "forward", r"sdpa.*fprop|flash_fwd"),
    ("attention backward (cuDNN)", "backward", r"sdpa.*bprop|dot_do_o|flash_bwd"),
    ("head + loss: log-softmax forward", "forward", r"log_softmax__to_copy"),
    ("head + loss: log-softmax backward", "backward", r"log_softmax_backward"),
    ("GEMMs (cuBLAS: projections, head, z)", "both", r"^nvjet|gemm|cutlass"),
    ("routing metadata (radix sort)", "both", r"radix_sort"),
    # the profile truncates the names: AdamW's kernel and the other multi-tensor passes
    # (zeroing, scaling) read alike
    ("optimizer: AdamW (one-pass _adamw, torch's fused) and other multi-tensor passes",
     "optimizer", r"^_adamw_kernel|multi_tensor"),
    ("gradient norm (clipping)", "optimizer", r"foreach_norm|multi_tensor_norm"),
    ("copies, fills, elementwise", "both", r"^Memcpy|vectorized_elementwise|elementwise_kernel|reduce_kernel|^triton_"),
]
OP_ROWS = re.compile(r"^(aten::|## Call|Optimizer\.|CompiledFunction|cuda|Command)")


def parse(path: Path) -> tuple[list[tuple[str, float, int]], float, int]:
    """(name, self CUDA ms, calls) of each row of the self-CUDA table, its total, steps."""
    text = path.read_text()
    steps = int(re.match(r"(\d+) steps", text).group(1))
    part = text.split("sorted by self_cuda_time_total", 1)[1].split("sorted by self_cpu", 1)[0]
    rows = []
    for line in part.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 11 or not re.search(r"\d(ms|us|s)$", cells[6]):
            continue
        rows.append((cells[0], _ms(cells[6]), int(cells[-1])))
    total = _ms(re.search(r"Self CUDA time total: (\S+)", text).group(1))
    return rows, total, steps


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(ms|us|s)$", text).groups()
    return float(value) * {"ms": 1.0, "us": 1e-3, "s": 1e3}[unit]


def floors(summary: dict, copy_bps: float, flops: float, micro: int) -> dict:
    """Floors (ms a step) of the components whose work is plain: the experts' weight
    gradients (their FLOPs, or the fp32 gradients read and written on micro-steps 2 to 4
    and written on the first), their forward and input gradients (FLOPs), AdamW (fp32
    moments: 28 bytes a parameter)."""
    m = summary["model"]
    tokens = summary["global_batch"] * summary["seq_len"]
    pairs = tokens * m["top_k"]
    n_exp = m["layers"] * m["experts"] * 3 * m["hidden"] * m["width"]
    dw_flops = 2 * pairs * 3 * m["hidden"] * m["width"] * m["layers"]
    dw_bytes = n_exp * 4 * (2 * micro - 1)
    return {
        "experts: weight gradients (_piece, _reduce)":
            1e3 * max(dw_flops / flops, dw_bytes / copy_bps),
        "experts: forward (_gate_up, _down)": 1e3 * dw_flops / flops,
        "experts: input gradients (_dx, _down_bwd)": 1e3 * dw_flops / flops,
        "optimizer: AdamW (one-pass _adamw, torch's fused) and other multi-tensor passes":
            1e3 * 28 * summary["params"] / copy_bps,
    }


def table(results: Path, preset: str, copy_bps: float, flops: float) -> str:
    rows, total, steps = parse(results / f"{preset}_x1_profile.txt")
    summary = json.loads((results / f"{preset}_x1.json").read_text())
    cfg = json.loads((results / f"{preset}_x1_log.jsonl").read_text().splitlines()[0])["config"]
    summary["model"] = cfg["model"]
    micro = cfg["train"]["grad_accum"]
    graphs = sorted(ms for name, ms, _ in rows if name.startswith("## Call CompiledFxGraph"))
    phase_ms = {"forward": graphs[0] / steps if graphs else None,
                "backward": graphs[-1] / steps if len(graphs) > 1 else None}
    step_ms = total / steps
    per = {}
    for name, ms, _calls in rows:
        if OP_ROWS.match(name):
            continue
        comp = next(((c, ph) for c, ph, pat in COMPONENTS if re.search(pat, name)),
                    ("other kernels (listed)", "both"))
        per[comp] = per.get(comp, 0.0) + ms / steps
    fl = floors(summary, copy_bps, flops, micro)
    out = [f"### {summary['name']} ({preset}): {step_ms:.1f} ms of GPU time a step "
           f"(the trainer's mean step {summary['mean_step_ms']:.1f} ms), {steps} steps profiled",
           "", "| component | phase | ms a step | share | floor ms | ms / floor |",
           "|---|---|---|---|---|---|"]
    for (comp, ph), ms in sorted(per.items(), key=lambda kv: -kv[1]):
        f = fl.get(comp)
        out.append(f"| {comp} | {ph} | {ms:.1f} | {100 * ms / step_ms:.1f} % | "
                   f"{'-' if f is None else f'{f:.1f}'} | "
                   f"{'-' if f is None else f'{ms / f:.0f}x'} |")
    for ph in ("forward", "backward"):
        if phase_ms[ph] is not None:
            listed = sum(ms for (c, p), ms in per.items() if p == ph)
            out.append(f"| {ph}: the rest (not itemised) | {ph} | "
                       f"{phase_ms[ph] - listed:.1f} | "
                       f"{100 * (phase_ms[ph] - listed) / step_ms:.1f} % | - | - |")
    out += ["", f"Phases: forward {phase_ms['forward'] or 0:.1f} ms, backward "
            f"{phase_ms['backward'] or 0:.1f} ms (the compiled graphs' rows, {micro} "
            f"micro-steps), the rest of the step {step_ms - (phase_ms['forward'] or 0) - (phase_ms['backward'] or 0):.1f} ms "
            "(optimizer, gradient norm, zeroing, between the graphs). Rows listed as 'both' "
            "are counted in neither phase's rest.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--presets", nargs="+", default=["h512-s64-moe256", "h512-s64-more1792"])
    p.add_argument("--copy-tbps", type=float, default=4.25,
                   help="measured copy bandwidth, TB/s (H200: 4.25, attention.jsonl)")
    p.add_argument("--tflops", type=float, default=708.0,
                   help="measured bf16 matmul rate, TFLOP/s (H200: 708)")
    args = p.parse_args(argv)
    for preset in args.presets:
        print(table(args.results, preset, args.copy_tbps * 1e12, args.tflops * 1e12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
