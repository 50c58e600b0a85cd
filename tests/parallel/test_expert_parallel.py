"""Expert parallelism (parallel/expert.py, parallel/sharded_router.py) over 2 and 4 gloo
processes against one process on the same weights and inputs: the paper's (a) with a
replicated and a sharded router, (b) data + expert parallel, their edge cases. Each world
size is spawned once and runs every check of ep_workers.py."""
import json
import os
import socket

import pytest

import ep_workers
from procs import spawn_bounded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, out_dir, timeout_s: float = 240.0) -> None:
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"            # inherited by the spawned ranks
    try:
        spawn_bounded(ep_workers.main, (world, free_port(), str(out_dir)), world, timeout_s)
    finally:                                       # not left to the tests after this one
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


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
