"""DDP over 2 GPUs (NCCL, launched by torchrun) against one GPU at the same global batch, with
the fused router and expert kernels (run on a 2-GPU device machine: pytest -m gpu). fp32 with
autocast off; the differences are the order of the gradient all-reduce and TF32 rounding
(train() turns TF32 on for CUDA runs) in different batch splits."""
import pytest
import torch

from test_ddp import COMMON, logged, run_torchrun  # noqa: F401  (tests/training on sys.path)

pytestmark = [pytest.mark.gpu,
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
