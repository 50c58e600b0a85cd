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
    split = make_optimizer(model, lr=1e-3, fused=True, moments="bf16")
    assert type(split) is SplitAdamW and split.big_moments == torch.bfloat16
    for kw in (dict(fused=False), dict(fused=True, update="fused"),
               dict(fused=True, capturable=True), dict(fused=True, grads="bf16")):
        assert type(make_optimizer(model, lr=1e-3, moments="bf16", **kw)) is LowPrecisionAdamW
    with pytest.raises(ValueError, match="optim.update must be one of auto, fused, got 'x'"):
        RunConfig.from_dict({"optim": {"update": "x"}})


def test_the_split_update_with_bf16_moments_is_low_precision_for_the_large_tensors():
    """optim.moments=bf16 on a GPU: the large tensor's update is LowPrecisionAdamW's (bf16
    moments, the same one-pass arithmetic), the small one's torch's fused AdamW (fp32
    moments); its checkpoint goes on in itself bit for bit, and into LowPrecisionAdamW and
    the fp32 split with each moment cast to the new owner's dtype."""
    def split(ps, big=torch.bfloat16):
        return type("Split", (SplitAdamW,), {"BIG": 50})(ps, big_moments=big, **KW)

    def run(opt, ps, grads):
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            live = [p.grad for p in ps]
            clipped_step(opt, live, torch.nn.utils.get_total_norm(live), 1.0)
        return opt
    torch.manual_seed(0)
    shapes = ((13, 7), (5,))                     # 91 elements (>= BIG) and 5
    init = [torch.randn(*s) for s in shapes]
    grads = [[3 * torch.randn(*s) for s in shapes] for _ in range(6)]

    def fresh():
        return [torch.nn.Parameter(t.clone()) for t in init]
    got = fresh()
    opt = run(split(got), got, grads)
    big, small = (opt.state[p] for p in got)
    assert big["exp_avg"].dtype == big["exp_avg_sq"].dtype == torch.bfloat16
    assert small["exp_avg"].dtype == small["exp_avg_sq"].dtype == torch.float32
    low, fused = fresh(), fresh()
    run(LowPrecisionAdamW(low, **KW), low, grads)
    run(torch.optim.AdamW(fused, fused=True, **KW), fused, grads)
    tol = dict(rtol=4 * 2 ** -23, atol=16 * 2 ** -23 * KW["lr"])
    torch.testing.assert_close(got[0].detach(), low[0].detach(), **tol)
    torch.testing.assert_close(got[1].detach(), fused[1].detach(), **tol)
    for make, dtypes in ((split, (torch.bfloat16, torch.float32)),
                         (lambda q: LowPrecisionAdamW(q, **KW), (torch.bfloat16,) * 2),
                         (lambda q: split(q, torch.float32), (torch.float32,) * 2)):
        part = fresh()
        first = run(split(part), part, grads[:3])
        again = make(part)
        again.load_state_dict(first.state_dict())
        assert [again.state[p]["exp_avg"].dtype for p in part] == list(dtypes)
        run(again, part, grads[3:])
        for a, b in zip(part, got):
            if make is split:                        # the same class: bit for bit
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)
