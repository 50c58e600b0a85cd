"""The trainer with the fused expert kernels (CPU: Triton interpreter): the banks that add
their weight gradients into .grad in the backward train exactly as the autograd path, over
accumulation micro-steps, with the clip folded into the update, and resume exactly; as
expert-parallel shards on 2 gloo ranks they equal one process."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.training.compose import build_run_config  # noqa: E402
from moremoe.training.lm import LMTrainer, train  # noqa: E402

from runs import assert_same_run, curve, quiet, torchrun_train  # noqa: E402

SETS = ["model.seq_len=16", "model.layers=1", "model.experts_impl=triton",
        "train.batch_size=2", "train.grad_accum=3", "train.log_every=1", "train.eval_every=4",
        "train.eval_batches=1", "train.ckpt_every=1", "train.max_steps=3", "optim.clip=0.5",
        "optim.expert_grads=in_place"]


def _train(data, out, sets=(), **kw):
    cfg = build_run_config(preset="tiny-moe", data=str(data), out=str(out), device="cpu",
                           overrides=SETS + list(sets))
    return train(cfg, echo=quiet, **kw)


def test_in_place_expert_gradients_train_exactly_like_autograd(text_data, tmp_path,
                                                               monkeypatch):
    banks = []
    real = LMTrainer._wrapped

    def spy(self):
        real(self)
        banks.extend(self.in_place)
    monkeypatch.setattr(LMTrainer, "_wrapped", spy)
    _train(text_data, tmp_path / "in_place")
    assert len(banks) == 1 and banks[0].in_place_grads      # the one layer's bank
    monkeypatch.setattr(LMTrainer, "_wrapped", real)
    _train(text_data, tmp_path / "autograd", ["optim.expert_grads=autograd"])
    got, want = curve(tmp_path / "in_place"), curve(tmp_path / "autograd")
    assert len(got) == 3 and all(norm > 0.5 for _, _, norm in got)     # the clip acts
    assert got == want                    # the same fp32 adds in the same order


def test_in_place_run_resumes_exactly(text_data, tmp_path):
    _train(text_data, tmp_path / "ref")
    first = _train(text_data, tmp_path / "run", ["train.stop_step=1"])
    assert first["step"] == 1
    _train(text_data, tmp_path / "run", resume=True)
    assert_same_run(tmp_path / "run", tmp_path / "ref")


def test_in_place_expert_shards_on_two_ranks_equal_one_process(text_data, tmp_path):
    """E = 2: each rank's bank (4 of 8 experts) accumulates in place over 2 micro-steps of
    its own rows; ExpertPlan reduces the .grad buffers and takes the global norm."""
    ep = ["train.batch_size=1", "train.grad_accum=2", "parallel.expert=2",
          "train.max_steps=2", "optim.moments=bf16"]
    torchrun_train(text_data, tmp_path / "ep", SETS + ep, preset="tiny-moe")
    _train(text_data, tmp_path / "one", ["train.batch_size=2", "train.grad_accum=2",
                                         "train.max_steps=2", "optim.moments=bf16"])
    got, want = curve(tmp_path / "ep"), curve(tmp_path / "one")
    assert len(got) == 2
    for (s1, loss1, norm1), (s2, loss2, norm2) in zip(got, want):
        assert s1 == s2 and loss1 == pytest.approx(loss2, rel=1e-5)
        assert norm1 == pytest.approx(norm2, rel=1e-5)
