"""Expert parallelism in the trainer (parallel.expert, parallel/expert_plan.py) over gloo CPU
processes launched by torchrun, against one process at the same global batch: E = 2 on 2
ranks (DDP for the rest), E = 2 x data 2 on 4 ranks (FSDP2 for the rest, activation
checkpointing) and E = 4 on 4 ranks, with gradient accumulation, clipping on the global norm
and bf16 AdamW moments; whole-model checkpoints that resume on 1, 2 and 4 ranks (E = 1, 2,
4) and export to transformers; the layout errors. (The layers' own tests, uneven and empty
ranks and bf16 included, are tests/parallel/test_expert_parallel.py.)"""
import json
import shutil

import pytest
import torch

from cli_checks import fails
from moremoe.cli import main
from moremoe.model.checkpoint import load_model
from moremoe.training.checkpoint import load_state
from moremoe.training.compose import build_run_config
from moremoe.training.lm import train
from numerics import model_reduction_length, reduction_tol
from runs import assert_same_run, curve, events, quiet, torchrun_train

# 6 steps of a global batch of 16 rows: 4 accumulation micro-steps on 2 ranks, an expert
# group's micro-batch (whose balancing loss it is) one process's of 4 rows; clipping at 0.5
# acts on every step (the gradient norms are 1.3 to 2.6); bf16 moments
COMMON = ["model.seq_len=32", "train.log_every=1", "train.eval_every=3", "train.max_steps=6",
          "train.ckpt_every=100", "optim.clip=0.5", "optim.moments=bf16"]
EP2 = ["train.batch_size=2", "train.grad_accum=4", "train.eval_batches=2",
       "parallel.expert=2"]
ONE = ["train.batch_size=4", "train.grad_accum=4", "train.eval_batches=2"]   # same val rows


def torchrun(data, out, sets, nproc=2, flags=(), codes=(0,), preset="tiny-more",
             device="cpu"):
    return torchrun_train(data, out, COMMON + sets, preset=preset, nproc=nproc,
                          device=device, flags=flags, codes=codes)


def one_process(data, out, sets, resume=False, device="cpu"):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(build_run_config(preset="tiny-more", data=str(data), out=str(out),
                                      device=device, overrides=COMMON + sets), resume=resume,
                     echo=quiet)
    finally:
        torch.set_num_threads(old)


def assert_close_runs(run, ref, *, from_step=0):
    """The train losses and gradient norms of run equal ref's (from from_step on) up to the
    summation order of the reductions, and so do the final weights."""
    got = {e["step"]: e for e in events(run, "train") if e["step"] > from_step}
    want = {e["step"]: e for e in events(ref, "train") if e["step"] > from_step}
    assert got.keys() == want.keys() and got
    for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
        assert [got[s][key] for s in got] == pytest.approx([want[s][key] for s in got],
                                                           rel=1e-5), key
    a, b = load_model(run), load_model(ref)
    tol = reduction_tol(torch.float32, model_reduction_length(a.config))
    for name, t in b.state_dict().items():
        torch.testing.assert_close(a.state_dict()[name], t, **tol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def one_ref(text_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "one"
    one_process(text_data, out, ONE)
    return out


@pytest.fixture(scope="module")
def ep_ref(text_data, tmp_path_factory):
    """The uninterrupted run, E = 2 on 2 ranks."""
    out = tmp_path_factory.mktemp("ep") / "ep2"
    torchrun(text_data, out, EP2)
    return out


@pytest.fixture(scope="module")
def ep_stopped(text_data, tmp_path_factory):
    """The same run stopped at step 3 (a budget stop: every rank exits 0 under torchrun)."""
    out = tmp_path_factory.mktemp("ep") / "stopped"
    torchrun(text_data, out, EP2 + ["train.stop_step=3"])
    assert json.loads((out / "summary.json").read_text())["stopped"] == "stop_step"
    return out


def test_expert_parallel_on_two_ranks_equals_one_process(one_ref, ep_ref):
    """Each rank holds 32 of tiny-more's 64 experts and its own 2-row micro-batches; the
    balancing loss is its expert group's, one process's micro-batch of 4 rows."""
    summary = json.loads((ep_ref / "summary.json").read_text())
    assert summary["world"] == 2 and summary["global_batch"] == 16
    assert events(ep_ref, "train")[0]["aux_loss"] > 0
    assert_close_runs(ep_ref, one_ref)
    ev, ev1 = events(ep_ref, "eval"), events(one_ref, "eval")
    assert [e["val_loss"] for e in ev] == pytest.approx([e["val_loss"] for e in ev1], rel=1e-5)
    assert [e["hnorm"] for e in ev] == [pytest.approx(e["hnorm"], rel=1e-5) for e in ev1]
    start = events(ep_ref, "start")[0]["memory"]
    assert [(p["name"], p["share"]) for p in start["parts"]] == [("experts", 2),
                                                                 ("the rest", 1)]


def test_expert_parallel_checkpoint_is_whole_and_resumes_on_two_and_one_ranks(
        text_data, tmp_path, ep_ref, ep_stopped):
    """The step-3 checkpoint holds the single-process model and the optimizer state by name
    with every expert; resumed with E = 2 on 2 ranks it is the uninterrupted run bit for bit,
    resumed on one process (E = 1) the same run up to the summation order."""
    ckpt = ep_stopped / "checkpoints" / "step_00000003"
    model = load_model(ckpt)
    w = model.state_dict()["blocks.0.moe.experts.w_gate"]
    assert w.shape == (64, 28, 64)
    state = load_state(ckpt)["optimizer"]["state"]["blocks.1.moe.experts.w_down"]
    assert state["exp_avg"].shape == (64, 64, 28) and state["exp_avg"].dtype == torch.bfloat16
    assert float(state["exp_avg"][:32].abs().sum()) > 0 < float(state["exp_avg"][32:].abs().sum())
    on_one, on_two = tmp_path / "on_one", tmp_path / "on_two"
    shutil.copytree(ep_stopped, on_one)
    shutil.copytree(ep_stopped, on_two)
    torchrun(text_data, on_two, EP2, flags=["--resume"])
    assert_same_run(on_two, ep_ref)
    one_process(text_data, on_one, ONE, resume=True)
    assert_close_runs(on_one, ep_ref, from_step=3)


def test_expert_parallel_with_fsdp_on_four_ranks_resumes_and_equals_one_process(
        text_data, tmp_path, one_ref, ep_stopped):
    """E = 2 x data 2 on 4 ranks, FSDP2 for the rest, activation checkpointing (a full
    recompute: the all-to-alls again in the backward), 2 accumulation micro-steps, resumed
    from the checkpoint of 2 ranks: the last 3 steps and the weights are one process's."""
    run = tmp_path / "four"
    shutil.copytree(ep_stopped, run)
    torchrun(text_data, run, ["train.batch_size=2", "train.grad_accum=2",
                              "train.eval_batches=2", "parallel.expert=2",
                              "parallel.data=fsdp", "train.activation_checkpointing=true"],
             nproc=4, flags=["--resume"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"] == 4 and summary["step"] == 6
    assert_close_runs(run, one_ref, from_step=3)


def test_four_expert_ranks_resume_from_two_and_equal_one_process(text_data, tmp_path,
                                                                  ep_stopped):
    """E = 4 on 4 ranks (16 of the 64 experts each, DDP for the rest), resumed from the
    checkpoint of E = 2: the checkpoint is cut into four shards, and the last 3 steps (each
    rank's 2-row micro-batch sent to up to 3 other ranks; the balancing loss of the group's
    8 rows) and the weights are one process's resumed at 8 rows x 2 micro-steps."""
    run, ref = tmp_path / "e4", tmp_path / "one"
    shutil.copytree(ep_stopped, run)
    shutil.copytree(ep_stopped, ref)
    torchrun(text_data, run, ["train.batch_size=2", "train.grad_accum=2",
                              "train.eval_batches=2", "parallel.expert=4"],
             nproc=4, flags=["--resume"])
    one_process(text_data, ref, ["train.batch_size=8", "train.grad_accum=2",
                                 "train.eval_batches=2"], resume=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"] == 4 and summary["step"] == 6
    resumed = events(run, "resume")[-1]
    assert resumed["world"] == 4 and resumed["memory"]["parts"][0]["share"] == 4
    assert_close_runs(run, ref, from_step=3)


def test_expert_parallel_checkpoint_exports_to_transformers(tmp_path, capsys, ep_stopped):
    transformers = pytest.importorskip("transformers")
    from moremoe.hf import register
    ckpt = ep_stopped / "checkpoints" / "step_00000003"
    assert main(["hf", "export", str(ckpt), str(tmp_path / "hf")]) == 0
    register()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want, got = load_model(ckpt).state_dict(), loaded.to_transformer().state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("sets, match", [
    (["parallel.expert=3"], r"parallel.expert=3 must divide model.experts=8 \(each rank holds "
                            r"M/E experts\); choose a divisor of 8$"),
    (["parallel.expert=2"], r"parallel.expert=2 splits the experts over 2 ranks but this is "
                            r"one process; launch several processes with torchrun "
                            r"--nproc_per_node N, .* \(N a multiple of 2\), or set "
                            r"parallel.expert=1$"),
    (["parallel.expert=0"], r"parallel.expert must be >= 1 \(1: no expert parallelism\), "
                            r"got 0$"),
    (["parallel.expert=2", "model.kind=peer", "model.experts=256", "model.peer_kappa=4"],
     r"parallel.expert=2: PEER layers \(model.kind=peer\) are not split over ranks"),
    (["optim.moments=fp16"], r"optim.moments must be one of fp32, bf16, got 'fp16'$"),
])
def test_layouts_that_cannot_split_are_one_line_errors(capsys, tmp_path, text_data, sets,
                                                       match):
    argv = ["train", "--preset", "tiny-moe", "--data", str(text_data), "--out",
            str(tmp_path / "run"), "--device", "cpu"]
    for s in sets:
        argv += ["--set", s]
    fails(capsys, argv, match)
    assert not (tmp_path / "run").exists()


def test_expert_size_that_does_not_divide_the_ranks_is_one_line_from_rank_0(text_data,
                                                                            tmp_path):
    done = torchrun(text_data, tmp_path / "run", ["parallel.expert=4"], preset="tiny-moe",
                    codes=(1,))
    lines = [ln for ln in done.stderr.splitlines() if "moremoe train: error:" in ln]
    assert lines == ["moremoe train: error: parallel.expert=4 must divide the number of "
                     "ranks, 2 (torchrun --nproc_per_node); launch a multiple of 4 or choose "
                     "a divisor of 2"]
    assert not (tmp_path / "run").exists()
