"""``moremoe bench ep`` under torchrun: every rank measures (the collectives need them all);
rank 0 checks the output first, appends the rows and prints. A rank that stops (out of
memory inside a collective: bench/ep.py no_recovery) stops the others with a one-line
error each, not a wait."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..checks import UserError
from ..report import check_output_file
from ..report import emit as _emit
from ..runtime import eta_text


def _peer_stopped(err: RuntimeError) -> bool:
    """Whether a collective failed because a peer rank went away (gloo's closed connection,
    NCCL's error or timeout), not a fault of this rank's own."""
    import torch.distributed as dist
    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo",
                            "NCCL", "timed out"))


def _ep_setup(args):
    """(device, output file) of `bench ep` on this rank, after every check that can refuse
    the run (rank 0 checks the output and tells the others, so all stop together)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from ..bench import harness
    from ..kernels import HAS_TRITON, INTERPRET
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "RANK" not in os.environ:
        raise UserError(f"bench ep runs one process per GPU: launch it with `torchrun "
                        f"--nproc_per_node E -m moremoe.cli bench ep` (E >= 2 GPUs); this "
                        f"is {world} process")
    cuda = torch.cuda.is_available()
    if not HAS_TRITON or not (cuda or (args.quick and INTERPRET)):
        raise UserError("bench ep needs Triton and CUDA GPUs (or --quick with "
                        "TRITON_INTERPRET=1 for a code-path check on the CPU, over gloo)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            out = check_output_file(Path(args.out) if args.out else (
                Path("benchmarks/results") / harness.device_slug(device) / "ep.jsonl"), "--out")
            if out.is_file() and out.stat().st_size:
                harness.read_rows_of(out, "ep", "--out")
            box[0] = str(out)
        except (ValueError, UserError) as err:
            box[1] = f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(box, src=0)
    return device, box


def run_ep(args) -> int:
    """`bench ep` under torchrun: every rank measures (the collectives need them all), rank
    0 appends the rows, draws and prints; the others print nothing."""
    import os
    import torch.distributed as dist
    from ..bench import ep, ep_plots, harness
    if args.plot_only:
        if int(os.environ.get("RANK", "0")):
            return 0
        from .bench import _plot_only
        return _plot_only(args, "ep", ep_plots.render_ep)
    device, (out, refused) = _ep_setup(args)
    try:
        rank = dist.get_rank()
        if refused:
            if rank == 0:
                raise (ValueError if refused.startswith("ValueError") else UserError)(
                    refused.split(": ", 1)[1])
            return 2
        rows, start = [], time.monotonic()

        def progress(i, n, row):
            if rank or args.no_progress:
                return
            value = "OOM" if row.get("oom") else f"{row['ms']:.3f} ms"
            print(f"[{i}/{n}] ep ({row['flow']}) {row['variant']} {row['phase']} "
                  f"M={row['M']}: {value} ({eta_text(i, n, time.monotonic() - start)})",
                  file=sys.stderr, flush=True)

        try:
            for row in ep.run_ep(device, quick=args.quick, progress=progress):
                if rank == 0:
                    rows.append(row)
                    harness.append_jsonl(out, [row])
        except RuntimeError as err:
            if not _peer_stopped(err):
                raise
            raise UserError(f"rank {rank}: a collective failed because another rank stopped "
                            f"({str(err).splitlines()[0][:160]}); that rank's own error "
                            f"says why; the rows measured before it are in {out}") from None
        if rank:
            return 0
        all_rows = harness.read_jsonl(out)
        paths = ep_plots.render_ep(all_rows, Path(out).parent)
        _emit(args, {"rows": rows, "file": out, "plots": [str(p) for p in paths],
                     "targets": ep_plots.targets(all_rows)},
              ep_plots.table_text(rows) + ep_plots.summary_text(all_rows) + f"\nrows: {out}"
              f"\nplots: " + ", ".join(map(str, paths)))
        return 0
    finally:
        dist.destroy_process_group()
