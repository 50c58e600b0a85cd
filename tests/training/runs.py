"""Helpers of the pretraining tests: a small run's settings and readers of its log."""
import json
import os
import sys
from pathlib import Path

import torch

from moremoe.model.checkpoint import load_model
from procs import run_bounded

SRC = str(Path(__file__).resolve().parents[2] / "src")
SMALL = ["model.seq_len=64", "train.batch_size=4", "train.log_every=1", "train.eval_every=20",
         "train.eval_batches=2", "train.ckpt_every=5", "train.keep=3", "train.max_steps=60"]


def quiet(_text):
    pass


def events(run_dir, kind):
    rows = [json.loads(ln) for ln in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


def curve(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in events(run_dir, "train")]


def assert_same_run(run, ref):
    """A resumed run is the uninterrupted one: the same operations in the same order on one
    machine, so its loss curve and weights are compared bit for bit."""
    assert curve(run) == curve(ref)                   # exact: every step's loss and norm
    evals = {e["step"]: (e["val_loss"], e["hnorm"], e["expert_coverage"])
             for e in events(run, "eval")}
    ref_evals = {e["step"]: (e["val_loss"], e["hnorm"], e["expert_coverage"])
                 for e in events(ref, "eval")}
    assert {s: evals.get(s) for s in ref_evals} == ref_evals   # a stop adds its own
    a, b = load_model(run).state_dict(), load_model(ref).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def torchrun_command(data, out, sets, *, preset, nproc=2, device="cpu", flags=()):
    """(argv, env) of `moremoe train --json` on nproc CPU processes (torchrun, gloo), one
    thread each."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "moremoe.cli", "train", "--preset", preset,
            "--data", str(data), "--out", str(out), "--device", device, "--json", *flags]
    for s in sets:
        argv += ["--set", s]
    return argv, {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def torchrun_train(data, out, sets, *, preset, nproc=2, device="cpu", flags=(), codes=(0,)):
    """torchrun_command run to its end; asserts the exit status is in codes and returns the
    finished process."""
    argv, env = torchrun_command(data, out, sets, preset=preset, nproc=nproc, device=device,
                                 flags=flags)
    done = run_bounded(argv, env=env, timeout=240)   # every rank killed when it ends
    assert done.returncode in codes, done.stderr[-3000:]
    return done
