"""BankSync (training/bank_sync.py): under DDP the in-place expert banks' gradients are
all-reduced as soon as each layer's backward has produced them (the router's hook), only in
the last micro-step, and divided by the ranks at the end (one gloo rank here: the launch
order and the arithmetic; two ranks against one process: tests/training/test_ddp.py)."""
import socket

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")
from moremoe.nn import MoEConfig, MoELayer  # noqa: E402
from moremoe.parallel.ddp import DistInfo  # noqa: E402
from moremoe.training.bank_sync import BankSync  # noqa: E402


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield DistInfo(0, 1, 0, torch.device("cpu"))
    dist.destroy_process_group()


def test_each_banks_all_reduce_starts_in_the_backward_of_the_last_micro_step(one_rank):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        MoELayer(MoEConfig.more(6, 2, 16, 8, 4, experts_impl="triton")) for _ in range(2))
    banks = [layer.experts for layer in layers]
    for bank in banks:
        bank.accumulate_grads_in_place()
    sync = BankSync(layers, banks, one_rank)
    seen = []

    def step(last):
        sync.arm(last)
        x = torch.randn(5, 16, requires_grad=True)
        h = x
        for layer in layers:
            h = layer(h).y
        h.square().sum().backward()
        seen.append(set(sync.works))
    step(False)
    step(True)
    assert seen == [set(), {id(b) for b in banks}]   # launched by the hooks, not by finish
    want = [w.grad.clone() for b in banks for w in b.weights()]
    sync.finish()
    assert sync.works == {} and not sync.armed
    for got, w in zip((w.grad for b in banks for w in b.weights()), want):
        assert torch.equal(got, w)                    # one rank: the sum divided by 1
