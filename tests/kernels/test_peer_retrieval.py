"""PEER's retrieval kernel against the naive top κ over all R² scores (CPU: Triton
interpreter): the chosen set (rows without a near-tie at the κ-th place, which the kernel
may rank either way: kernels/peer_retrieval.py, "Selection semantics"), the scores exact for
the ids returned, odd sizes (NH = 1, 37; R = 9, 13, 23; d_q/2 = 3, 6, 16), κ = 1 … R, fp16 (and bf16 on a GPU),
the gradients of q and the keys against the torch path, NH = 0 and the op's dispatch."""
import math

import pytest
import torch

pytest.importorskip("triton")
kr = pytest.importorskip("moremoe.kernels.peer_retrieval")
from moremoe.ops.peer_retrieval import peer_retrieval, peer_retrieval_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(NH, R, D, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(NH, 2 * D, generator=g).to(dtype)
    keys = torch.randn(2, R, D, generator=g).to(dtype)
    return q.to(DEV), keys.to(DEV)


def full_scores(q, keys):
    """(NH, R²) float64 of every expert a R + b."""
    D = keys.shape[2]
    qd, kd = q.double(), keys.double()
    return ((qd[:, :D] @ kd[0].T)[:, :, None] + (qd[:, D:] @ kd[1].T)[:, None, :]).flatten(1)


def check_selection(q, keys, kappa, scores, ids):
    full = full_scores(q, keys)
    R2 = full.shape[1]
    assert ids.shape == scores.shape == (q.shape[0], kappa)
    assert ((ids >= 0) & (ids < R2)).all()
    assert all(len(set(r.tolist())) == kappa for r in ids)              # distinct a row
    exact = full.gather(1, ids.long())
    scale = full.abs().amax(1, keepdim=True)
    # the scores are those of the ids returned (fp32 sums of D products)
    torch.testing.assert_close(scores.double(), exact, atol=1e-5 * scale.max().item(), rtol=0)
    # the chosen set: that of the naive top κ wherever the κ-th place is not a near-tie
    top = full.topk(min(kappa + 1, R2), dim=1)
    tie_tol = 2.0 ** -11 * scale[:, 0]
    gap = (top.values[:, kappa - 1] - top.values[:, kappa] if kappa < R2
           else torch.full_like(scale[:, 0], math.inf))
    clear = gap > tie_tol
    assert clear.float().mean() > 0.25                     # enough rows to compare
    want = top.indices[:, :kappa].sort(1).values
    assert torch.equal(ids.long().sort(1).values[clear], want[clear])
    # and everywhere its values: sorted, within the near-tie tolerance
    got = exact.sort(1, descending=True).values
    assert ((got - top.values[:, :kappa]).abs() <= tie_tol[:, None]).all()


@pytest.mark.parametrize("NH,R,D,kappa", [(1, 9, 4, 1), (37, 13, 6, 5), (17, 23, 16, 9),
                                          (21, 10, 3, 10), (33, 16, 8, 4)])
def test_kernel_finds_the_top_kappa_of_all_scores(NH, R, D, kappa):
    q, keys = make(NH, R, D, seed=NH)
    scores, ids = kr.retrieve(q, keys, kappa)
    check_selection(q, keys, kappa, scores, ids)


HALF = [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", HALF)
def test_half_scores_are_fp32_sums_of_the_half_products(dtype):
    """bf16 on the GPU only: Triton's CPU interpreter (3.9) returns garbage from a bf16
    tl.dot (fp16 and fp32 are right), the MMA path it stands for."""
    q, keys = make(29, 19, 16, dtype=dtype, seed=3)
    scores, ids = kr.retrieve(q, keys, 7)
    check_selection(q, keys, 7, scores, ids)


def test_gradients_of_q_and_keys_equal_the_torch_path():
    """A loss weighting each winner by its expert (independent of the order within a row):
    d q and d keys against peer_retrieval_ref in float64 on the same selection."""
    torch.manual_seed(0)
    q, keys = make(24, 11, 5, seed=7)
    w = torch.randn(11 * 11, device=DEV, dtype=torch.float64)
    grads = []
    for impl, dt in (("triton", torch.float32), ("reference", torch.float64)):
        ql = q.view(8, 3, 10).to(dt).clone().requires_grad_()
        kl = keys.to(dt).clone().requires_grad_()
        scores, ids = peer_retrieval(ql, kl, 6, impl=impl)
        (scores.double() * w[ids]).sum().backward()
        grads.append((ids.sort(-1).values, ql.grad.double(), kl.grad.double()))
    (ia, dqa, dka), (ib, dqb, dkb) = grads
    assert torch.equal(ia, ib)
    torch.testing.assert_close(dqa, dqb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dka, dkb, atol=1e-5, rtol=1e-5)


def test_no_rows_and_the_dispatch():
    q, keys = make(0, 9, 4)
    scores, ids = kr.retrieve(q, keys, 3)
    assert scores.shape == ids.shape == (0, 3)
    big = torch.zeros(2, kr.PEER_MAX_KEYS + 1, 4, device=DEV)
    qq = torch.zeros(2, 1, 8, device=DEV)
    with pytest.raises(ValueError, match=r"holds R <= 1024 keys a table.*impl='auto'"):
        peer_retrieval(qq, big, 2, impl="triton")
    s_auto, _ = peer_retrieval(qq, big, 2, impl="auto")         # the torch path
    assert s_auto.shape == (2, 1, 2)
    with pytest.raises(ValueError, match=r"kappa must be in \[1, R=9\], got 10"):
        peer_retrieval(torch.zeros(1, 1, 8, device=DEV), keys, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kappa", [56, 4])
@pytest.mark.parametrize("blocks", [None, {"BT": 32, "num_warps": 8}])
def test_paper_size_on_the_gpu(kappa, blocks):
    """The paper's PEER-388² (d_q = 32, κ = 56 and 4) in bf16, 2,048 rows, the kernel's
    blocks and a larger tile; run twice, the same bits."""
    q, keys = make(2048, 388, 16, dtype=torch.bfloat16, seed=kappa)
    scores, ids = kr.retrieve(q, keys, kappa, blocks=blocks)
    check_selection(q, keys, kappa, scores, ids)
    again = kr.retrieve(q, keys, kappa, blocks=blocks)
    assert torch.equal(ids, again[1]) and torch.equal(scores, again[0])


def test_custom_op_passes_opcheck_and_torch_compile_traces_the_layer():
    """Schema, fake tensors, autograd registration; then a PEER layer (both fused ops)
    through torch.compile (aot_eager, one graph) equals eager, output and gradients."""
    from dataclasses import replace
    from moremoe.nn.peer import PEERConfig, PEERLayer
    from moremoe.ops import peer_retrieval as opr
    q, keys = make(12, 9, 4, seed=5)
    torch.library.opcheck(opr.fwd_op, (q.requires_grad_(), keys.requires_grad_(), 3))
    torch.manual_seed(0)
    layer = PEERLayer(PEERConfig(experts=81, hidden=16, heads=2, d_q=8, kappa=3)).to(DEV)
    layer.config = replace(layer.config, impl="triton")
    x = torch.randn(7, 16, device=DEV)

    def step(x_):
        return layer(x_).y.square().sum()

    eager = step(x)
    eager_grads = torch.autograd.grad(eager, list(layer.parameters()))
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    got_grads = torch.autograd.grad(got, list(layer.parameters()))
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, b)
