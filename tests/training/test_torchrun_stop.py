"""A torchrun run ends cleanly: after a budget stop or a signal every rank has written its
checkpoint, log and summary before any rank leaves, and the ranks exit 0, so torchrun
neither reports a failure nor kills a rank in its last writes (2 gloo ranks)."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from moremoe.model import checkpoint as stored
from moremoe.training.signals import REPEAT_S, StopSignals, exit_status
from procs import finish, launched, run_bounded
from runs import SRC, events, torchrun_command, torchrun_train

TINY = ["model.seq_len=64", "train.batch_size=2", "train.log_every=1", "train.eval_batches=1",
        "train.eval_every=1000", "train.max_steps=1000", "train.ckpt_every=1000"]


def test_exit_status_is_zero_for_every_checkpointed_stop_under_torchrun():
    assert [exit_status(r, 1) for r in ("max_steps", "stop_step", "max_minutes", "SIGTERM")] \
        == [0, 75, 75, 143]
    assert [exit_status(r, 2) for r in ("max_steps", "stop_step", "max_minutes", "SIGINT")] \
        == [0, 0, 0, 0]
    assert exit_status("error: ValueError: x", 2) == exit_status("error: OSError: y", 1) == 2


def test_a_repeated_signal_within_the_window_is_one_request_a_later_one_interrupts():
    """torchrun forwards a signal that a scheduler also sent every rank: the rank gets it
    twice within milliseconds, which must not interrupt its checkpoint."""
    now = [100.0]
    stop = StopSignals(clock=lambda: now[0])
    stop._handle(signal.SIGTERM, None)
    now[0] += REPEAT_S / 2
    stop._handle(signal.SIGTERM, None)
    assert stop.requested == signal.SIGTERM
    now[0] += REPEAT_S
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)


def _assert_complete(out, summary, step, stopped):
    assert summary["stopped"] in stopped and summary["step"] == step, summary
    assert summary["exit_code"] == 0 and summary["world"] == 2
    assert json.loads((out / "summary.json").read_text()) == summary
    assert stored.latest_checkpoint(out).name == f"step_{step:08d}"
    assert not stored.incomplete_checkpoints(out)
    assert events(out, "end")[-1]["stopped"] == summary["stopped"]


def test_ten_budget_stops_in_a_row_each_leave_a_checkpoint_and_a_summary(text_data, tmp_path):
    """Ten budget stops on 2 ranks, each resuming the last (tests/training/stop_worker.py:
    one torchrun launch, the ten runs in its ranks), --stop-step one step on or
    --max-minutes spent after none, one or a few steps (12 ms, as fast as the machine
    steps; 9 -> 11 seen in a newest-versions run): each ends with status 0 on both ranks (before:
    75, which torchrun took for a failure, killing rank 0), and when train() returns on
    either rank, that stop's checkpoint and summary are complete on disk."""
    here = Path(__file__).parent
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(here / "stop_worker.py"), str(text_data), str(tmp_path)]
    for s in TINY + ["train.save_on_stop=true"]:
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{here}", "OMP_NUM_THREADS": "1"}
    done = run_bounded(argv, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 10
    step = 0
    for k, seen in enumerate(ranks[0]):
        if k % 2 == 0:       # --stop-step one step on
            assert seen["step"] == step + 1 and seen["stopped"] == "stop_step", (k, seen)
        else:                # 12 ms of budget: none (a loaded machine), one or two fast steps
            assert seen["step"] >= step and seen["stopped"] == "max_minutes", (k, seen)
        step = seen["step"]
        assert seen == {"status": 0, "step": step, "stopped": seen["stopped"],
                        "exit_code": 0, "checkpoint": f"step_{step:08d}", "incomplete": []}
    assert len(events(tmp_path / "run", "end")) == 10


def _rank_pid(launcher: int, rank: int) -> int:
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"no rank {rank} under torchrun {launcher}")


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_to_torchrun_or_to_one_rank_checkpoints_on_every_rank(text_data, tmp_path,
                                                                     target):
    """SIGTERM to torchrun (it forwards one to each rank, then waits 30 s before SIGKILL) or
    to rank 1 alone (the ranks agree on it at the next logging step): every rank stops
    after the same step, rank 0 writes the checkpoint and the summary, every rank exits 0.
    torchrun itself exits 0 when only a rank was signalled, 1 (its own SignalException)
    when it was."""
    out = tmp_path / "run"
    argv, env = torchrun_command(text_data, out, TINY + ["train.ckpt_every=2"],
                                 preset="tiny-moe")
    with launched(argv, env=env) as proc:
        deadline = time.time() + 240     # a loaded 2-core machine starts torchrun slowly
        while not stored.checkpoints(out) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        # the signal must come once the ranks train (their handlers installed), not before
        if not stored.checkpoints(out) or proc.poll() is not None:
            pytest.fail(f"the run left no checkpoint to stop after: "
                        f"{finish(proc, argv, 10)[1][-3000:]}")
        os.kill(proc.pid if target == "launcher" else _rank_pid(proc.pid, 1), signal.SIGTERM)
        stdout, stderr = finish(proc, argv, 90)
    assert proc.returncode == (1 if target == "launcher" else 0), stderr[-3000:]
    assert "forcefully exiting" not in stderr                 # no rank was SIGKILLed
    summary = json.loads(stdout)
    _assert_complete(out, summary, summary["step"], ("SIGTERM",))


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_budget_stops_on_two_nccl_ranks_end_cleanly(text_data, tmp_path):
    """The same on 2 GPUs (NCCL, the fused kernels): three --stop-step stops in a row."""
    out = tmp_path / "run"
    for k in (1, 2, 3):
        done = torchrun_train(text_data, out, TINY, preset="tiny-moe", device="cuda",
                              flags=["--stop-step", str(k), "--resume"])
        _assert_complete(out, json.loads(done.stdout), k, ("stop_step",))
