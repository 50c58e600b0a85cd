"""Expert parallelism (parallel/expert.py, parallel/sharded_router.py) over 2 and 4 gloo
processes against one process on the same weights and inputs: the paper's (a) with a
replicated and a sharded router, (b) data + expert parallel, their edge cases. Each world
size is spawned once and runs every check of ep_workers.py."""
import json
import os
import socket
import time

import pytest
import torch.multiprocessing as mp

import ep_workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, out_dir, timeout_s: float = 240.0) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"            # inherited by the spawned ranks
    ctx = mp.start_processes(ep_workers.main, args=(world, free_port(), str(out_dir)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks still running after {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layers_equal_one_process(world, tmp_path):
    spawn(world, tmp_path)
    failed = {}
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert list(results) == [c.__name__ for c in ep_workers.CHECKS]
        failed.update({f"rank {rank} {name}": out for name, out in results.items()
                       if out != "ok"})
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
