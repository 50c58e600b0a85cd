"""Checks shared by the router kernel tests: routing invariants and selection against exact
logits, separately from numerics."""
import torch

SKIP_NO_TRITON = "Triton is not installed"


def assert_valid_topk(val, idx, logits64, k, *, tol):
    """Indices in range and distinct, values sorted and equal to the logits they name, and
    every selected logit within tol of the true k-th largest (a valid top-k up to tol)."""
    N, M = logits64.shape
    assert val.shape == idx.shape == (N, k)
    assert val.dtype == torch.float32 and idx.dtype == torch.int32
    if N == 0:
        return
    assert int(idx.min()) >= 0 and int(idx.max()) < M
    assert all(len(set(row)) == k for row in idx.tolist())
    v = val.double()
    assert torch.all(v[:, :-1] >= v[:, 1:])
    gathered = logits64.gather(1, idx.long())
    torch.testing.assert_close(v, gathered, rtol=0, atol=tol)
    kth = logits64.topk(k, dim=1).values[:, -1:]
    assert torch.all(gathered >= kth - tol)


def hostile(x, R1, R2, *, ties, nan, inf):
    """(x, R1, R2) made hostile to a selection: every logit negative (R1 shifted down, x and
    R2 positive), experts `ties` exact copies of expert 7, expert `nan` with a NaN weight and
    expert `inf` with a -inf one (its logits -inf or NaN)."""
    R1 = R1 - 3.0 * R1.abs().max()
    R1[list(ties)] = R1[7].clone()
    R1[nan, 0] = float("nan")
    R1[inf] = 0.0
    R1[inf, 0] = float("-inf")
    return x.abs() + 0.1, R1, R2.abs()


def logits_lowrank(x, R1, R2, *, z_dtype=None):
    """float64 logits from z rounded to the dtype the kernel keeps it in."""
    z = x.double() @ R2.double().T
    if z_dtype is not None and z_dtype != torch.float32:
        z = z.to(z_dtype).double()
    return z @ R1.double().T


def dense_router_grads(a, w, idx, dval, pbar=None):
    """float64 autograd of the router backward's loss for logits a wᵀ: the gathered top-k
    values times dval, plus the softmax column sums times pbar (when given); (da, dw)."""
    a64, w64 = a.double().requires_grad_(), w.double().requires_grad_()
    L = a64 @ w64.T
    loss = (L.gather(1, idx.long()) * dval.double()).sum()
    if pbar is not None:
        loss = loss + (torch.softmax(L, 1).sum(0) * pbar.double()).sum()
    loss.backward()
    return a64.grad, w64.grad
