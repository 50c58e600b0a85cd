"""Phonebook training: a tiny real run whose exact match rises, and the sequential LR
calibration of train_phonebook (the searches: test_phonebook_search.py)."""
import pytest

from moremoe.nn import MoEConfig
from moremoe.phonebook import trainer as tp
from moremoe.phonebook.trainer import (PhonebookTrainConfig, phonebook_model_config,
                                        train_phonebook)


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

    class Fake:
        def __init__(self, model_cfg, cfg, lr, **kw):
            assert cfg.max_steps == 7 and cfg.threshold == float("inf") and cfg.lr == lr
            self.done, self.run = False, tp.PhonebookRun(
                name="x", model={}, train={}, lr=lr, params_total=0, flops_inference=0,
                flops_training=0, char_accuracy=acc[lr])

        def advance(self, stop=None):
            pass

        def settle(self):
            self.done = True

    monkeypatch.setattr(tp, "PhonebookTrainer", Fake)
    cfg = PhonebookTrainConfig(size=10, calibration_steps=7)
    model_cfg = phonebook_model_config(MoEConfig.moe(4, 2, 32, 8), layers=1)
    assert tp.calibrate_lr(model_cfg, cfg, progress=False) == acc


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
    # batches never end short: an epoch of 3,000 entries is 2.93 batches of 1,024
    assert PhonebookTrainConfig(size=3000, max_epochs=1500).planned_steps() == 4395
    assert PhonebookTrainConfig(size=100, max_epochs=2).planned_steps() == 2     # b = 100
