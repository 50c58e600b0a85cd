"""clipped_step (training/optim.py): the global-norm clip read by the update itself, equal to
torch's clip_grad_norm_ followed by the step, with no multiply pass over the gradients where
the optimizer takes the coefficient (LowPrecisionAdamW, torch's fused AdamW)."""
import pytest
import torch

from moremoe.training.optim import LowPrecisionAdamW, clipped_step

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _run(make, max_norm, *, clip_first, steps=3):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s)) for s in ((13, 7), (5,), (3, 0))]
    grads = [[3 * torch.randn_like(p) for p in ps] for _ in range(steps)]
    opt, lists = make(ps), []
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        live = [p.grad for p in ps]
        lists.append(live)
        if clip_first:
            torch.nn.utils.clip_grad_norm_(ps, max_norm)
            opt.step()
        else:
            clipped_step(opt, live, torch.nn.utils.get_total_norm(live), max_norm)
    return [p.detach() for p in ps], lists


MAKERS = {"foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **KW),
          "fused": lambda ps: torch.optim.AdamW(ps, fused=True, **KW),
          "bf16": lambda ps: LowPrecisionAdamW(ps, **KW),
          "fp32": lambda ps: LowPrecisionAdamW(ps, moment_dtype=torch.float32, **KW)}


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("max_norm", [1.0, 1e9, float("inf")])
def test_clipped_step_equals_clip_then_step(kind, max_norm, monkeypatch):
    """Bit for bit where the multiply is the same (foreach); within a few fp32 ulps where the
    update divides by 1 / coefficient (fused) or multiplies in its own pass; no
    _foreach_mul_ over the gradients where the update takes the coefficient."""
    want, _ = _run(MAKERS[kind], max_norm, clip_first=True)
    seen, real = [], torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: seen.append(a[0]) or real(*a))
    got, lists = _run(MAKERS[kind], max_norm, clip_first=False)
    muls = [1 for x in seen if any(all(a is b for a, b in zip(x, live)) for live in lists)]
    for a, b in zip(got, want):
        if kind == "foreach":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=4 * 2 ** -23, atol=16 * 2 ** -23 * KW["lr"])
    assert muls == ([1, 1, 1] if kind == "foreach" and max_norm < float("inf") else [])
