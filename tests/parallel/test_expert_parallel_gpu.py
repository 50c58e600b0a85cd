"""Expert parallelism on two GPUs with NCCL (`pytest -m gpu` on a machine with 2 GPUs): at a
moderate size in bf16, with the fused kernels, (a) with the replicated and the sharded
router and (b) with uneven ranks route exactly as one GPU does and give its outputs and
every gradient (ep_workers' comparisons, run by two spawned processes)."""
import json
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

H, S, R, M, K, N = 256, 64, 32, 64, 4, 2048


def _check(rank, world):
    import ep_workers as w
    from moremoe.nn import MoEConfig, MoELayer
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(N, H, device=dev, generator=g).bfloat16()
    wy = torch.randn(N, H, device=dev, generator=g)
    sizes = [N // 2 - 300, N // 2 + 300]
    for cfg in (MoEConfig.moe(M, K, H, S, init_std=0.3), MoEConfig.more(M, K, H, S, R,
                                                                         init_std=0.3)):
        torch.manual_seed(0)
        with torch.device(dev):
            layer = MoELayer(cfg).to(torch.bfloat16).train()
        w.compare_replicated(layer, x, wy)
        if cfg.is_lowrank:
            w.compare_replicated(layer, x, wy, shard_router=True)
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


def test_two_gpus_equal_one_in_bf16(tmp_path):
    from procs import spawn_bounded
    from test_expert_parallel import free_port
    spawn_bounded(_rank, (2, free_port(), str(tmp_path)), 2, timeout=300)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert all(v == "ok" for v in results.values()), results
