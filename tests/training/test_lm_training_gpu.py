"""The CUDA path of the trainer (bf16 autocast, fused AdamW, pinned batches, MFU): a short
run learns, stops on a step budget and resumes. Run on the device machine: pytest -m gpu."""
import pytest
import torch

from moremoe.training.compose import build_run_config
from moremoe.training.lm import train

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset, experts_impl", [("tiny-more", "auto"),
                                                  ("tiny-moe", "triton")])   # s % 16 == 0
def test_tiny_run_on_gpu_stops_and_resumes(text_data, tmp_path, preset, experts_impl):
    sets = ["model.seq_len=64", "train.log_every=10", "train.eval_every=40",
            "train.max_steps=80", f"model.experts_impl={experts_impl}"]
    kw = dict(preset=preset, data=str(text_data), out=str(tmp_path / "run"),
              device="cuda", peak_tflops=989.0)
    before = torch.get_float32_matmul_precision()
    first = train(build_run_config(overrides=sets, stop_step=40, **kw), echo=print)
    # TF32 is on for the run only: fp32 checks later in the process keep full precision
    assert torch.get_float32_matmul_precision() == before
    assert first["stopped"] == "stop_step" and first["mfu"] is not None
    assert first["peak_memory_gib"] > 0
    done = train(build_run_config(overrides=sets, **kw), resume=True, echo=print)
    assert done["step"] == 80 and done["steps_this_run"] == 40          # resumed at 40
    assert done["val_loss"] < first["val_loss"] < 5.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scope, mode", [("blocks", "default"), ("model", "default"),
                                         ("blocks", "reduce-overhead"),
                                         ("model", "reduce-overhead")])
def test_compiled_training_follows_eager(text_data, tmp_path, scope, mode):
    """train.compile (each block, or the whole model, through torch.compile with the custom
    ops inside, over 2 accumulation micro-steps; with CUDA graphs too) follows the eager loss
    curve to bf16 rounding; the lm head's padded GEMM runs in both."""
    runs = {}
    for comp in (False, True):
        sets = ["model.seq_len=64", "train.log_every=5", "train.eval_every=20",
                "train.max_steps=20", "train.grad_accum=2", f"train.compile={str(comp).lower()}",
                f"train.compile_mode={mode}", f"train.compile_scope={scope}"]
        runs[comp] = train(build_run_config(preset="tiny-more", data=str(text_data),
                                            out=str(tmp_path / f"c{comp}"), device="cuda",
                                            overrides=sets), echo=print)
    assert abs(runs[True]["val_loss"] - runs[False]["val_loss"]) < 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peer_trains_with_its_fused_kernels_compiled_and_with_cuda_graphs(text_data, tmp_path):
    """tiny-peer with the fused retrieval and expert kernels: eager, the whole model compiled
    with CUDA graphs over 2 accumulation micro-steps, and the torch path all learn and end
    at the same validation loss to bf16 rounding (near-tie retrievals aside)."""
    runs = {}
    for name, sets in {"fused": ["train.compile=false"],
                       "graphs": ["train.compile=true", "train.compile_mode=reduce-overhead",
                                  "train.compile_scope=model"],
                       "torch": ["train.compile=false", "model.experts_impl=reference"]}.items():
        base = ["model.seq_len=64", "train.log_every=5", "train.eval_every=30",
                "train.max_steps=30", "train.grad_accum=2"]
        runs[name] = train(build_run_config(preset="tiny-peer", data=str(text_data),
                                            out=str(tmp_path / name), device="cuda",
                                            overrides=base + sets), echo=print)
    assert runs["fused"]["val_loss"] < 5.0
    assert abs(runs["graphs"]["val_loss"] - runs["fused"]["val_loss"]) < 0.05
    assert abs(runs["torch"]["val_loss"] - runs["fused"]["val_loss"]) < 0.05
