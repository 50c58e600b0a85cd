"""Expert parallelism in the trainer over 2 GPUs (NCCL, launched by torchrun) against one GPU
at the same global batch, with the fused router and expert kernels (run on a 2-GPU machine:
pytest -m gpu). fp32 with autocast off differs from one GPU only by the summation order and
TF32 rounding (train() turns TF32 on for CUDA runs) of other batch splits; under bf16
autocast the two runs follow the same curve within bf16's rounding."""
import json

import pytest
import torch

from runs import events
from test_expert_parallel_training import EP2, ONE, one_process, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
KERNELS = ["model.router_impl=triton", "model.experts_impl=triton"]


def _losses(run):
    return [e["loss"] for e in events(run, "train")]


@pytest.mark.parametrize("autocast, rel", [(False, 1e-3), (True, 2e-2)])
def test_expert_parallel_on_two_gpus_equals_one_gpu(text_data, tmp_path, autocast, rel):
    sets = KERNELS + [f"train.autocast={str(autocast).lower()}"]
    torchrun(text_data, tmp_path / "ep", EP2 + sets, device="cuda")
    one_process(text_data, tmp_path / "one", ONE + sets, device="cuda")
    assert _losses(tmp_path / "ep") == pytest.approx(_losses(tmp_path / "one"), rel=rel)
    summary = json.loads((tmp_path / "ep" / "summary.json").read_text())
    assert summary["world"] == 2
    peaks = summary["peak_memory_gib_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks) and peaks[0] == summary["peak_memory_gib"]
