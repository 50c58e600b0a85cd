"""The phonebook's compiled step (`bench phonebook --modes compiled`: the blocks
torch.compile'd, the whole step one CUDA graph) with inductor options off and on, each
variant in a fresh process (dynamo's caches and inductor's config are per process): ms a
step (median of device-event windows after warm-up) and the kernels a step launches, with
the most launched. Issue 54 part 3: the step is launch-bound (587 kernels for MoE-32 at
7bf53c2, about 2.3 us a kernel at the margin), and the most launched kernels are small
pointwise ones launched once a weight (casts `triton_poi_fused__to_copy_*`, 24 a step
each): inductor's combo kernels put independent ones of a graph in one launch.

    PYTHONPATH=src python benchmarks/phonebook_inductor_ab.py OUT.jsonl
    PYTHONPATH=src python benchmarks/phonebook_inductor_ab.py OUT.jsonl --variants base,combo
    PYTHONPATH=src python benchmarks/phonebook_inductor_ab.py --list

Variants (the compile options the step's blocks get, phonebook.step.COMPILE_OPTIONS; the
package's default is `combo` since 4936895's measurement, `base` is inductor's defaults):
    base        {}
    combo       {"combo_kernels": True}
    combo_pw    {"combo_kernels": True, "combo_kernels_pointwise_only": True}
    combo_mm    combo, and the GEMMs autotuned against Triton's templates
                ({"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"})

Rows: bench "phonebook_inductor", variant, options, model, ms, kernels, copies, top_kernels,
device, versions, commit, date; appended to OUT as each is measured. Needs a CUDA GPU (the
compiled mode captures a CUDA graph).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys

VARIANTS = {"base": {}, "combo": {"combo_kernels": True},
            "combo_pw": {"combo_kernels": True, "combo_kernels_pointwise_only": True},
            # the GEMMs autotuned against Triton's templates too: cuBLAS's split-K weight
            # gradients at h = 64 launch a reduce kernel each (25 a step)
            "combo_mm": {"combo_kernels": True, "max_autotune_gemm": True,
                         "max_autotune_gemm_backends": "ATEN,TRITON"}}
MODELS = ("MoE-32", "MoRE-96")


def _measure(variant: str, model: str, queue) -> None:
    """In a fresh process: the step of `model` compiled with VARIANTS[variant]."""
    try:
        import torch

        from moremoe.phonebook import bench, step
        from moremoe.runtime import environment
        step.COMPILE_OPTIONS = dict(VARIANTS[variant])    # this process's compiles only
        device = torch.device("cuda")
        bench._MODELS.clear()
        bench._MODELS.update(bench.MODELS)
        row = bench.measure_step(model, "compiled", device, quick=False)
        queue.put({"bench": "phonebook_inductor", **row, "variant": variant,
                   "options": VARIANTS[variant], **environment(device)})
    except Exception as err:                       # the row says what failed
        queue.put({"bench": "phonebook_inductor", "variant": variant, "model": model,
                   "options": VARIANTS[variant], "error": f"{type(err).__name__}: {err}"[:400]})


def _result(proc, queue, variant: str, model: str) -> dict:
    """The child's row, or an error row where it died without one (a crash in a kernel)."""
    import queue as queue_mod
    while True:
        try:
            return queue.get(timeout=5)
        except queue_mod.Empty:
            if not proc.is_alive():
                return {"bench": "phonebook_inductor", "variant": variant, "model": model,
                        "options": VARIANTS[variant],
                        "error": f"the process exited with code {proc.exitcode}, no row"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="JSONL file the rows are appended to")
    ap.add_argument("--variants", default="base,combo",
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default base,combo)")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)} and MoRE-768")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, options in VARIANTS.items():
            print(f"{name:10s} {json.dumps(options)}")
        return 0
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"error: --variants: unknown {', '.join(bad)}; expected some of "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in (*MODELS, "MoRE-768")]
    if bad:
        print(f"error: --models: unknown {', '.join(bad)}; expected some of "
              f"{', '.join((*MODELS, 'MoRE-768'))}", file=sys.stderr)
        return 2
    if not args.out:
        print("error: OUT: the JSONL file to append rows to is missing", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("error: the compiled step captures a CUDA graph: run this on a GPU",
              file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    print(f"{'variant':10s} {'model':9s} {'ms a step':>10s} {'kernels':>8s}")
    for model in models:
        for variant in variants:
            queue = ctx.Queue()
            proc = ctx.Process(target=_measure, args=(variant, model, queue))
            proc.start()
            row = _result(proc, queue, variant, model)
            proc.join()
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            if "error" in row:
                print(f"{variant:10s} {model:9s} error: {row['error']}")
            else:
                print(f"{variant:10s} {model:9s} {row['ms']:10.3f} {row.get('kernels', 0):8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
