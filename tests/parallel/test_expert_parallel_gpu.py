"""Expert parallelism on 2 and 4 GPUs with NCCL (`pytest -m gpu` on a machine with them): at
a moderate size in bf16, with the fused kernels, (a) with the replicated and the sharded
router and (b) with uneven ranks route exactly as one GPU does and give its outputs and
every gradient (ep_workers' comparisons, run by spawned processes). At E = 4, (b) also runs
the routing issue's case (h = 512, M = 8,192, r = 64, k = 4, 16,384 rows in quarters of
uneven size): each rank's router sees a quarter, one GPU the whole, and the indices must be
equal."""
import json
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

H, S, R, M, K, N = 256, 64, 32, 64, 4, 2048


def _check(rank, world):
    import ep_workers as w
    from moremoe.nn import MoEConfig, MoELayer
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(N, H, device=dev, generator=g).bfloat16()
    wy = torch.randn(N, H, device=dev, generator=g)
    sizes = {2: [N // 2 - 300, N // 2 + 300],
             4: [N // 4 - 300, N // 4 + 100, N // 4 + 300, N // 4 - 100]}[world]
    for cfg in (MoEConfig.moe(M, K, H, S, init_std=0.3), MoEConfig.more(M, K, H, S, R,
                                                                         init_std=0.3)):
        torch.manual_seed(0)
        with torch.device(dev):
            layer = MoELayer(cfg).to(torch.bfloat16).train()
        w.compare_replicated(layer, x, wy)
        if cfg.is_lowrank:
            w.compare_replicated(layer, x, wy, shard_router=True)
        w.compare_local(layer, x, wy, rank, world, sizes)
    if world == 4:
        _check_issue_case(dev, rank, world)


def _check_issue_case(dev, rank, world):
    """Flow (b) at the routing issue's size: chunks small enough (about 4,096 rows a rank)
    to cross the fused routers' batch-size switches, indices equal to one GPU's."""
    import ep_workers as w
    from moremoe.nn import MoEConfig, MoELayer
    n = 16384
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(n, 512, device=dev, generator=g).bfloat16()
    wy = torch.randn(n, 512, device=dev, generator=g)
    sizes = [n // 4 - 1000, n // 4 + 7, n // 4 + 1000, n // 4 - 7]
    torch.manual_seed(0)
    with torch.device(dev):
        layer = MoELayer(MoEConfig.more(8192, 4, 512, 64, 64)).to(torch.bfloat16).train()
    w.compare_local(layer, x, wy, rank, world, sizes)


def _rank(rank, world, port, out_dir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        _check(rank, world)
        result = "ok"
    except Exception:
        result = traceback.format_exc(limit=-4)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gpus_equal_one_in_bf16(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    from procs import spawn_bounded
    from test_expert_parallel import free_port
    spawn_bounded(_rank, (world, free_port(), str(tmp_path)), world, timeout=300)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}
    assert all(v == "ok" for v in results.values()), results
