"""Phonebook training: a tiny real run whose exact match rises, LR calibration and the
capacity search's binary search."""
import pytest

from moremoe.nn import MoEConfig
from moremoe.training import phonebook as tp
from moremoe.training.phonebook import (PhonebookTrainConfig, capacity_search,
                                        phonebook_model_config, train_phonebook)


def test_tiny_run_memorises(tmp_path):
    model_cfg = phonebook_model_config(MoEConfig.more(16, 2, 32, 16, 8), layers=1)
    cfg = PhonebookTrainConfig(size=64, batch_size=64, lr=3e-3, max_steps=300, eval_every=50,
                               eval_entries=64, threshold=0.95, device="cpu")
    seen = []
    run, model = train_phonebook(model_cfg, cfg, progress=False,
                                 on_eval=lambda r: seen.append(len(r.history)))
    ems = [h["exact_match"] for h in run.history]
    assert ems[0] < 0.2 and run.exact_match > 0.5 and run.exact_match > ems[0]
    assert run.history[-1]["loss"] < run.history[0]["loss"]
    assert len(run.hnorm) == 1 and 0 < run.hnorm[0] <= 1
    assert seen and seen == sorted(seen)          # the report callback ran at each evaluation
    assert run.lr == 3e-3 and run.steps <= 300
    if run.reached:                               # early stopping stops at the threshold
        assert run.history[-1]["exact_match"] >= 0.95


def test_calibration_picks_the_best_char_accuracy(monkeypatch):
    acc = {1e-4: 0.2, 3e-4: 0.7, 1e-3: 0.5}

    def fake_train(model_cfg, cfg, **kw):
        run = tp.PhonebookRun(name="x", model={}, train={}, lr=cfg.lr, params_total=0,
                              flops_inference=0, flops_training=0)
        run.char_accuracy = acc[cfg.lr]
        assert cfg.max_steps == 7 and cfg.threshold == float("inf")
        return run, None

    monkeypatch.setattr(tp, "train_phonebook", fake_train)
    cfg = PhonebookTrainConfig(size=10, calibration_steps=7)
    model_cfg = phonebook_model_config(MoEConfig.moe(4, 2, 32, 8), layers=1)
    assert tp.calibrate_lr(model_cfg, cfg, progress=False) == acc


@pytest.mark.parametrize("capacity", [None, 100, 300, 1000, 3000, 10000])
def test_capacity_binary_search(monkeypatch, capacity):
    tried = []

    def fake_train(model_cfg, cfg, **kw):
        tried.append(cfg.size)
        run = tp.PhonebookRun(name="x", model={}, train={"size": cfg.size}, lr=1e-3,
                              params_total=0, flops_inference=0, flops_training=0)
        run.reached = capacity is not None and cfg.size <= capacity
        return run, None

    monkeypatch.setattr(tp, "train_phonebook", fake_train)
    grid = [10000, 100, 300, 1000, 3000]
    model_cfg = phonebook_model_config(MoEConfig.moe(4, 2, 32, 8), layers=1)
    result = capacity_search(model_cfg, grid, PhonebookTrainConfig(size=1, lr=1e-3),
                             progress=False)
    assert result.capacity == capacity
    assert len(tried) <= 3 and result.sizes == sorted(grid)


def test_config_errors():
    with pytest.raises(ValueError, match="loss_on must be one of"):
        PhonebookTrainConfig(size=10, loss_on="name")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        PhonebookTrainConfig(size=10, batch_size=0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        PhonebookTrainConfig(size=10, lr=-1.0)


def test_planned_steps():
    assert PhonebookTrainConfig(size=2048, batch_size=1024, max_epochs=3).planned_steps() == 6
    assert PhonebookTrainConfig(size=10, max_steps=5).planned_steps() == 5
