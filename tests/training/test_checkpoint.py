"""Checkpoints (atomic, keep-last-K, load_model from a run or checkpoint directory), the data
sampler's position, and resume refusing a changed config."""
import math

import numpy as np
import pytest
import torch

from moremoe.model import Transformer, TransformerConfig
from moremoe.nn.moe import MoEConfig
from moremoe.model import checkpoint as stored
from moremoe.training import checkpoint as ck
from moremoe.training.compose import build_run_config
from moremoe.tasks.text import open_tokens
from moremoe.training.data import Batches, rows_of
from moremoe.training.lm import train
from numerics import model_reduction_length, reduction_tol


def tiny_model():
    cfg = TransformerConfig(vocab=50, layers=1, heads=2, max_seq_len=16,
                            moe=MoEConfig.more(8, 2, 16, 8, 4))
    return Transformer(cfg)


def save(run, step, model, keep=2):
    return ck.save_checkpoint(run, step, model.state_dict(), model_config=model.config,
                              run_config={"x": 1}, state={"step": step}, keep=keep)


def test_checkpoint_files_share_the_mode_the_umask_gives(tmp_path):
    """safetensors >= 0.8 writes its file 0600: a checkpoint's weights are as readable as
    its other files (0644 under umask 022)."""
    import os
    old = os.umask(0o022)
    try:
        final = save(tmp_path, 1, tiny_model())
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in final.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


def test_save_load_round_trip_and_keep(tmp_path):
    model = tiny_model()
    for step in (1, 2, 3):
        save(tmp_path, step, model)
    assert [p.name for p in stored.checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    (tmp_path / "checkpoints" / ".step_00000009.tmp-1").mkdir()         # a torn write
    (tmp_path / "checkpoints" / "step_00000008").mkdir()                # incomplete
    assert stored.latest_checkpoint(tmp_path).name == "step_00000003"
    loaded = stored.load_model(tmp_path)
    again = stored.load_model(tmp_path / "checkpoints" / "step_00000003")
    assert loaded.config == model.config
    ref = model.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], ref[k]) for k in ref)
    assert all(torch.equal(again.state_dict()[k], ref[k]) for k in ref)
    tokens = torch.randint(0, 50, (2, 16))
    model.eval()
    torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits,
                               **reduction_tol(torch.float32,
                                               model_reduction_length(model.config)))
    assert stored.read_config(tmp_path)["train"] == {"x": 1}
    assert ck.load_state(tmp_path)["step"] == 3
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        stored.load_model(tmp_path / "nothing")
    save(tmp_path, 4, model)                                 # a new save clears torn writes
    assert not (tmp_path / "checkpoints" / ".step_00000009.tmp-1").exists()
    assert [p.name for p in stored.checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def _break(ckpt, how):
    """Damage one file of a checkpoint as a full disk, a partial copy or a hand does."""
    if how == "missing":
        (ckpt / stored.STATE_FILE).unlink()
    elif how == "truncated_weights":
        path = ckpt / stored.MODEL_FILE
        path.write_bytes(path.read_bytes()[:-100])
    elif how == "truncated_state":
        path = ckpt / stored.STATE_FILE
        path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    elif how == "empty_config":
        (ckpt / stored.CONFIG_FILE).write_text("")
    elif how == "foreign_weights":          # a safetensors-sized file of other JSON
        header = b'["not", "a", "header"]'
        (ckpt / stored.MODEL_FILE).write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.parametrize("how, what", [("missing", "state.pt is missing"),
                                       ("truncated_weights", "model.safetensors has"),
                                       ("truncated_state", "state.pt is truncated"),
                                       ("empty_config", "config.json cannot be read"),
                                       ("foreign_weights", "model.safetensors holds no safetensors header")])
def test_incomplete_checkpoints_are_found_and_named(tmp_path, how, what):
    model = tiny_model()
    for step in (1, 2):
        save(tmp_path, step, model)
    broken = tmp_path / "checkpoints" / "step_00000002"
    _break(broken, how)
    assert stored.problems(tmp_path / "checkpoints" / "step_00000001") == []
    assert [p.name for p in stored.checkpoints(tmp_path)] == ["step_00000001"]
    [(path, why)] = stored.incomplete_checkpoints(tmp_path)
    assert path == broken and what in why[0]
    assert stored.latest_checkpoint(tmp_path).name == "step_00000001"
    load = ck.load_state if "state" in how or how == "missing" else stored.load_model
    with pytest.raises(ValueError, match=rf"step_00000002 is incomplete: {what}.*previous "
                                         rf"complete checkpoint is .*step_00000001"):
        load(broken)                   # the model alone loads without the optimizer state


def test_a_save_replaces_a_step_directory_it_did_not_write(tmp_path):
    """A resumed run that reaches a step an older run left incomplete writes it anew: the
    directory holds the new weights, never the old ones."""
    old, new = tiny_model(), tiny_model()
    save(tmp_path, 5, old)
    (tmp_path / "checkpoints" / "step_00000003").mkdir()          # incomplete, older
    (tmp_path / "checkpoints" / "step_00000009").mkdir()          # incomplete, newer
    _break(tmp_path / "checkpoints" / "step_00000005", "truncated_weights")
    save(tmp_path, 5, new)
    assert stored.problems(tmp_path / "checkpoints" / "step_00000005") == []
    got = stored.load_model(tmp_path).state_dict()
    assert all(torch.equal(got[k], v) for k, v in new.state_dict().items())
    assert not list((tmp_path / "checkpoints").glob(".step_*"))
    assert [p.name for p, _ in stored.incomplete_checkpoints(tmp_path)] == ["step_00000009"]


def test_corrupt_files_of_the_same_size_are_named_errors(tmp_path):
    model = tiny_model()
    save(tmp_path, 1, model)
    save(tmp_path, 2, model)
    state = tmp_path / "checkpoints" / "step_00000002" / stored.STATE_FILE
    data = bytearray(state.read_bytes())
    start = data.index(b"data.pkl") + 40                      # inside the pickled object
    data[start:start + 64] = bytes(64)
    state.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"step_00000002/state.pt cannot be read .*corrupt; "
                                         r"the previous complete checkpoint is"):
        ck.load_state(tmp_path)


def test_rng_state_round_trip():
    state = ck.rng_state()
    a = (torch.rand(3), np.random.rand(), __import__("random").random())
    ck.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(), __import__("random").random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_batches_partition_the_global_batch_and_roll_over_epochs():
    rows = np.arange(40 * 4, dtype=np.uint16).reshape(40, 4)
    one = Batches(rows, batch_size=8, world=1, grad_accum=1, seed=3)
    two = [Batches(rows, batch_size=2, world=2, grad_accum=2, seed=3) for _ in range(2)]
    assert one.steps_per_epoch == 5
    seen = []
    for step in range(7):                           # crosses into epoch 1
        big = one.micro_batch(0, 0)
        parts = [two[r].micro_batch(j, r) for j in range(2) for r in range(2)]
        assert sorted(map(tuple, big)) == sorted(tuple(p) for part in parts for p in part)
        seen.append(big[:, 0] // 4)
        for b in (one, *two):
            b.advance()
    epoch0 = np.concatenate(seen[:5])
    assert sorted(epoch0) == list(range(40))        # each row once per epoch
    assert one.state_dict()["epoch"] == 1 and one.state_dict()["offset"] == 2
    other = Batches(rows, batch_size=8, world=1, grad_accum=1, seed=3)
    other.load_state_dict(one.state_dict())
    assert np.array_equal(other.micro_batch(0, 0), one.micro_batch(0, 0))
    with pytest.raises(ValueError, match="global_batch is 8, this run's is 4"):
        Batches(rows, batch_size=4, world=1, grad_accum=1, seed=3).load_state_dict(
            one.state_dict())
    with pytest.raises(ValueError, match="fewer than one global batch of 64"):
        Batches(rows, batch_size=64, world=1, grad_accum=1, seed=3)


def test_token_reader_checks_sizes_and_rechunks(text_data, tmp_path):
    rows = open_tokens(text_data, "train")
    assert rows.dtype == np.uint16 and rows.shape[1] == 128
    half = rows_of(rows, 64)
    assert half.shape == (2 * rows.shape[0], 64) and np.array_equal(half[1], rows[0, 64:])
    with pytest.raises(ValueError, match="model.seq_len must divide the data's seq_len=128"):
        rows_of(rows, 48)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("meta.json", "val.bin"):
        (broken / f).write_bytes((text_data / f).read_bytes())
    (broken / "train.bin").write_bytes((text_data / "train.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="train.bin"):
        open_tokens(broken, "train")


def test_resume_refuses_a_changed_config(text_data, tmp_path):
    sets = ["model.seq_len=64", "train.batch_size=2", "train.eval_batches=1",
            "train.max_steps=4", "train.ckpt_every=2"]
    out = str(tmp_path / "run")
    kw = dict(preset="tiny-moe", data=str(text_data), out=out, device="cpu")
    s = train(build_run_config(overrides=sets, stop_step=2, **kw), echo=lambda t: None)
    assert s["step"] == 2 and math.isfinite(s["val_loss"])
    with pytest.raises(ValueError, match=r"config differs in optim.lr: 0.003 -> 0.01"):
        train(build_run_config(overrides=sets + ["optim.lr=0.01"], **kw), resume=True)
    done = train(build_run_config(overrides=sets + ["train.log_every=1"], **kw), resume=True,
                 echo=lambda t: None)
    assert done["step"] == 4 and done["steps_this_run"] == 2


def test_a_run_records_its_data_and_resumes_only_on_it(text_data, tmp_path):
    import json
    import shutil
    sets = ["model.seq_len=64", "train.batch_size=2", "train.eval_batches=1",
            "train.max_steps=4", "train.ckpt_every=2"]
    data = tmp_path / "data"
    shutil.copytree(text_data, data)
    meta = json.loads((data / "meta.json").read_text())
    meta["sha256"] = {"train.bin": "a" * 64, "val.bin": "b" * 64}
    meta["corpus"] = {"fingerprint": "c" * 64, "folder": "/corpus"}
    (data / "meta.json").write_text(json.dumps(meta))
    kw = dict(preset="tiny-moe", data=str(data), out=str(tmp_path / "run"), device="cpu")
    s = train(build_run_config(overrides=sets, stop_step=2, **kw), echo=lambda t: None)
    train_tokens = meta["train_sequences"] * meta["seq_len"]
    assert s["data"]["corpus"] == "c" * 64 and s["data"]["train_tokens"] == train_tokens
    assert s["epochs"] == s["tokens"] / train_tokens and s["tokens"] == 2 * 2 * 64
    assert s["tokens_per_param"] == s["tokens"] / s["params"]
    meta["sha256"]["val.bin"] = "d" * 64        # the same folder, other sequences
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"trained on data of fingerprint "
                                         rf"{s['data']['fingerprint']}"):
        train(build_run_config(overrides=sets, **kw), resume=True, echo=lambda t: None)


def test_run_log_truncation_drops_later_steps_and_a_cut_line(tmp_path):
    import json

    from moremoe.training.metrics import RunLog
    log = tmp_path / "log.jsonl"
    rows = [{"event": "start", "step": 0}, {"event": "train", "step": 5},
            {"event": "train", "step": 10}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "tra')
    run = RunLog(tmp_path, enabled=True, tensorboard=False)
    run.truncate_after(5)
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == [0, 5]
    run.truncate_after(-1)                                   # a fresh start keeps nothing
    assert log.read_text() == ""
    run.close()
