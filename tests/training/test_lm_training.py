"""Pretraining on real prose: the loss falls, and a run stopped or killed then resumed
follows the uninterrupted run's loss curve bit for bit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from moremoe.model.checkpoint import checkpoints
from moremoe.training.compose import build_run_config
from moremoe.training.lm import train
from moremoe.training.optim import cosine_with_warmup, param_groups
from runs import SMALL, SRC, assert_same_run, events, quiet


def test_tiny_model_learns_prose(text_data, tmp_path):
    cfg = build_run_config(preset="tiny-moe", data=str(text_data), out=str(tmp_path / "run"),
                           device="cpu", overrides=["train.log_every=20"])
    summary = train(cfg, echo=quiet)
    losses = [r["lm_loss"] for r in events(tmp_path / "run", "train")]
    assert summary["step"] == 200 and summary["stopped"] == "max_steps"
    assert losses[0] > 4.0 and losses[-1] < 2.8          # ln 256 = 5.55 at the start
    assert summary["val_ppl"] < 15 and summary["val_loss"] < losses[0] - 1.5
    assert len(summary["hnorm"]) == 2 and all(0.3 < h <= 1 for h in summary["hnorm"])
    cover = [e["expert_coverage"] for e in events(tmp_path / "run", "eval")]
    assert all(len(c) == 2 and 0 < min(c) and max(c) <= 1 for c in cover)
    assert all(a <= b for early, late in zip(cover, cover[1:]) for a, b in zip(early, late))
    assert summary["expert_coverage"] == cover[-1]
    assert summary["tokens"] == 200 * 8 * 128 and summary["mfu"] is None
    assert summary["mean_step_ms"] > 0 and summary["tokens_per_s"] > 0
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["val_ppl"] == summary["val_ppl"]
    # loss.png beside the log, refreshed at each validation, and `moremoe plot` overlays runs
    assert (tmp_path / "run" / "loss.png").stat().st_size > 30_000
    from moremoe.cli import main
    out = tmp_path / "pair.png"
    assert main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.stat().st_size > 30_000


def test_stop_then_resume_matches_uninterrupted(text_data, tmp_path, reference_run,
                                                one_thread):
    out = str(tmp_path / "run")
    first = train(build_run_config(preset="tiny-more", data=str(text_data), out=out,
                                   device="cpu", overrides=SMALL, stop_step=23), echo=quiet)
    assert first["stopped"] == "stop_step" and first["step"] == 23
    assert checkpoints(out)[-1].name == "step_00000023"      # checkpointed at the stop
    with pytest.raises(FileExistsError, match="--resume"):
        train(build_run_config(preset="tiny-more", data=str(text_data), out=out,
                               device="cpu", overrides=SMALL), echo=quiet)
    second = train(build_run_config(preset="tiny-more", data=str(text_data), out=out,
                                    device="cpu", overrides=SMALL), resume=True, echo=quiet)
    assert second["step"] == 60 and second["steps_this_run"] == 37
    assert len(checkpoints(out)) == 3                        # keep = 3
    assert_same_run(out, reference_run)


def test_resume_with_a_longer_schedule_warns(text_data, tmp_path):
    out, said = str(tmp_path / "run"), []
    short = [o for o in SMALL if not o.startswith("train.max_steps")] + ["train.max_steps=8"]
    train(build_run_config(preset="tiny-moe", data=str(text_data), out=out, device="cpu",
                           overrides=short), echo=quiet)
    longer = short[:-1] + ["train.max_steps=12"]
    done = train(build_run_config(preset="tiny-moe", data=str(text_data), out=out,
                                  device="cpu", overrides=longer), resume=True, echo=said.append)
    assert done["step"] == 12
    warned = [t for t in said if t.startswith("warning: the schedule now has 12 steps")]
    assert len(warned) == 1 and "planned 8" in warned[0]
    [resume] = events(out, "resume")
    assert (resume["planned_steps_before"], resume["planned_steps"]) == (8, 12)


def test_sigkill_then_resume_matches_uninterrupted(text_data, tmp_path, reference_run,
                                                   one_thread):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "moremoe.cli", "train", "--preset", "tiny-more", "--data",
            str(text_data), "--out", str(out), "--device", "cpu"]
    for s in SMALL:
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not checkpoints(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    killed_at = int(checkpoints(out)[-1].name.split("_")[1])
    assert 5 <= killed_at < 60 and not (out / "summary.json").exists()
    summary = train(build_run_config(preset="tiny-more", data=str(text_data), out=str(out),
                                     device="cpu", overrides=SMALL), resume=True, echo=quiet)
    assert summary["step"] == 60 and summary["steps_this_run"] == 60 - killed_at
    assert [e["step"] for e in events(out, "resume")] == [killed_at]
    assert_same_run(out, reference_run)


def test_max_minutes_stops_cleanly(text_data, tmp_path):
    cfg = build_run_config(preset="tiny-moe", data=str(text_data), out=str(tmp_path / "r"),
                           device="cpu", overrides=SMALL, max_minutes=1e-4)
    summary = train(cfg, echo=quiet)
    assert summary["stopped"] == "max_minutes" and 1 <= summary["step"] < 60
    assert checkpoints(tmp_path / "r")[-1].name == f"step_{summary['step']:08d}"
    assert summary["val_loss"] is not None


def test_schedule_and_param_groups():
    f = cosine_with_warmup(100, 0.05, 0.1)
    assert [f(i) for i in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert f(5) == 1.0 and abs(f(99) - 0.1) < 1e-3 and f(52) == pytest.approx(0.55, abs=0.02)
    cfg = build_run_config(preset="tiny-more", overrides=["optim.router_lr=0.01"])
    model = __import__("moremoe.model", fromlist=["Transformer"]).Transformer(
        cfg.model.transformer_config(vocab=256))
    o = cfg.optim
    groups = {g["name"]: g for g in param_groups(model, lr=o.lr, weight_decay=o.weight_decay,
                                                 router_lr=o.router_lr)}
    assert groups["router"]["lr"] == 0.01 and groups["decay"]["lr"] == cfg.optim.lr
    assert len(groups["router"]["params"]) == 2 * 2                   # R1, R2 per layer
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in groups["no_decay"]["params"])
    n = sum(len(g["params"]) for g in groups.values())
    assert n == len(list(model.parameters()))



def profiled_run(text_data, out, *, steps, warmup):
    """A tiny run that profiles 2 steps after `warmup`, evaluating one step before the end
    and at it."""
    return train(build_run_config(preset="tiny-moe", data=str(text_data), out=str(out),
                                  device="cpu", overrides=[
                                      "model.seq_len=32", f"train.max_steps={steps}",
                                      "train.batch_size=2", f"train.eval_every={steps - 1}",
                                      f"train.timing_warmup={warmup}", "train.profile_steps=2"]),
                 echo=quiet)


def test_profile_steps_write_a_table(text_data, tmp_path):
    summary = profiled_run(text_data, tmp_path / "r", steps=5, warmup=1)
    assert summary["env_torch"] == torch.__version__ and summary["env_commit"]
    table = (tmp_path / "r" / "profile.txt").read_text()
    assert table.startswith("2 steps after 1") and "aten::" in table
    assert "sorted by self_cpu_time_total" in table
    # the profiled steps 2-3 are left out of the step times with the warm-up step
    assert summary["timing_warmup_steps"] == 3 and summary["steps_this_run"] == 5
    assert summary["mean_step_ms"] > 0


def test_profiling_from_the_first_step(text_data, tmp_path):
    summary = profiled_run(text_data, tmp_path / "r", steps=3, warmup=0)
    assert (tmp_path / "r" / "profile.txt").read_text().startswith("2 steps after 0")
    assert summary["timing_warmup_steps"] == 2


def test_the_fused_head_and_loss_train_like_the_logits(text_data, tmp_path):
    """train.fused_loss=true (the head and the loss in chunks, no logits stored) follows the
    unfused run's losses over its steps (fp32 on the CPU: the sums' order only)."""
    runs = {}
    for fused in (False, True):
        out = str(tmp_path / f"fused_{fused}")
        sets = [o for o in SMALL if not o.startswith("train.max_steps")] + [
            "train.max_steps=6", f"train.fused_loss={str(fused).lower()}"]
        train(build_run_config(preset="tiny-more", data=str(text_data), out=out,
                               device="cpu", overrides=sets), echo=quiet)
        runs[fused] = [r["loss"] for r in events(out, "train")]
    assert len(runs[True]) == len(runs[False]) == 6
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
