"""parallel/ddp.py's wrap on one gloo process (a group of one: DDP's bucketing, views and
comm hook run as on several ranks, and the mean over one rank is the gradient itself)."""
import pytest
import torch
import torch.distributed as dist

from moremoe.parallel import ddp
from moremoe.parallel.ddp import DistInfo

ENABLED = DistInfo(rank=0, world=2, local_rank=0, device=torch.device("cpu"))  # wrap, not skip


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))


def _backward(module, x):
    module(x).square().sum().backward()


def test_kept_gradients_are_views_of_the_buckets_from_the_start(group_of_one):
    """keep_grads (CUDA graphs): every gradient exists before the first backward and is a view
    of DDP's bucket, which an accumulation micro-step (no_sync) and the synced one add into
    and the all-reduce neither copies nor replaces; without it the gradients are left to
    autograd (None until a backward)."""
    x = torch.randn(5, 8)
    ref = _model()
    _backward(ref, x)
    model = _model()
    wrapped = ddp.wrap(model, ENABLED, keep_grads=True)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1      # one bucket
    with wrapped.no_sync():                       # an accumulation micro-step, then the last
        _backward(wrapped, x)
    _backward(wrapped, x)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))    # accumulated in place
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * r.grad)
    assert all(p.grad is None for p in ddp.wrap(_model(), ENABLED).module.parameters())


def test_bf16_all_reduce_rounds_the_mean_to_bf16(group_of_one):
    """reduce_dtype=bf16: the reduced gradient is the fp32 mean rounded to bf16 and kept in
    the fp32 gradient (over one rank: the gradient rounded), with small buckets (several
    hook calls)."""
    x = torch.randn(5, 8)
    ref = _model()
    _backward(ref, x)
    model = _model()
    _backward(ddp.wrap(model, ENABLED, reduce_dtype="bf16", bucket_mb=1e-4), x)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, r.grad.bfloat16().float())
        assert not torch.equal(p.grad, r.grad)


def test_wrapping_warns_nothing_a_user_cannot_act_on(group_of_one):
    """DDP's FutureWarning about broadcast_buffers (torch 2.13 renamed it
    forward_sync_buffers): wrap names whichever this torch takes, so no warning is left."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapped = ddp.wrap(_model(), ENABLED)
        _backward(wrapped, torch.randn(3, 8))
    told = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)
            or "buffers" in str(w.message)]
    assert told == []
