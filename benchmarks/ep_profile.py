"""Where the time of one expert-parallel layer goes: torch.profiler over a few forwards of
`moremoe bench ep`'s layer (flow, variant and M as its rows), rank 0's table of the busiest
operators on the device and on the host, and the layer's device-event time beside it.

    torchrun --standalone --nproc_per_node 2 benchmarks/ep_profile.py --flow b --M 8192
    (PYTHONPATH=src; --phase forward+backward for a training step's layer)

Prints two tables (top --rows operators by self device time, then by self host time) and
one line of medians; writes nothing.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from moremoe.bench.ep import EPSetup, Phases, _build, config, inputs
from moremoe.bench.harness import time_fixed_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flow", choices=("a", "b"), default="b")
    p.add_argument("--variant", default="more")
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--phase", choices=("forward", "forward+backward"), default="forward")
    p.add_argument("--rows", type=int, default=18)
    args = p.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    setup = EPSetup()
    layer = _build(config(setup, args.variant, args.M), args.flow, args.variant, args.phase,
                   device, setup.chunks)
    x = inputs(setup, args.flow, device, dist.get_rank(), dist.get_world_size())
    ph = Phases(layer, args.flow, x, args.phase, device)
    fns = {"total": ph.total(), "comm": ph.comm(), "experts": ph.experts(),
           "router": ph.route()}
    times = {name: time_fixed_ms(fn, device=device, warmup=3, reps=10)
             for name, fn in fns.items()}
    dist.barrier(device_ids=[rank])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fns["total"]()
        torch.cuda.synchronize(device)
    dist.barrier(device_ids=[rank])
    if dist.get_rank() == 0:
        table = prof.key_averages()
        print(f"== {args.flow} {args.variant} M={args.M} {args.phase}: 3 calls of the layer, "
              f"rank 0, by self device time")
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows,
                          max_name_column_width=48))
        print("== by self host time")
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                          max_name_column_width=48))
        print("medians (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
