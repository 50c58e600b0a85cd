"""The one-pass AdamW update (kernels/adamw.py, CPU: Triton interpreter) against the reference
(ops/adamw.py), fp32 and bf16 moments, the clip coefficient folded in, odd sizes."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.ops.adamw import adamw_  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(n, moments, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m = (0.1 * torch.randn(n, generator=g)).to(moments)
    v = (0.01 * torch.rand(n, generator=g)).to(moments)
    return [t.to(DEV) for t in (w, grad, m, v)]


@pytest.mark.parametrize("n", [1, 5, 1023, 2049])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coef", [None, 0.37])
def test_kernel_update_matches_the_reference(n, moments, coef):
    """w within a few fp32 ulps of w and of the step; the moments equal up to one
    rounding of their dtype (the kernel's fp32 expression may round differently by an ulp
    before the cast)."""
    c = None if coef is None else torch.tensor(coef, device=DEV)
    got, want = _state(n, moments), _state(n, moments)
    w0 = got[0].clone()
    # bf16 moments: one step (a rounding that differs feeds the next step's inputs)
    for step in ((1,) if moments == torch.bfloat16 else (1, 2, 3)):
        adamw_(*got, step=step, coef=c, impl="triton", **HP)
        adamw_(*want, step=step, coef=c, impl="reference", **HP)
    assert not torch.equal(got[0], w0)
    # bf16 moments: neighbouring roundings move a step (at most lr / (1 - β1)) by 2^-7
    step_tol = 2 ** -7 if moments == torch.bfloat16 else 16 * 2 ** -23
    torch.testing.assert_close(got[0], want[0], rtol=3 * 2 ** -23,
                               atol=step_tol * HP["lr"] / (1 - 0.9))
    ulp = 2 ** -7 if moments == torch.bfloat16 else 2 ** -23
    g = got[1].abs().max().item() * (coef or 1)
    for a, b, scale in zip(got[2:], want[2:], (g, g * g)):
        assert a.dtype == moments
        torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=8 * 2 ** -23 * scale)


def test_the_gradient_is_read_not_written_and_empty_is_a_no_op():
    w, g, m, v = _state(100, torch.bfloat16)
    g0 = g.clone()
    adamw_(w, g, m, v, step=1, coef=torch.tensor(0.5, device=DEV), impl="triton", **HP)
    assert torch.equal(g, g0)
    empty = [t[:0] for t in (w, g, m, v)]
    adamw_(*empty, step=1, impl="triton", **HP)


def test_reference_equals_torchs_adamw_with_the_clip():
    """The reference is torch's AdamW (fp32) on the gradient times the coefficient."""
    w, g, m, v = _state(37, torch.float32)
    m.zero_(), v.zero_()
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    for step in (1, 2):
        p.grad = g * 0.25
        opt.step()
        adamw_(w, g, m, v, step=step, coef=torch.tensor(0.25, device=DEV),
               impl="reference", **HP)
    torch.testing.assert_close(w, p.detach(), rtol=4 * 2 ** -23, atol=1e-7)


def test_bad_inputs_are_refused():
    w, g, m, v = _state(8, torch.float32)
    with pytest.raises(ValueError, match="g must be contiguous, of w's shape"):
        adamw_(w, g[:4], m, v, step=1, impl="triton", **HP)
    with pytest.raises(TypeError, match="w must be float32"):
        adamw_(w.half(), g, m, v, step=1, impl="triton", **HP)
