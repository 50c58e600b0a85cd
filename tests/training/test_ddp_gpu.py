"""DDP over 2 GPUs (NCCL, launched by torchrun) against one GPU at the same global batch, with
the fused router and expert kernels (run on a 2-GPU device machine: pytest -m gpu). Eager in
fp32 with autocast off (the differences are the order of the gradient all-reduce and TF32
rounding, train() turning TF32 on for CUDA runs, in different batch splits), and compiled
with CUDA graphs, bf16 autocast and the bf16 all-reduce."""
import pytest
import torch

from test_ddp import COMMON, logged, run_torchrun  # (tests/training on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_ddp_two_nccl_ranks_equal_one_gpu(text_data, tmp_path):
    from moremoe.training.compose import build_run_config
    from moremoe.training.lm import train
    sets = ["model.balance_coef=0", "train.autocast=false", "model.router_impl=triton",
            "model.experts_impl=triton"]
    dist = run_torchrun(text_data, tmp_path / "ddp", ["train.batch_size=4"] + sets,
                        device="cuda")
    single = train(build_run_config(preset="tiny-moe", data=str(text_data),
                                    out=str(tmp_path / "one"), device="cuda",
                                    overrides=COMMON + ["train.batch_size=8"] + sets),
                   echo=lambda t: None)
    assert dist["world"] == 2 and dist["global_batch"] == single["global_batch"] == 8
    for key in ("loss", "lm_loss"):
        assert logged(tmp_path / "ddp", key) == pytest.approx(logged(tmp_path / "one", key),
                                                              rel=1e-4), key


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_ddp_with_cuda_graphs_and_bf16_reduction_follows_one_gpu_and_resumes(
        text_data, tmp_path, scope):
    """compile_mode=reduce-overhead takes CUDA graphs under DDP (auto does not yet): each compiled graph split where DDP's
    buckets end (buckets of 1 MB, torch.compile's smallest, in blocks of h = 256: about two
    pieces a block), every piece a CUDA graph, the bf16
    all-reduce between the replays, 2 accumulation micro-steps. The losses follow one GPU at
    the global batch (compiled the same way) to bf16's rounding, and (scope model) a run stopped
    at step 3 and resumed goes on to the uninterrupted run's losses."""
    from moremoe.training.compose import build_run_config
    from moremoe.training.lm import train
    model = ["train.compile=true", "train.compile_mode=reduce-overhead",
             f"train.compile_scope={scope}",
             "model.router_impl=triton", "model.experts_impl=triton", "model.hidden=256"]
    ddp = model + ["train.batch_size=4", "train.grad_accum=2", "parallel.reduce_dtype=bf16",
                   "parallel.bucket_mb=1"]
    full = run_torchrun(text_data, tmp_path / "ddp", ddp, device="cuda")
    assert full["compile"] == f"{scope}, reduce-overhead"
    single = train(build_run_config(preset="tiny-moe", data=str(text_data),
                                    out=str(tmp_path / "one"), device="cuda",
                                    overrides=COMMON + model + ["train.batch_size=4",
                                                                "train.grad_accum=4"]),
                   echo=lambda t: None)
    assert single["compile"] == f"{scope}, reduce-overhead"
    assert logged(tmp_path / "ddp", "loss") == pytest.approx(logged(tmp_path / "one", "loss"),
                                                             rel=2e-2)
    if scope == "blocks":       # the resume is the same code at either scope: one is enough
        return                  # (two more launches, a minute of the one-call GPU suite)
    run_torchrun(text_data, tmp_path / "resumed", ddp + ["train.stop_step=3"], device="cuda",
                 codes=(0, 1))
    run_torchrun(text_data, tmp_path / "resumed", ddp, device="cuda", flags=["--resume"])
    assert logged(tmp_path / "resumed", "loss") == pytest.approx(
        logged(tmp_path / "ddp", "loss"), rel=1e-3)
