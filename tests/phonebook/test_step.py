"""The phonebook step (phonebook/step.py) on the CPU: the batch order, the schedule,
the accumulators read at evaluations, a non-finite loss, and an exact resume."""
import math

import pytest
import torch

from moremoe.nn import MoEConfig
from moremoe.phonebook.trainer import (PhonebookTrainConfig, PhonebookTrainer,
                                        phonebook_model_config, train_phonebook)
from moremoe.phonebook.step import COMPILE_OPTIONS, BatchOrder, PhonebookStep
from moremoe.checks import UserError

CPU = torch.device("cpu")


def tiny(M=8, r=4):
    return phonebook_model_config(MoEConfig.more(M, 2, 32, 8, r), layers=1)


@pytest.mark.parametrize("size, batch", [(10, 4), (12, 4), (5, 8), (1, 1), (7, 7)])
def test_batch_order_sees_every_entry_once_an_epoch(size, batch):
    order = BatchOrder(size, batch, seed=3, device=CPU)
    b = min(batch, size)
    stream = []
    for _ in range(3 * size):                     # 3 * size * b rows = 3b epochs
        idx = order.indices()
        assert idx.shape == (b,)
        stream += idx.tolist()
        order.advance_device()
        order.advance_host()
        assert int(order.start_t) == order.start < size
    for epoch in range(len(stream) // size):
        assert sorted(stream[epoch * size:(epoch + 1) * size]) == list(range(size))


def test_batch_order_is_the_seeds_and_resumes_exactly():
    a, b = BatchOrder(50, 16, seed=1, device=CPU), BatchOrder(50, 16, seed=1, device=CPU)
    other = BatchOrder(50, 16, seed=2, device=CPU)
    assert torch.equal(a.indices(), b.indices())
    assert not torch.equal(a.order_2P, other.order_2P)

    def batches(order, n):
        out = []
        for _ in range(n):
            out.append(order.indices().tolist())
            order.advance_device()
            order.advance_host()
        return out
    batches(a, 7)
    saved = a.state_dict()
    ahead = batches(a, 9)                          # crosses two epoch ends
    b.load_state_dict(saved)
    assert batches(b, 9) == ahead


def test_step_schedule_loss_and_counts_are_read_at_evaluations():
    cfg = PhonebookTrainConfig(size=40, batch_size=16, lr=1e-3, max_steps=100,
                               warmup_frac=0.1, device="cpu")
    step = PhonebookStep(tiny(), cfg, 1e-3, device=CPU)
    assert step.mode == "eager" and step.warmup == 10
    step.run(3)
    assert float(step.lr_t) == pytest.approx(3e-4)          # step 3 of a 10-step warmup
    got = step.read()
    assert math.isfinite(got["loss"]) and 1.0 < got["loss"] < 5.0
    assert got["first_bad"] == 0
    assert got["counts"].shape == (1, 8)
    assert int(got["counts"].sum()) == 3 * 16 * 15 * 2      # steps x rows x positions x k
    assert step.read()["counts"].sum() == 0                  # restarted
    step.run(12)
    assert float(step.lr_t) == pytest.approx(1e-3)          # constant after the warmup


def test_a_step_whose_loss_is_not_finite_is_skipped_and_named():
    cfg = PhonebookTrainConfig(size=32, batch_size=16, lr=1e-3, max_steps=20, eval_every=5,
                               device="cpu")
    step = PhonebookStep(tiny(), cfg, 1e-3, device=CPU)
    step.run(2)
    before = [p.detach().clone() for p in step.model.parameters()]
    with torch.no_grad():
        step.model.lm_head.weight.fill_(float("inf"))          # every logit non-finite
    step.run(2)
    assert step.read()["first_bad"] == 3
    head = step.model.lm_head.weight
    assert torch.isinf(head).all()                           # the update was skipped, not NaN
    others = [p for p in step.model.parameters() if p is not head]
    assert all(torch.equal(p, b) for p, b in zip(others, [b for b, p in
               zip(before, step.model.parameters()) if p is not head]))


def test_train_phonebook_names_the_step_whose_loss_is_not_finite():
    cfg = PhonebookTrainConfig(size=32, batch_size=16, lr=1e9, max_steps=40, eval_every=10,
                               device="cpu")
    with pytest.raises(UserError, match=r"step \d+: the loss is not finite; lower the "
                                        r"learning rate \(--lr 1e\+09\)"):
        train_phonebook(tiny(), cfg, progress=False)


def test_resume_from_a_state_continues_exactly():
    cfg = PhonebookTrainConfig(size=48, batch_size=16, lr=3e-3, max_steps=30, eval_every=5,
                               threshold=float("inf"), device="cpu")
    whole = PhonebookTrainer(tiny(), cfg, 3e-3, name="whole")
    while not whole.done:
        whole.advance()
        whole.settle()
    first = PhonebookTrainer(tiny(), cfg, 3e-3, name="first")
    for _ in range(3):
        first.advance()
        first.settle()
    state = first.state_dict()
    resumed = PhonebookTrainer(tiny(), cfg, 3e-3, name="first", state=state)
    assert resumed.run.resumed_at == 15 and len(resumed.run.history) == 3
    while not resumed.done:
        resumed.advance()
        resumed.settle()
    # the same kernels on the same machine: the same numbers, bit for bit
    assert [h["loss"] for h in resumed.run.history] == [h["loss"] for h in whole.run.history]
    assert resumed.run.exact_match == whole.run.exact_match
    for a, b in zip(resumed.step.model.parameters(), whole.step.model.parameters()):
        assert torch.equal(a, b)


def test_graph_mode_needs_a_gpu():
    cfg = PhonebookTrainConfig(size=8, lr=1e-3, device="cpu")
    with pytest.raises(ValueError, match="step mode graph captures a CUDA graph: it needs a "
                                         "GPU, the run is on cpu; use eager or auto"):
        PhonebookStep(tiny(), cfg, 1e-3, device=CPU, mode="graph")


def test_the_phonebook_steps_compile_options_are_inductors():
    """The compiled phonebook step's settings exist in this torch's inductor (a rename
    upstream would fail at the first GPU compile instead)."""
    from torch._inductor import config as inductor_config
    for key, value in COMPILE_OPTIONS.items():
        assert hasattr(inductor_config, key), key
        assert isinstance(getattr(inductor_config, key), type(value)), key
