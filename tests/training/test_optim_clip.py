"""clipped_step (training/optim.py): the global-norm clip read by the update itself, equal to
torch's clip_grad_norm_ followed by the step, with no multiply pass over the gradients where
the optimizer takes the coefficient (LowPrecisionAdamW, torch's fused AdamW)."""
import pytest
import torch

from moremoe.training.optim import LowPrecisionAdamW, SplitAdamW, clipped_step

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
          "fp32": lambda ps: LowPrecisionAdamW(ps, moment_dtype=torch.float32, **KW),
          # the (13, 7) tensor by the one-pass update, the others by torch's fused AdamW
          "split": lambda ps: type("Split", (SplitAdamW,), {"BIG": 50})(ps, **KW)}


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


def test_the_split_update_is_torchs_fused_adamw_and_shares_its_checkpoints():
    """SplitAdamW (large tensors by the one-pass update) against torch's fused AdamW over
    three clipped steps: the same weights within fp32's rounding of one update's arithmetic,
    the same state keys; a checkpoint of either continues in the other."""
    def big(ps):
        return type("Split", (SplitAdamW,), {"BIG": 50})(ps, **KW)

    def fused(ps):
        return torch.optim.AdamW(ps, fused=True, **KW)
    tol = dict(rtol=4 * 2 ** -23, atol=16 * 2 ** -23 * KW["lr"])
    for first, second in ((big, fused), (fused, big)):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*s)) for s in ((13, 7), (5,))]
        ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        a, b = first(ps), fused(ref)
        for step in range(5):
            if step == 3:                      # the checkpoint changes hands
                state = a.state_dict()
                assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
                a = second(ps)
                a.load_state_dict(state)
            gs = [3 * torch.randn_like(p) for p in ps]
            for opt, params in ((a, ps), (b, ref)):
                for p, g in zip(params, gs):
                    p.grad = g.clone()
                live = [p.grad for p in params]
                clipped_step(opt, live, torch.nn.utils.get_total_norm(live), 1.0)
        for p, q in zip(ps, ref):
            torch.testing.assert_close(p.detach(), q.detach(), **tol)


def test_make_optimizer_takes_the_split_update_for_fused_fp32_moments():
    from moremoe.model import Transformer, TransformerConfig
    from moremoe.nn import MoEConfig
    from moremoe.training.config import RunConfig
    from moremoe.training.optim import make_optimizer
    model = Transformer(TransformerConfig(vocab=50, layers=1, heads=2, max_seq_len=8,
                                          moe=MoEConfig.moe(4, 2, 16, 8)))
    kinds = {(fused, update, cap): type(make_optimizer(model, lr=1e-3, fused=fused,
                                                       update=update, capturable=cap))
             for fused in (True, False) for update in ("auto", "fused") for cap in (False,)}
    assert kinds[True, "auto", False] is SplitAdamW
    assert kinds[True, "fused", False] is torch.optim.AdamW
    assert kinds[False, "auto", False] is torch.optim.AdamW
    assert type(make_optimizer(model, lr=1e-3, fused=True, capturable=True)) is \
        torch.optim.AdamW                      # a captured step keeps torch's (device lr)
    assert type(make_optimizer(model, lr=1e-3, fused=True, moments="bf16")) is \
        LowPrecisionAdamW
    with pytest.raises(ValueError, match="optim.update must be one of auto, fused, got 'x'"):
        RunConfig.from_dict({"optim": {"update": "x"}})
