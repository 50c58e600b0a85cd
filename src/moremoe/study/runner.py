"""Training a study's runs: each run is a process of ``moremoe train`` (its own CUDA context
and compilation, so a failure stays its own), several at once on each GPU where the GPU has
room (--parallel), continued from its checkpoint by the next command.

OUT/study.json   the settings and the data's fingerprint; a later command must bring the
                 same data and the same FROZEN settings (study/plan.py), and may add
                 experiments, budgets and seeds
OUT/specs/NAME.yaml, OUT/runs/NAME/, OUT/logs/NAME.log   a run's config, its folder (log,
                 summary, checkpoints) and its process's output, appended on each resume
OUT/rows.jsonl   one row per finished run (study/rows.py)

A run starts once its learning rate is known (fixed, or its configuration's selection runs
all have rows). --max-minutes bounds the command: each process gets the time left, less a
margin for its last evaluation and checkpoint, and no run starts in the last three minutes
(it would have less than the margin again to train); a
stopped run resumes from its checkpoint when the command runs again. SIGINT / SIGTERM stop
every process the same way (each checkpoints first). A finished run's checkpoints are
deleted once its row is written (they exist to resume it; --keep-checkpoints keeps them).
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..report import write_atomic, write_json
from ..runtime import __version__, duration, progress_bar
from ..tasks.text import data_fingerprint, read_meta
from ..training.compose import apply_overrides
from ..training.config import RunConfig
from .plan import StudySettings, changed_frozen, model_spec, plan_runs
from .rows import (append_row, chosen_lr, diverged_at, diverged_row, finished_summary,
                   no_lr, read_rows, run_row)

STUDY = "study.json"
FORMAT, VERSION = "moremoe-study", 1
MARGIN_S = 90           # a process's last evaluation and checkpoint, after its budget
LAST_START_S = 2 * MARGIN_S     # no run starts with less time left
POLL_S = 2.0


@dataclass(frozen=True)
class Launch:
    device: str = "auto"                # "cpu", "cuda" or "cuda:N"
    parallel: int | None = None         # runs at once per GPU (or on the CPU); None: 2 / 1
    max_minutes: float | None = None
    start_minutes: float | None = None  # no fresh run starts after this (resumes still do)
    keep_checkpoints: bool = False
    progress: bool = True


def open_study(out: Path, data: str, settings: StudySettings, *, force: bool = False,
               write: bool = True) -> dict:
    """Create OUT/study.json, or check that this command continues the study there: the same
    data (fingerprint) and FROZEN settings (write=False: only check). Returns the data's
    record."""
    meta = read_meta(data)
    if meta["val_sequences"] == 0:
        raise ValueError(f"--data {data} holds no validation sequences: a study measures "
                         f"validation loss; prepare it with --val-sequences N or --val-input")
    record = {"dir": str(data), "fingerprint": data_fingerprint(meta),
              "corpus": (meta.get("corpus") or {}).get("fingerprint"),
              "train_tokens": meta["train_sequences"] * meta["seq_len"],
              "val_sequences": meta["val_sequences"] * meta["seq_len"] // settings.seq_len}
    path = out / STUDY
    if path.exists() and not force:
        old = read_study(out)
        changed = changed_frozen(old["settings"], settings)
        if changed:
            raise ValueError(f"{out} holds a study whose runs differ: {'; '.join(changed)}; "
                             f"continue it with those settings, give another --out, or "
                             f"--force to start it over (deleting its runs and rows)")
        if old["data"]["fingerprint"] != record["fingerprint"]:
            raise ValueError(f"{out} holds a study trained on data of fingerprint "
                             f"{old['data']['fingerprint']} (corpus {old['data'].get('corpus')}"
                             f"), and --data {data} has {record['fingerprint']} (corpus "
                             f"{record['corpus']}): its rows would not compare; give the "
                             f"study's data, or another --out")
    if not write:
        return record
    with _locked(out):      # not under a command, or runs, still training here
        if path.exists() and force:
            for name in ("runs", "specs", "logs"):
                shutil.rmtree(out / name, ignore_errors=True)
            (out / "rows.jsonl").unlink(missing_ok=True)
        write_json(path, {"format": FORMAT, "version": VERSION,
                          "moremoe_version": __version__, "settings": settings.to_dict(),
                          "data": record})
    return record


def read_study(out: Path) -> dict:
    import json
    path = Path(out) / STUDY
    try:
        d = json.loads(path.read_text())
    except OSError:
        raise ValueError(f"{out} holds no study ({STUDY} is missing); run `moremoe study lm "
                         f"--out {out}` first") from None
    except ValueError:          # not JSON, or not UTF-8 text
        raise ValueError(f"{path} is not JSON: the file is corrupt") from None
    if not (isinstance(d, dict) and d.get("format") == FORMAT and isinstance(
            d.get("settings"), dict) and isinstance(d.get("data"), dict)
            and isinstance(d["data"].get("fingerprint"), str)):
        raise ValueError(f"{path} is not a study's {STUDY} (format, settings and the data's "
                         f"fingerprint): the file was edited; restore it from where it was "
                         f"committed")
    settings_of(d, path)
    return d


def settings_of(study: dict, path: Path | None = None) -> StudySettings:
    s = dict(study["settings"])
    for k, v in s.items():
        if isinstance(v, list):
            s[k] = tuple(v)
    try:
        return StudySettings(**s)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path or STUDY}: its settings are not this version's "
                         f"({' '.join(str(err).split())[:160]}): the file was edited; "
                         f"restore it from where it was committed") from None


class Study:
    """The runs of a study and what is known of them (module docstring)."""

    def __init__(self, out: str | Path, data: str, settings: StudySettings, launch: Launch,
                 *, echo=print, force: bool = False, write: bool = True):
        self.out, self.data, self.settings, self.launch = Path(out), data, settings, launch
        self.echo = echo
        self.record = open_study(self.out, data, settings, force=force, write=False)
        self.runs = plan_runs(settings, train_tokens=self.record["train_tokens"])
        if write:                               # a plan that stands: only now any file
            open_study(self.out, data, settings, force=force)
        self.rows = read_rows(self.out)
        self.val_rows = min(settings.val_sequences or self.record["val_sequences"],
                            self.record["val_sequences"])
        foreign = [r for r in self.rows.values()
                   if (r.get("data") or {}).get("fingerprint") not in (None,
                                                                       self.record["fingerprint"])]
        if foreign:
            raise ValueError(f"{self.out / 'rows.jsonl'}: run {foreign[0]['run']} trained on "
                             f"data of fingerprint {foreign[0]['data']['fingerprint']}, not "
                             f"{self.record['fingerprint']}; give the study's data")

    # ------------------------------------------------------------ what each run needs
    def lr_of(self, run) -> float | None:
        if run.lr is not None:
            return run.lr
        return chosen_lr(self.rows, self.runs, run.lr_config)

    def eval_every(self, run) -> int:
        s = self.settings
        if run.kind == "lr":
            return s.steps(run.tokens)
        return max(1, round(s.eval_tokens / s.tokens_per_step))

    def run_config(self, run, lr: float, device: str) -> RunConfig:
        s, steps, cuda = self.settings, self.settings.steps(run.tokens), device != "cpu"
        factor = run.router_lr_factor
        d = RunConfig().to_dict()
        d["model"].update(run.model, seq_len=s.seq_len, vocab=None)
        d["optim"].update(lr=lr, router_lr=lr * factor if factor != 1 else None,
                          moments="fp32")
        d["train"].update(data=self.data, batch_size=s.batch, grad_accum=1, max_steps=steps,
                          eval_every=self.eval_every(run), log_every=max(1, min(50, steps // 20)),
                          eval_batches=math.ceil(self.val_rows / s.batch),
                          ckpt_every=max(1, steps // 2), keep=1, seed=run.seed,
                          out=str(self.out / "runs" / run.name), device=device, compile=cuda,
                          compile_mode="auto", compile_scope="model", fused_loss=cuda)
        return apply_overrides(d, s.overrides)

    def blocked(self, run) -> bool:
        """Every selection run of its configuration diverged: no rate to train it at."""
        return run.lr is None and no_lr(self.rows, self.runs, run.lr_config)

    def state(self, run) -> str:
        if run.name in self.rows:
            return "diverged" if "diverged" in self.rows[run.name] else "done"
        if self.blocked(run):
            return "no lr: every candidate diverged"
        if (self.out / "runs" / run.name / "log.jsonl").exists():
            return "started"
        return "pending" if self.lr_of(run) is not None else "waiting for its lr"

    # ------------------------------------------------------------ training
    def train(self) -> dict:
        """Train every run that can run, within the budget; returns what happened. The
        study's folder is locked while this command or a process it started runs."""
        with _locked(self.out) as fd:
            return _Pool(self, fd).drive()

    def collect(self, run, lr: float) -> dict | None:
        """The row of a run whose folder holds a finished run, or one that diverged
        (written to rows.jsonl)."""
        run_dir = self.out / "runs" / run.name
        summary = finished_summary(run_dir)
        if summary is None:
            try:
                step = diverged_at(run_dir)
            except ValueError:          # no log yet, or none that reads
                return None
            if step is None:
                return None
            record = {k: self.record[k] for k in ("dir", "fingerprint", "corpus")}
            row = diverged_row(run, lr, step, run_dir, data=record,
                               tokens_per_step=self.settings.tokens_per_step)
            append_row(self.out, row)
            self.rows[run.name] = row
            return row
        row = run_row(run, run_dir, summary, lr=lr,
                      router_lr=lr * run.router_lr_factor, eval_every=self.eval_every(run),
                      val_sequences=self.val_rows,
                      layer_flops=model_spec(run.model, self.settings).moe_config()
                      .active_flops())
        append_row(self.out, row)
        self.rows[run.name] = row
        if not self.launch.keep_checkpoints:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return row


class _Pool:
    """The processes of one command (Study.train)."""

    def __init__(self, study: Study, lock_fd: int | None):
        self.study, self.launch, self.lock_fd = study, study.launch, lock_fd
        self.t0 = time.monotonic()
        self.active: dict[str, tuple] = {}        # name -> (run, process, slot, lr)
        self.slots = _slots(self.launch)
        # runs at once a slot; lowered by one where a run ran out of memory beside others
        self.cap = {d: self._per_slot() for d in self.slots}
        self.log_at: dict[str, int] = {}          # name -> its log's size at its start
        self.stopping, self.announced = None, False
        self.failed, self.finished, self.stopped = [], [], []

    def left(self) -> float | None:
        if self.launch.max_minutes is None:
            return None
        return 60 * self.launch.max_minutes - (time.monotonic() - self.t0)

    def drive(self) -> dict:
        s = self.study
        for run in s.runs:                      # finished before a kill wrote their rows
            lr = s.lr_of(run)
            if run.name not in s.rows and lr is not None and s.collect(run, lr):
                self.finished.append(run.name)
        todo = [r for r in s.runs if r.name not in s.rows]
        total = sum(r.tokens for r in todo)
        bar = progress_bar(total, desc="study", enabled=self.launch.progress)
        done_tokens = 0
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT,
                                                                   signal.SIGTERM)}
        try:
            while True:
                self._reap()
                if self.stopping is None:
                    self._start_ready()
                elif not self.announced:
                    self._stop_all()
                if not self.active:
                    break
                time.sleep(POLL_S)
                now = self._tokens_done(todo)
                bar.update(max(0, now - done_tokens))
                done_tokens = max(now, done_tokens)
        finally:
            self._terminate()       # a second signal meanwhile changes nothing
            for sig, handler in old.items():
                signal.signal(sig, handler)
            bar.close()
        blocked = [r.name for r in s.runs if r.name not in s.rows and s.blocked(r)]
        waiting = [r.name for r in s.runs if r.name not in s.rows and r.name not in blocked]
        return {"finished": self.finished, "stopped": self.stopped, "failed": self.failed,
                "left": waiting, "blocked": blocked, "signal": self.stopping,
                "seconds": time.monotonic() - self.t0}

    def _start_ready(self) -> None:
        s, left = self.study, self.left()
        late = (self.launch.start_minutes is not None
                and time.monotonic() - self.t0 > 60 * self.launch.start_minutes)
        for run in s.runs:
            if not self._free_slot() or (left is not None and left < LAST_START_S):
                return
            if run.name in s.rows or run.name in self.active or run.name in self.failed:
                continue
            if late and not (s.out / "runs" / run.name / "log.jsonl").exists():
                continue            # past --start-minutes: only runs with a checkpoint here
            lr = s.lr_of(run)
            if lr is not None:
                self._start(run, lr, self._free_slot())

    def _free_slot(self):
        used = [a[2] for a in self.active.values()]
        return next((d for d in self.slots if used.count(d) < self.cap[d]), None)

    def _per_slot(self) -> int:
        return self.launch.parallel or (1 if self.slots == ["cpu"] else 2)

    def _start(self, run, lr: float, slot: str) -> None:
        s = self.study
        cfg = s.run_config(run, lr, "cpu" if slot == "cpu" else "cuda")
        spec = s.out / "specs" / f"{run.name}.yaml"
        import yaml
        write_atomic(spec, yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())
        run_dir = s.out / "runs" / run.name
        argv = [sys.executable, "-m", "moremoe.cli", "train", "--config", str(spec), "--json"]
        if (run_dir / "log.jsonl").exists():
            argv.append("--resume")
        left = self.left()
        if left is not None:
            argv += ["--max-minutes", f"{max(0.1, (left - MARGIN_S) / 60):.3f}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if slot == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self._per_slot()))
        else:
            env["CUDA_VISIBLE_DEVICES"] = slot
        log = s.out / "logs" / f"{run.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_at[run.name] = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    pass_fds=() if self.lock_fd is None else (self.lock_fd,))
        self.active[run.name] = (run, proc, slot, lr)
        self.study.echo(f"start {run.name} (lr {lr:g}{', resumed' if '--resume' in argv else ''}"
                        f", {'GPU ' + slot if slot != 'cpu' else 'CPU'}) "
                        f"[{len(self.active)} running, {len(s.rows)}/{len(s.runs)} done]")

    def _reap(self) -> None:
        for name, (run, proc, slot, lr) in list(self.active.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.active[name]
            row = self.study.collect(run, lr)
            if row is not None and "diverged" in row:
                self.finished.append(name)
                self.study.echo(f"DIVERGED {name} at step {row['diverged']:,} (lr {lr:g}): "
                                f"a result, recorded; it is not trained again")
            elif row is not None:
                self.finished.append(name)
                self.study.echo(f"done  {name}: val loss {row['val_loss']:.4f} (ppl "
                                f"{row['val_ppl']:.2f}), {row['tokens']:,} tokens in "
                                f"{duration(row['wall_s'])}")
            elif code in (75, 130, 143) or self.stopping is not None:
                self.stopped.append(name)
                self.study.echo(f"stop  {name} at its checkpoint (exit {code}): the next "
                                f"command resumes it")
            elif self._crowded_out(name, slot):
                pass                            # started again once the slot has room
            else:
                self.failed.append(name)
                self.study.echo(f"FAIL  {name} (exit {code}): {_last_line(self.study, name)}")

    def _crowded_out(self, name: str, slot: str) -> bool:
        """A run that ran out of GPU memory beside other runs of its slot is not a failure of
        the run: the slot takes one run fewer from now on (a GPU too small for the parallel
        asked for) and the run starts again, from its checkpoint, when there is room. Alone
        on its slot, out of memory is the run's own failure."""
        beside = sum(a[2] == slot for a in self.active.values())
        if slot == "cpu" or beside == 0 or not self._out_of_memory(name):
            return False
        self.cap[slot] = min(self.cap[slot], beside)
        self.study.echo(f"OOM   {name} ran out of memory beside {beside} other run(s) on GPU "
                        f"{slot}: it starts again from its checkpoint when one of them ends; "
                        f"GPU {slot} runs {self.cap[slot]} at once from now on")
        return True

    def _out_of_memory(self, name: str) -> bool:
        """Whether the run's last start said it ran out of memory (its part of the log)."""
        try:
            with open(self.study.out / "logs" / f"{name}.log", "rb") as f:
                f.seek(self.log_at.get(name, 0))
                return b"ran out of memory" in f.read()
        except OSError:
            return False

    def _tokens_done(self, todo) -> int:
        done = sum(r.tokens for r in todo if r.name in self.study.rows)
        for run, *_ in self.active.values():
            done += _logged_tokens(self.study.out / "runs" / run.name)
        return done

    def _on_signal(self, signum, frame) -> None:
        """Only notes the signal: the loop stops the runs (_stop_all) at its next turn,
        outside the handler."""
        if self.stopping is None:
            self.stopping = signal.Signals(signum).name

    def _stop_all(self) -> None:
        self.announced = True
        self.study.echo(f"{self.stopping}: stopping every run at its checkpoint")
        for _, proc, *_ in self.active.values():
            _send(proc, signal.SIGTERM)

    def _terminate(self, wait_s: float = 300) -> None:
        """Ask what still runs to stop (each checkpoints), wait, then kill."""
        for _, proc, *_ in self.active.values():
            _send(proc, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while self.active and time.monotonic() < deadline:
            time.sleep(0.5)
            self._reap()
        for _, proc, *_ in self.active.values():
            _send(proc, signal.SIGKILL)


def _send(proc, sig) -> None:
    """A signal to a run's process (a terminal's Ctrl-C reaches it too: the study's runs
    share its process group, and `moremoe train` takes two requests within a second as one)."""
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def _locked(out: Path):
    """An exclusive lock on OUT/.lock, held by this command and passed to the processes it
    starts, so no second command trains the same runs while one of them lives (a command
    killed with -9 leaves its runs running: they keep the lock until they end)."""
    try:
        import fcntl
    except ImportError:     # not POSIX: no lock
        yield None
        return
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another `moremoe study` command, or a run it started, is "
                             f"training in {out}; wait for it to end (or stop it: its runs "
                             f"checkpoint on SIGTERM)") from None
        yield fd
    finally:
        os.close(fd)


def _slots(launch: Launch) -> list[str]:
    """Where runs go: ["cpu"], or the GPUs as CUDA_VISIBLE_DEVICES values for a run's
    process: this process's own CUDA_VISIBLE_DEVICES entries where it has one (its cuda:0
    is the first of them), else the indices."""
    from ..runtime import resolve_device
    import torch
    dev = resolve_device(launch.device)
    if dev.type == "cpu":
        return ["cpu"]
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            if d.strip()]
    count = torch.cuda.device_count()
    ids = seen[:count] if len(seen) >= count else [str(i) for i in range(count)]
    return [ids[dev.index]] if dev.index is not None else ids


def _logged_tokens(run_dir: Path) -> int:
    import json
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "train" and isinstance(e.get("tokens"), int):
            return e["tokens"]
    return 0


def _last_line(study: Study, name: str) -> str:
    try:
        lines = (study.out / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return "no output"
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (errs or lines or ["no output"])[-1][:300] + f" (whole output: logs/{name}.log)"
