"""Nothing a run made is lost: incomplete checkpoints are found, skipped on resume and
replaced, never trusted; a run directory is only reused with --resume or --force; a
non-finite step stops (or is skipped) before it reaches the weights or a checkpoint; bad
token ids are named errors that leave nothing behind."""
import numpy as np
import pytest
import torch

from moremoe.model import checkpoint as stored
from moremoe.training.compose import build_run_config
from moremoe.training.lm import LMTrainer, NonFiniteStep, train
from prepared import write_token_dir
from runs import SMALL, assert_same_run, events, quiet


def _cfg(data, out, **kw):
    overrides = kw.pop("overrides", SMALL)
    return build_run_config(preset=kw.pop("preset", "tiny-more"), data=str(data), out=str(out),
                            device="cpu", overrides=overrides, **kw)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-64])


def test_an_incomplete_checkpoint_is_skipped_on_resume_and_written_anew(
        text_data, tmp_path, reference_run, one_thread):
    out = tmp_path / "run"
    train(_cfg(text_data, out, stop_step=25), echo=quiet)
    broken = out / "checkpoints" / "step_00000025"
    _truncate(broken / stored.MODEL_FILE)
    with pytest.raises(FileExistsError, match="already holds checkpoints .*--resume.*--force"):
        train(_cfg(text_data, out), echo=quiet)
    said = []
    summary = train(_cfg(text_data, out), resume=True, echo=said.append)
    warned = [t for t in said if t.startswith("warning: skipping incomplete checkpoints")]
    assert len(warned) == 1 and "step_00000025 (model.safetensors has" in warned[0]
    assert "step_00000020" in warned[0]                      # where it resumed from
    assert [e["step"] for e in events(out, "resume")] == [20]
    saved = [e["step"] for e in events(out, "checkpoint")]
    assert saved.count(25) == 1 and saved[-1] == 60          # step 25 saved again, once
    assert summary["step"] == 60 and not stored.incomplete_checkpoints(out)
    assert_same_run(out, reference_run)


def test_an_evaluation_that_died_runs_first_on_resume(text_data, tmp_path, reference_run,
                                                     one_thread, monkeypatch):
    """A run killed inside the evaluation due at a step (an out-of-memory on a shared GPU)
    saves that step without it; the resumed run evaluates it before its next step, so the
    curve keeps every scheduled evaluation and the run stays the uninterrupted one."""
    real = LMTrainer.evaluate

    def dies_at_20(self):
        if self.step == 20:
            raise RuntimeError("CUDA out of memory (the test's)")
        return real(self)
    monkeypatch.setattr(LMTrainer, "evaluate", dies_at_20)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="out of memory"):
        train(_cfg(text_data, out), echo=quiet)
    assert stored.step_of(stored.latest_checkpoint(out)) == 20
    assert 20 not in [e["step"] for e in events(out, "eval")]
    monkeypatch.setattr(LMTrainer, "evaluate", real)
    train(_cfg(text_data, out), resume=True, echo=quiet)
    assert [e["step"] for e in events(out, "eval")] == [20, 40, 60]
    assert_same_run(out, reference_run)


def test_a_run_of_only_incomplete_checkpoints_needs_force(text_data, tmp_path):
    out = tmp_path / "run"
    short = SMALL[:-1] + ["train.max_steps=5"]
    train(_cfg(text_data, out, overrides=short), echo=quiet)
    (out / "checkpoints" / "step_00000005" / stored.STATE_FILE).unlink()
    with pytest.raises(FileExistsError, match="already holds incomplete checkpoints"):
        train(_cfg(text_data, out, overrides=short), echo=quiet)
    with pytest.raises(FileExistsError, match=r"--resume: .* has no complete checkpoint; "
                                              r"incomplete: .*step_00000005 \(state.pt is "
                                              r"missing\); pass --force"):
        train(_cfg(text_data, out, overrides=short), resume=True, echo=quiet)
    with pytest.raises(ValueError, match="not both"):
        train(_cfg(text_data, out, overrides=short), resume=True, force=True, echo=quiet)
    summary = train(_cfg(text_data, out, overrides=short), force=True, echo=quiet)
    assert summary["step"] == 5 and [p.name for p in stored.checkpoints(out)] == ["step_00000005"]
    assert [e["step"] for e in events(out, "start")] == [0]  # the old log went with --force


def test_a_log_without_checkpoints_is_not_overwritten(text_data, tmp_path):
    """Steps trained and logged, no checkpoint yet (a run killed early): kept."""
    out = tmp_path / "run"
    out.mkdir()
    log = '{"event": "start", "step": 0}\n{"event": "train", "step": 10, "loss": 3.0}\n'
    (out / "log.jsonl").write_text(log)
    with pytest.raises(FileExistsError, match="already holds the log of a run"):
        train(_cfg(text_data, out), echo=quiet)
    assert (out / "log.jsonl").read_text() == log


def test_a_run_that_failed_before_its_first_step_does_not_block_its_rerun(text_data,
                                                                           tmp_path):
    """What a run that failed at its start leaves (its config, a log of its start and its
    end with the error, a summary) holds no work: the same command, fixed, runs there."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text('{"event": "start", "step": 0}\n{"event": "end", "step": '
                                   '0, "stopped": "error: RuntimeError: boom"}\n')
    (out / "config.json").write_text('{"model": {}, "optim": {}, "train": {}}')
    (out / "summary.json").write_text('{"stopped": "error: RuntimeError: boom"}')
    summary = train(_cfg(text_data, out), echo=quiet)
    assert summary["finished"] and [e["step"] for e in events(out, "start")] == [0]


def test_a_non_finite_step_stops_before_it_reaches_the_weights(text_data, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(text_data, out, preset="tiny-moe", overrides=SMALL + ["optim.lr=1e4",
                                                                     "optim.warmup_frac=0"])
    with pytest.raises(NonFiniteStep, match=r"step (\d+): the loss is .* and the gradient "
                                            r"norm .*lower optim.lr.*nan_policy=skip") as err:
        train(cfg, echo=quiet)
    bad = int(str(err.value).split()[1].rstrip(":"))
    [event] = events(out, "nonfinite")
    assert event["step"] == bad and event["policy"] == "stop"
    assert [e["stopped"] for e in events(out, "end")][0].startswith("error: NonFiniteStep")
    for path in stored.checkpoints(out):                       # nothing non-finite was saved
        assert stored.step_of(path) < bad
        assert all(torch.isfinite(t).all() for t in stored.load_model(path).state_dict().values())


def test_skip_policy_skips_the_non_finite_update(text_data, tmp_path, monkeypatch):
    calls, real = [], torch.nn.utils.get_total_norm

    def third_is_nan(grads, *args, **kw):
        calls.append(1)
        norm = real(grads, *args, **kw)
        return norm * float("nan") if len(calls) == 3 else norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", third_is_nan)
    out = tmp_path / "run"
    short = SMALL[:-1] + ["train.max_steps=6", "train.nan_policy=skip"]
    said = []
    summary = train(_cfg(text_data, out, overrides=short), echo=said.append)
    assert summary["step"] == 6 and summary["skipped_steps"] == 1
    assert summary["stopped"] == "max_steps" and summary["exit_code"] == 0
    assert [e["step"] for e in events(out, "nonfinite")] == [3]
    assert any("step 3: the loss is" in t and "skipped" in t for t in said)
    [three] = [e for e in events(out, "train") if e["step"] == 3]
    assert three["skipped"] == 1 and three["loss"] is None          # strict JSON: null


def test_skip_policy_stops_after_the_limit(text_data, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(text_data, out, preset="tiny-moe", overrides=SMALL + [
        "optim.lr=1e4", "optim.warmup_frac=0", "train.nan_policy=skip",
        "train.nan_skip_limit=2"])
    with pytest.raises(NonFiniteStep, match="the 2th non-finite step in a row"):
        train(cfg, echo=quiet)


def test_token_ids_beyond_the_vocabulary_are_named_and_leave_no_checkpoint(tmp_path):
    data = write_token_dir(tmp_path / "data")
    rows = np.fromfile(data / "train.bin", dtype="<u2").reshape(-1, 128)
    rows[:, 7] = 300                                         # vocab_size 256
    rows.tofile(data / "train.bin")
    out = tmp_path / "run"
    cfg = _cfg(data, out, overrides=["model.vocab=256", "train.batch_size=64",
                                     "train.max_steps=20"])
    with pytest.raises(ValueError, match=r"train.bin: sequence \d+ holds token id 300, not below "
                                         r"the model's vocabulary of 256.*moremoe data verify"):
        train(cfg, echo=quiet)
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
    assert not (out / "summary.json").exists() or "error" in (out / "summary.json").read_text()
