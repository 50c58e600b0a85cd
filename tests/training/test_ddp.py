"""DDP and FSDP2 over 2 CPU processes (gloo, launched by torchrun) against one process at the
same global batch; whole-model checkpoints resumed on another number of ranks."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from moremoe.model.checkpoint import load_model
from moremoe.training.compose import build_run_config
from moremoe.training.lm import train
from runs import assert_same_run, torchrun_train

COMMON = ["model.seq_len=64", "train.log_every=1", "train.eval_every=6", "train.eval_batches=2",
          "train.max_steps=6", "train.ckpt_every=100"]


def run_torchrun(data, out, sets, nproc=2, device="cpu", flags=(), codes=(0,)):
    done = torchrun_train(data, out, COMMON + sets, preset="tiny-moe", nproc=nproc,
                          device=device, flags=flags, codes=codes)
    return json.loads(done.stdout) if done.returncode == 0 else None


def run_single(data, out, sets, resume=False):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(build_run_config(preset="tiny-moe", data=str(data), out=str(out),
                                      device="cpu", overrides=COMMON + sets), resume=resume,
                     echo=lambda t: None)
    finally:
        torch.set_num_threads(old)


def logged(out, key):
    rows = [json.loads(ln) for ln in (Path(out) / "log.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["event"] == "train"]


def assert_close_runs(a_dir, b_dir):
    for key in ("loss", "lm_loss", "aux_loss"):
        assert logged(a_dir, key) == pytest.approx(logged(b_dir, key), rel=1e-5), key
    assert logged(a_dir, "grad_norm") == pytest.approx(logged(b_dir, "grad_norm"), rel=1e-4)


def test_ddp_two_gloo_ranks_equal_one_process_at_the_global_batch(text_data, tmp_path):
    """2 ranks × batch 4 against one process × batch 8, the brief's equivalence. The
    balancing loss is a per-micro-batch statistic (it is not a mean over rows), so this
    comparison switches it off; the next test covers it."""
    off = ["model.balance_coef=0"]
    dist = run_torchrun(text_data, tmp_path / "ddp", ["train.batch_size=4"] + off)
    single = run_single(text_data, tmp_path / "one", ["train.batch_size=8"] + off)
    assert dist["world"] == 2 and dist["global_batch"] == single["global_batch"] == 8
    assert dist["tokens"] == single["tokens"] == 6 * 8 * 64
    assert_close_runs(tmp_path / "ddp", tmp_path / "one")
    assert logged(tmp_path / "ddp", "loss")[-1] < logged(tmp_path / "ddp", "loss")[0]
    assert dist["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert dist["hnorm"] == pytest.approx(single["hnorm"], rel=1e-5)


def test_ddp_with_accumulation_equals_one_process_micro_steps(text_data, tmp_path):
    """With the balancing loss on and 2 accumulation steps (DDP's no_sync path): 2 ranks × 2
    micro-steps × 2 rows see the rows one process sees in 4 micro-steps of 2."""
    dist = run_torchrun(text_data, tmp_path / "ddp", ["train.batch_size=2",
                                                     "train.grad_accum=2"])
    single = run_single(text_data, tmp_path / "one", ["train.batch_size=2",
                                                     "train.grad_accum=4"])
    assert dist["global_batch"] == single["global_batch"] == 8
    assert logged(tmp_path / "ddp", "aux_loss")[0] > 0
    assert_close_runs(tmp_path / "ddp", tmp_path / "one")


@pytest.mark.parametrize("accum", [2, 1])
def test_ddp_with_in_place_expert_gradients_equals_one_process(text_data, tmp_path, accum):
    """The fused expert banks (the Triton interpreter here) accumulate their weight
    gradients in place under DDP too: left out of DDP's buckets, all-reduced by the trainer
    in the last micro-step's backward; 2 ranks x `accum` micro-steps against one process's
    2 x accum (1: the paper presets' one micro-step a step), the balancing loss on (the
    validation sets differ: each rank evaluates its own batches)."""
    fused = ["model.experts_impl=triton", "train.batch_size=2", "model.seq_len=32",
             "train.max_steps=3", "train.eval_every=3"]     # the interpreter is slow
    dist = run_torchrun(text_data, tmp_path / "ddp", fused + [f"train.grad_accum={accum}"])
    single = run_single(text_data, tmp_path / "one", fused + [f"train.grad_accum={2 * accum}"])
    assert dist["global_batch"] == single["global_batch"] == 4 * accum
    assert_close_runs(tmp_path / "ddp", tmp_path / "one")


def test_fsdp_equals_one_process_and_its_checkpoints_resume_on_one_and_two_ranks(
        text_data, tmp_path):
    """FSDP2 over 2 gloo ranks (parameters, gradients and AdamW states sharded; 2
    accumulation micro-steps, balancing loss on) follows one process at the global batch. It
    stops at step 3 with a whole-model checkpoint (loadable as any other), which resumes on 2
    ranks under FSDP2 and on one process to the losses of the uninterrupted run."""
    fs = ["train.batch_size=2", "train.grad_accum=2", "parallel.data=fsdp"]
    one = ["train.batch_size=2", "train.grad_accum=4", "train.eval_batches=4"]  # same val rows
    full = run_torchrun(text_data, tmp_path / "fsdp", fs)
    single = run_single(text_data, tmp_path / "one", one)
    assert full["global_batch"] == single["global_batch"] == 8
    assert_close_runs(tmp_path / "fsdp", tmp_path / "one")
    assert full["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)

    # a budget stop under torchrun: every rank exits 0, the summary says why
    run_torchrun(text_data, tmp_path / "stopped", fs + ["train.stop_step=3"])
    assert json.loads((tmp_path / "stopped" / "summary.json").read_text())["stopped"] == \
        "stop_step"
    ckpt = tmp_path / "stopped" / "checkpoints" / "step_00000003"
    assert set(load_model(ckpt).state_dict()) == set(
        load_model(tmp_path / "one").state_dict())                 # the whole model
    shutil.copytree(tmp_path / "stopped", tmp_path / "on_one")
    run_torchrun(text_data, tmp_path / "stopped", fs, flags=["--resume"])
    run_single(text_data, tmp_path / "on_one", one, resume=True)
    for resumed in ("stopped", "on_one"):
        assert logged(tmp_path / resumed, "loss") == pytest.approx(
            logged(tmp_path / "fsdp", "loss"), rel=1e-5), resumed


def test_ddp_bf16_reduction_follows_one_process_and_resumes_exactly(text_data, tmp_path):
    """parallel.reduce_dtype=bf16 (DDP's bf16 comm hook) over 2 gloo ranks, 2 accumulation
    micro-steps, balancing loss on: every step's loss and gradient norm follow one process at
    the global batch within bf16's rounding of the averaged gradients (2^-8 relative) and
    not bit for bit (the hook runs). Small buckets (many all-reduces) in the uninterrupted
    run, the default in the stopped and resumed one: bucketing does not change the sums, and
    the resumed run is the uninterrupted one exactly (every loss, norm, evaluation, weight)."""
    bf16 = ["train.batch_size=2", "train.grad_accum=2", "parallel.reduce_dtype=bf16"]
    run_torchrun(text_data, tmp_path / "bf16", bf16 + ["parallel.bucket_mb=0.01"])
    run_single(text_data, tmp_path / "one", ["train.batch_size=2", "train.grad_accum=4"])
    norms, ref = logged(tmp_path / "bf16", "grad_norm"), logged(tmp_path / "one", "grad_norm")
    assert norms == pytest.approx(ref, rel=1e-2)
    assert norms != pytest.approx(ref, rel=1e-6)              # rounded: the hook reduced them
    assert logged(tmp_path / "bf16", "loss") == pytest.approx(logged(tmp_path / "one", "loss"),
                                                              rel=1e-3)
    # a budget stop exits 75 (torchrun reports 1; 0 once the ranks end without a failure)
    run_torchrun(text_data, tmp_path / "resumed", bf16 + ["train.stop_step=3"], codes=(0, 1))
    run_torchrun(text_data, tmp_path / "resumed", bf16, flags=["--resume"])
    assert_same_run(tmp_path / "resumed", tmp_path / "bf16")


def test_cuda_graphs_under_fsdp_are_one_line_before_any_work(text_data, tmp_path):
    """FSDP2 gathers each block's weights into new memory every call, which a CUDA graph's
    replay cannot follow: the mode is refused on every rank before the run directory."""
    done = torchrun_train(text_data, tmp_path / "fsdp", COMMON + [
        "parallel.data=fsdp", "train.compile=true", "train.compile_mode=reduce-overhead"],
        preset="tiny-moe", codes=(1,))
    assert ("moremoe train: error: train.compile_mode=reduce-overhead (CUDA graphs) does not "
            "work with parallel.data=fsdp") in done.stderr
    assert "[rank0]: Traceback" not in done.stderr      # (torchrun's own report has one)
    assert not (tmp_path / "fsdp").exists()
