"""AdamW with bf16 moments (optim.moments=bf16, training/optim.py) against torch's AdamW, and
the memory plan printed at start (training/footprint.py): each part's bytes per rank under
DDP, FSDP2 and expert parallelism, and the refusal that names what would shrink it."""
import pytest
import torch

from moremoe.training.footprint import check_fits, memory_plan, shrink_options
from moremoe.training.optim import LowPrecisionAdamW
from moremoe.training.presets import get_preset
from moremoe.training.compose import build_run_config

GIB = 2 ** 30


def _steps(opt_cls, params, grads, **kw):
    ps = [p.clone().requires_grad_() for p in params]
    opt = opt_cls(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def test_low_precision_adamw_is_torchs_update_with_moments_rounded(monkeypatch):
    torch.manual_seed(0)
    params = [torch.randn(50, 30), torch.randn(7), torch.randn(3, 0)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(12)]
    want, _ = _steps(torch.optim.AdamW, params, grads, foreach=False)
    monkeypatch.setattr(LowPrecisionAdamW, "CHUNK", 64)       # slices of a parameter
    exact, _ = _steps(LowPrecisionAdamW, params, grads, moment_dtype=torch.float32)
    for a, b in zip(exact, want):      # the same arithmetic in slices: a few ulps at most
        torch.testing.assert_close(a, b, rtol=4 * 2 ** -23, atol=1e-7)
    low, opt = _steps(LowPrecisionAdamW, params, grads)
    # each update, of about lr, moves by the rounding of m and v (2^-8 relative each)
    for a, b in zip(low, want):
        torch.testing.assert_close(a, b, rtol=0, atol=12 * 1e-2 * 2 ** -7)
    assert not all(torch.equal(a, b) for a, b in zip(low, want))
    state = opt.state[low[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert float(state["step"]) == 12


def test_low_precision_adamw_state_round_trips_in_bf16():
    torch.manual_seed(1)
    params = [torch.randn(4, 5)]
    grads = [[torch.randn(4, 5)] for _ in range(3)]
    ps, opt = _steps(LowPrecisionAdamW, params, grads)
    saved = opt.state_dict()
    again = LowPrecisionAdamW([p.detach().clone().requires_grad_() for p in ps], lr=0.5)
    again.load_state_dict(saved)
    state = next(iter(again.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg"], saved["state"][0]["exp_avg"])
    assert again.param_groups[0]["lr"] == 1e-2 and again.param_groups[0]["weight_decay"] == 0.1


def _plan(preset, world, sets=(), have=80 * GIB):
    cfg = build_run_config(preset=preset, overrides=list(sets))
    return cfg, memory_plan(cfg, cfg.model.transformer_config(), torch.device("cuda", 0),
                            world=world, have=have)


def test_memory_plan_of_more8192_on_two_gpus():
    """MoRE-8192 (7.92B parameters, 7.85B of them experts): 127 GB of fp32 weights, gradients
    and moments on one GPU, half with FSDP2; with expert shards and bf16 moments 12 bytes
    for each of a rank's half of the experts."""
    cfg, one = _plan("h512-s64-more8192", 1, ["optim.moments=fp32"])
    total = cfg.model.transformer_config().total_params()
    assert one.state_bytes() == 16 * total
    _, preset = _plan("h512-s64-more8192", 1)           # the MoRE presets' bf16 moments
    assert preset.state_bytes() == 12 * total
    _, fsdp = _plan("h512-s64-more8192", 2, ["parallel.data=fsdp", "optim.moments=fp32"])
    assert [(p.name, p.share) for p in fsdp.parts] == [("experts", 2), ("the rest", 2)]
    assert fsdp.state_bytes() == sum(16 * (p.params // 2) for p in fsdp.parts)
    _, ep = _plan("h512-s64-more8192", 2, ["parallel.expert=2", "parallel.data=fsdp",
                                          "optim.moments=bf16",
                                          "train.activation_checkpointing=true"])
    experts, rest = ep.parts
    assert (experts.name, experts.params, experts.share) == ("experts", 12 * 8192 * 3 * 512 * 52,
                                                             2)
    assert (rest.name, rest.share) == ("the rest", 2)
    assert ep.state_bytes() == 12 * (experts.params // 2) + 12 * (rest.params // 2)
    assert 40 * GIB < ep.state_bytes() < 46 * GIB
    assert ep.total() < 60 * GIB < one.total()
    text = ep.table()
    assert "1/2 (expert shards)" in text and "1/2 (FSDP2)" in text and "AdamW (bf16)" in text
    with_ac = ep.activations
    _, without = _plan("h512-s64-more8192", 2, ["parallel.expert=2", "optim.moments=bf16"])
    assert without.activations > with_ac + 3 * GIB and without.buffers == 0 < ep.buffers
    # each token's row crosses once per rank holding one of its experts (min(k, E) = 2
    # rows, bf16, sent and received), not once per slot (k = 4)
    _, no_ep = _plan("h512-s64-more8192", 2, ["optim.moments=bf16"])
    assert without.activations - no_ep.activations == 64 * 1024 * 12 * 2 * 2 * 2 * 512


def test_ddp_bf16_reduction_counts_every_buckets_bf16_copy():
    """parallel.reduce_dtype=bf16: 2 bytes a parameter DDP reduces (the whole model; only the
    rest with expert shards), shown as its own row; fp32 reduction and FSDP2 add none."""
    cfg, fp32 = _plan("h512-s64-more1792", 2)
    total = cfg.model.transformer_config().total_params()
    _, bf16 = _plan("h512-s64-more1792", 2, ["parallel.reduce_dtype=bf16"])
    assert fp32.buffers == 0 and bf16.buffers == 2 * total
    assert bf16.total() - fp32.total() == 2 * total             # 3.56 GiB: measured 3.5
    assert "DDP bf16 buckets" in bf16.table() and "FSDP2" not in bf16.table()
    _, ep = _plan("h512-s64-more1792", 2, ["parallel.reduce_dtype=bf16", "parallel.expert=2"])
    experts, rest = ep.parts
    assert ep.buffers == 2 * rest.params
    _, one = _plan("h512-s64-more1792", 1, ["parallel.reduce_dtype=bf16"])
    assert one.buffers == 0 and one.to_dict()["buffers_how"] == ""


def test_a_plan_that_cannot_fit_names_what_would_shrink_it():
    cfg, one = _plan("h512-s64-more8192", 1, ["optim.moments=fp32"])
    gpu = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"need 118.0 GiB on cuda:0, which has 80.0 GiB; make "
                                         r"it smaller .*--set parallel.data=fsdp.*--set "
                                         r"parallel.expert=N.*--set optim.moments=bf16"):
        check_fits(one, 7_918_000_000, gpu, 1, options=shrink_options(cfg, gpu, 1))
    cfg, ep = _plan("h512-s64-more8192", 2, ["parallel.expert=2", "parallel.data=fsdp",
                                            "optim.moments=bf16"])
    check_fits(ep, 7_918_000_000, gpu, 2, options=shrink_options(cfg, gpu, 2))
    assert shrink_options(cfg, gpu, 2) == []
    assert shrink_options(get_preset("tiny-moe"), torch.device("cpu"), 1) == []


def test_the_fused_head_and_loss_drop_the_logits_from_the_plan():
    """train.fused_loss keeps a token's log-sum-exp (4 bytes) instead of its logits, their
    log-probabilities and gradients ((2a + 4) V bytes)."""
    from moremoe.model import TransformerConfig
    from moremoe.nn import MoEConfig
    from moremoe.training.footprint import activation_bytes
    c = TransformerConfig(vocab=50257, layers=2, heads=8, max_seq_len=64,
                          moe=MoEConfig.more(64, 4, 512, 64, 64))
    for a in (2, 4):
        assert (activation_bytes(c, a, 1, False) - activation_bytes(c, a, 1, False,
                                                                    fused_loss=True)
                == (2 * a + 4) * 50257 - 4)


def test_the_plan_counts_the_evaluations_logits_when_they_are_the_larger():
    """With the fused loss the step keeps no logits, but a validation forward of the same
    micro-batch holds them (bf16 on a GPU) and the loss's fp32 chunk: the plan's activations
    are the larger of the two (MoE-256 at 64 sequences: 6.1 GiB of logits)."""
    from moremoe.eval.perplexity import CE_CHUNK
    cfg, plan = _plan("h512-s64-moe256", 1, ["model.layers=1"])
    tokens = 64 * 1024
    assert plan.activations == tokens * 2 * 50257 + 8 * CE_CHUNK
    _, unfused = _plan("h512-s64-moe256", 1, ["model.layers=1", "train.fused_loss=false"])
    assert unfused.activations > tokens * (2 * 2 + 4) * 50257       # the step's, larger
