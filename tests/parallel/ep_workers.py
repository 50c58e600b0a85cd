"""The checks each gloo rank runs for tests/parallel/test_expert_parallel.py: one spawn per
world size, every check inside it. Each check builds the single-process MoELayer from one
seed on every rank, runs it on the global batch, shards it, runs the shards on the same
inputs and compares outputs, routing (indices exactly) and every gradient. A check's
collectives all happen before its comparisons, so a failed comparison on one rank leaves
the ranks in step for the next check."""
import copy
import json
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moremoe.nn import MoEConfig, MoELayer
from moremoe.parallel.expert import ExpertParallelMoE, shard_moe_layer
from moremoe.parallel.sharded_router import ShardedRouter
from numerics import reduction_tol

H, S, R, M, K = 16, 8, 4, 8, 3      # k = 3 > M/E = 2 experts per rank at E = 4


def configs():
    kw = dict(init_std=0.3, balance_coef=0.5)
    return {"moe": MoEConfig.moe(M, K, H, S, **kw), "more": MoEConfig.more(M, K, H, S, R, **kw)}


def tol(n_tokens):
    return reduction_tol(torch.float32, n_tokens + H + S + M)


def close(got, want, n_tokens, what):
    torch.testing.assert_close(got, want, **tol(n_tokens), msg=lambda m: f"{what}: {m}")


def build(cfg, seed=0, cold_last_rank=False, world=1):
    """The single-process layer; cold_last_rank: no token ever picks the experts of the
    last rank, nor expert 1 (a constant input feature scores them −10 each)."""
    torch.manual_seed(seed)
    layer = MoELayer(cfg).train()
    if cold_last_rank:
        cold = list(range(M - M // world, M)) + [1]
        with torch.no_grad():
            r = layer.router
            w = r.R1 if cfg.is_lowrank else r.weight
            w[:, 0] = 0.0
            w[cold, 0] = -10.0
            if cfg.is_lowrank:
                r.R2[0] = 0.0
                r.R2[0, 0] = 1.0
    return layer


def inputs(n, seed=1, cold=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    if cold:
        x[:, 0] = 3.0
    return x, torch.randn(n, H, generator=g)


def grad_of(p):
    """A gradient, zeros for a tensor nothing reached (one process on an empty batch)."""
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()


def run_single(layer, x, wy, aux_weight=1.0):
    layer.zero_grad(set_to_none=True)           # a layer may serve several comparisons
    x = x.clone().requires_grad_()
    out = layer(x)
    out.router.gates.retain_grad()
    ((out.y * wy).sum() + aux_weight * out.aux_loss).backward()
    out.router.gates.grad = grad_of(out.router.gates)
    return out, grad_of(x), {n: grad_of(p) for n, p in layer.named_parameters()}


def run_shard(ep, x, wy):
    x = x.clone().requires_grad_()
    out = ep(x)
    out.router.gates.retain_grad()
    ((out.y * wy).sum() + out.aux_loss).backward()
    out.router.gates.grad = grad_of(out.router.gates)
    return out, grad_of(x)


def case(cfg, world, n=13, seed=0, cold=False):
    """(layer, x, wy): the single-process layer and a global batch of n tokens."""
    layer = build(cfg, seed, cold_last_rank=cold, world=world)
    return (layer, *inputs(n, seed + 1, cold))


def close_bf16(got, want, world, what):
    """bf16 against one bf16 process: the ranks' partial sums add one rounding each, so
    the tolerance is that of a world-term reduction in bf16, relative to the largest
    value (tests/numerics.py)."""
    tol = reduction_tol(torch.bfloat16, world)["rtol"]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                               atol=tol * float(want.float().abs().max()) if want.numel() else tol,
                               msg=lambda m: f"{what} (bf16): {m}")


def compare_param_grads(ep, ref_grads, n_tokens, scale=1.0, check=None):
    sharded = ep.sharded_names()
    for name, p in ep.named_parameters():
        want = ref_grads[name][ep.lo:ep.hi] if name in sharded else ref_grads[name]
        assert p.dtype == want.dtype, f"{name}: {p.dtype}, one process's {want.dtype}"
        (check or close)(grad_of(p), want * scale, n_tokens, f"grad {name}")


def _checker(dtype, world):
    if dtype == torch.bfloat16:
        return lambda got, want, _n, what: close_bf16(got, want, world, what)
    return close


def compare_replicated(layer, x, wy, shard_router=False, chunks=4):
    """(a): the whole batch on every rank against one process (in the layer's dtype)."""
    n, dtype = x.shape[0], next(layer.parameters()).dtype
    check = _checker(dtype, dist.get_world_size())
    ref, ref_dx, ref_grads = run_single(layer, x, wy)
    ep = shard_moe_layer(layer, tokens="replicated", shard_router=shard_router,
                         chunks=chunks).train()
    out, dx = run_shard(ep, x, wy)
    assert torch.equal(out.router.topk_idx, ref.router.topk_idx), "topk_idx"
    assert torch.equal(out.counts, ref.counts), "counts"
    assert out.y.dtype == ref.y.dtype == x.dtype, (out.y.dtype, ref.y.dtype)
    for what, got, want in [("y", out.y, ref.y), ("switch", out.switch_loss, ref.switch_loss),
                            ("aux", out.aux_loss, ref.aux_loss),
                            ("topk_val", out.router.topk_val, ref.router.topk_val),
                            ("gates", out.router.gates, ref.router.gates),
                            ("psum", out.router.psum, ref.router.psum), ("dx", dx, ref_dx),
                            ("dgates", out.router.gates.grad, ref.router.gates.grad)]:
        check(got, want, n, what)
    compare_param_grads(ep, ref_grads, n, check=check)
    return ep


def compare_local(layer, x, wy, rank, world, sizes, chunks=4):
    """(b): rank e holds rows [off_e, off_e + sizes[e]) of the global batch. Each rank's
    backward gives its share of the gradient of S = Σ_e loss_e = (y · wy).sum() + E · aux;
    after sync_gradients every parameter holds one process's gradient of S / E."""
    n, dtype = x.shape[0], next(layer.parameters()).dtype
    check = _checker(dtype, world)
    ref, ref_dx, ref_grads = run_single(layer, x, wy, aux_weight=world)
    ep = shard_moe_layer(layer, tokens="local", chunks=chunks).train()
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    out, dx = run_shard(ep, x[rows], wy[rows])
    ep.sync_gradients()
    assert torch.equal(out.router.topk_idx, ref.router.topk_idx[rows]), "topk_idx"
    assert torch.equal(out.counts, ref.counts), "counts"
    assert out.y.dtype == x.dtype, out.y.dtype
    for what, got, want in [("y", out.y, ref.y[rows]),
                            ("switch", out.switch_loss, ref.switch_loss),
                            ("aux", out.aux_loss, ref.aux_loss), ("dx", dx, ref_dx[rows]),
                            ("dgates", out.router.gates.grad, ref.router.gates.grad[rows])]:
        check(got, want, n, what)
    compare_param_grads(ep, ref_grads, n, scale=1.0 / world, check=check)


def check_replicated_router(rank, world):
    for cfg in configs().values():
        compare_replicated(*case(cfg, world))


def check_sharded_router(rank, world):
    for cfg in configs().values():
        compare_replicated(*case(cfg, world, n=17, seed=3), shard_router=True)


def check_local_uneven(rank, world):
    sizes = {2: [7, 12], 4: [2, 7, 4, 6]}[world]
    for cfg in configs().values():
        compare_local(*case(cfg, world, n=sum(sizes)), rank, world, sizes)


def check_local_rank_without_tokens_and_cold_experts(rank, world):
    """A rank that routes no tokens, and the last rank receiving no pairs."""
    sizes = {2: [0, 13], 4: [5, 0, 9, 3]}[world]
    for cfg in configs().values():
        compare_local(*case(cfg, world, n=sum(sizes), seed=5, cold=True), rank, world, sizes)


def check_replicated_cold_experts(rank, world):
    """Expert 1 and the whole last rank get no pairs (that rank runs no expert)."""
    cfgs = configs()
    ep = compare_replicated(*case(cfgs["moe"], world, seed=7, cold=True))
    compare_replicated(*case(cfgs["more"], world, seed=7, cold=True), shard_router=True)
    if rank == world - 1:
        assert all(float(p.grad.abs().max()) == 0 for p in ep.experts.parameters())


def check_empty_batch(rank, world):
    for cfg in configs().values():
        compare_replicated(*case(cfg, world, n=0))
        compare_replicated(*case(cfg, world, n=0), shard_router=True)
        compare_local(*case(cfg, world, n=0), rank, world, [0] * world)


def integer_case(cfg, world, n=24, seed=9):
    """Router weights and inputs of small integers, so every logit is exact, and the last
    M/2 experts repeat the first M/2's rows: exact ties everywhere, across shards too."""
    layer, _, wy = case(cfg, world, n=n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r = layer.router
        if cfg.is_lowrank:
            sparse = torch.rand(R, H, generator=g) < 0.2
            r.R2.copy_(torch.randint(-1, 2, (R, H), generator=g) * sparse)
        w = r.R1 if cfg.is_lowrank else r.weight
        rows = torch.randint(-1, 2, (M // 2, w.shape[1]), generator=g).float()
        w.copy_(torch.cat([rows, rows]))
    x = torch.randint(-1, 2, (n, H), generator=g).float()
    return layer, x, wy


def ties_across_shards(layer, x, world):
    """Rows where a selected and an unselected expert of equal logit sit on two shards."""
    with torch.no_grad():
        r = layer.router
        logits = x @ r.weight.T if hasattr(r, "weight") else (x @ r.R2.T) @ r.R1.T
        idx = r(x).topk_idx.long()
    shard = torch.arange(M) // (M // world)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, True)
    kth = logits.gather(1, idx[:, -1:])
    count = 0
    for row in range(x.shape[0]):
        tied = logits[row] == kth[row]
        a, b = shard[tied & chosen[row]], shard[tied & ~chosen[row]]
        count += int(len(a) > 0 and len(b) > 0 and bool((a[:, None] != b[None, :]).any()))
    return count


def check_exact_ties_in_the_merge(rank, world):
    for cfg in configs().values():
        layer, x, wy = integer_case(cfg, world)
        assert ties_across_shards(layer, x, world) > 0, "the case has no tie across shards"
        compare_replicated(layer, x, wy, shard_router=True)


def check_standalone_sharded_router(rank, world):
    """ShardedRouter.forward (its own lse sum) against the full router: values, gates and
    psum through one loss, every gradient."""
    for cfg in configs().values():
        layer, x, _ = case(cfg, world, n=11, seed=11)
        g = torch.Generator().manual_seed(12)
        v_val, v_gate, v_psum = torch.randn(11, K, generator=g), torch.randn(11, K, generator=g), \
            torch.randn(M, generator=g)
        runs = []
        for router in (layer.router, ShardedRouter.from_router(layer.router, cfg).train()):
            xg = x.clone().requires_grad_()
            out = router(xg)
            ((out.topk_val * v_val).sum() + (out.gates * v_gate).sum()
             + (out.psum * v_psum).sum()).backward()
            runs.append((out, xg.grad, {n: p.grad for n, p in router.named_parameters()}))
        (ref, ref_dx, ref_grads), (out, dx, grads) = runs
        assert torch.equal(out.topk_idx, ref.topk_idx) and torch.equal(out.counts, ref.counts)
        for what, a, b in [("val", out.topk_val, ref.topk_val), ("gates", out.gates, ref.gates),
                           ("psum", out.psum, ref.psum), ("dx", dx, ref_dx)]:
            close(a, b, 11, what)
        lo, hi = rank * M // world, (rank + 1) * M // world
        for name, grad in grads.items():
            want = ref_grads[name][lo:hi] if name in ("weight", "R1") else ref_grads[name]
            close(grad, want, 11, f"grad {name}")


def check_eval_mode(rank, world):
    """No balancing statistics in eval; return_counts gives the global counts."""
    sizes = {2: [3, 6], 4: [3, 0, 4, 2]}[world]
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    for cfg in configs().values():
        layer, x, _ = case(cfg, world, n=sum(sizes), seed=13)
        layer.eval()
        with torch.no_grad():
            ref = layer(x, return_counts=True)
            a = shard_moe_layer(layer, shard_router=True).eval()(x)
            b = shard_moe_layer(layer, tokens="local").eval()(x[rows], return_counts=True)
        assert a.aux_loss is None and a.counts is None and b.aux_loss is None
        assert torch.equal(b.counts, ref.counts)
        close(a.y, ref.y, x.shape[0], "y (a)")
        close(b.y, ref.y[rows], x.shape[0], "y (b)")


def check_state_round_trip(rank, world):
    """full_state_dict is the single-process layer's, exactly; a wrong state is refused."""
    for name, sharded in [("moe", False), ("more", True), ("more", False)]:
        cfg = configs()[name]
        layer = build(cfg, seed=15)
        ep = shard_moe_layer(layer, shard_router=sharded)
        full, want = ep.full_state_dict(), layer.state_dict()
        assert list(full) == list(want)
        assert all(torch.equal(full[k], want[k]) for k in want)
        MoELayer(cfg).load_state_dict(full)
        other = MoELayer(MoEConfig.moe(2 * M, K, H, S)).state_dict()
        with pytest.raises(ValueError, match=r"state\['router.weight'\] has shape \(16, 16\)"):
            ExpertParallelMoE(configs()["moe"]).load_full_state_dict(other)


def check_construction_errors(rank, world):
    bad = MoEConfig.moe(2 * world + 1, 2, H, S)
    with pytest.raises(ValueError, match=f"M={2 * world + 1} .*E={world}"):
        ExpertParallelMoE(bad)
    with pytest.raises(ValueError, match="shard_router=True needs tokens='replicated'"):
        ExpertParallelMoE(configs()["moe"], tokens="local", shard_router=True)


def check_broadcast_replicated(rank, world):
    """A layer built per rank from different draws holds rank 0's router after the broadcast,
    its own experts."""
    torch.manual_seed(100 + rank)
    ep = ExpertParallelMoE(configs()["more"], shard_router=True)
    ep.broadcast_replicated()
    parts = [torch.empty_like(ep.router.R2) for _ in range(world)]
    dist.all_gather(parts, ep.router.R2.detach())
    assert all(torch.equal(p, parts[0]) for p in parts)


def check_bf16_every_flow(rank, world):
    """bf16 weights and inputs (the sharded router included, which failed on bf16
    weights), uneven ranks and one without tokens: equal to one bf16 process."""
    sizes = {2: [0, 17], 4: [6, 0, 4, 7]}[world]
    for cfg in configs().values():
        layer, x, wy = case(cfg, world, n=17, seed=3)
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
        compare_replicated(layer, x, wy)
        compare_replicated(layer, x, wy, shard_router=True)
        compare_local(layer, x, wy, rank, world, sizes)


def check_bf16_sharded_router_inference(rank, world):
    """The sharded router on bf16 weights in eval mode, and under autocast on fp32 ones."""
    for cfg in configs().values():
        layer, x, _ = case(cfg, world, n=9, seed=21)
        low = copy.deepcopy(layer).to(torch.bfloat16).eval()
        with torch.no_grad():
            want = low(x.bfloat16())
            got = shard_moe_layer(low, shard_router=True).eval()(x.bfloat16())
            assert torch.equal(got.router.topk_idx, want.router.topk_idx)
            close_bf16(got.y, want.y, world, "y")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = shard_moe_layer(layer.eval(), shard_router=True).eval()(x)
            assert auto.y.dtype == torch.float32
            assert torch.equal(auto.router.topk_idx, want.router.topk_idx)


def check_chunks_from_one_to_more_than_tokens(rank, world):
    """The overlap's chunks (rounds in (b)) change when rows move, not the result: one
    chunk, and more chunks than tokens (empty chunks still run their collectives)."""
    sizes = {2: [2, 3], 4: [1, 0, 3, 1]}[world]
    for chunks in (1, 7):
        for cfg in configs().values():
            layer, x, wy = case(cfg, world, n=sum(sizes), seed=23)
            compare_replicated(layer, x, wy, chunks=chunks)
            compare_local(layer, x, wy, rank, world, sizes, chunks=chunks)


def check_fused_kernels(rank, world):
    """The expert kernels restricted to a rank's experts and chunked, the row combine and
    the sharded router's merge kernel (Triton's interpreter; 2 ranks, it is slow): each
    flow equal to one process running the same kernels."""
    if world != 2:
        return
    cfg = replace(configs()["more"], experts_impl="triton")
    layer, x, wy = case(cfg, world, n=11, seed=25)
    compare_replicated(layer, x, wy, chunks=3)
    compare_local(layer, x, wy, rank, world, [4, 7], chunks=2)
    layer = build(replace(cfg, router_impl="triton"), seed=27).eval()
    x = inputs(11, seed=28)[0]
    with torch.no_grad():
        want = layer(x)
        got = shard_moe_layer(layer, shard_router=True).eval()(x)
    assert torch.equal(got.router.topk_idx, want.router.topk_idx)
    close(got.y, want.y, 11, "y")


def check_local_kept_rows_enter_no_collective(rank, world):
    """(b): the rows a rank keeps (its tokens with an expert of its own) are in no
    all-to-all, in the forward or the backward, and reach its experts first, gathered
    straight into their input; the rows for other ranks are sent once per (token, rank).
    The layer's results stay one process's (the other checks)."""
    from moremoe.parallel import exchange
    cfg = configs()["more"]
    layer, x, wy = case(cfg, world, n=6 * world, seed=4)
    ep = shard_moe_layer(layer, tokens="local", chunks=2).train()
    sizes, real = [], exchange.dist.all_to_all_single

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        if input_split_sizes is not None:            # the rows' rounds (not the counts)
            sizes.append((list(input_split_sizes), list(output_split_sizes)))
        return real(output, input, output_split_sizes, input_split_sizes, **kw)
    exchange.dist.all_to_all_single = spy
    try:
        mine = x[6 * rank:6 * rank + 6]
        out, _ = run_shard(ep, mine, wy[6 * rank:6 * rank + 6])
        routed = ep.router(mine)
        plan = exchange.plan_rows(routed.topk_idx, ep.hi - ep.lo, 2)
        x_in = exchange.RowExchange(plan).dispatch(mine, routed.gates, routed.topk_idx)[0]
    finally:
        exchange.dist.all_to_all_single = real
    assert sizes and all(i[rank] == 0 and o[rank] == 0 for i, o in sizes), sizes
    ranks = torch.zeros(6, world, dtype=torch.bool)
    ranks[torch.arange(6).repeat_interleave(K), (routed.topk_idx.long() // (M // world)
                                                 ).reshape(-1)] = True
    kept = ranks[:, rank].nonzero().squeeze(1)
    assert plan.kept == kept.numel() and plan.sent == int(ranks.sum()) - kept.numel()
    assert torch.equal(plan.tok[plan.sent:], kept)
    assert torch.equal(x_in[:plan.kept], mine[kept])
    assert plan.chunk_bounds[:2] == (0, plan.kept)
    # the rounds count the rows that travel, (E - 1) / E of the pairs: 171 tokens a rank,
    # k = 3, M = 8 leave 64 pairs an expert in one round at E = 2 (two over all pairs)
    g = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(171)])
    assert len(exchange.plan_rows(idx, M // world).send) == {2: 1, 4: 2}[world]


def check_local_frees_each_steps_exchange(rank, world):
    """(b): once a step's outputs are gone, its exchange (the rows sent, received and
    returned) is freed by reference counting alone: a cycle through the collectives' work
    objects is never collected and held every step's rows on the GPU until it filled."""
    import gc
    import weakref

    from moremoe.parallel import exchange
    made, init = [], exchange.RowExchange.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))
    exchange.RowExchange.__init__ = tracked
    gc.disable()
    try:
        for cfg in configs().values():
            layer, x, wy = case(cfg, world, n=4 * world)
            ep = shard_moe_layer(layer, tokens="local", chunks=2).train()
            for _ in range(2):
                out, dx = run_shard(ep, x[4 * rank:4 * rank + 4], wy[4 * rank:4 * rank + 4])
                del out, dx
            ep = shard_moe_layer(layer, tokens="replicated", chunks=2).train()
            out, dx = run_shard(ep, x, wy)
            y = weakref.ref(out.y)
            del out, dx
            assert y() is None, "(a): the output y outlives the step"
        alive = sum(ref() is not None for ref in made)
        assert made and not alive, f"{alive} of {len(made)} exchanges still alive"
    finally:
        gc.enable()
        exchange.RowExchange.__init__ = init


CHECKS = [check_replicated_router, check_sharded_router, check_local_uneven,
          check_local_rank_without_tokens_and_cold_experts, check_replicated_cold_experts,
          check_empty_batch, check_exact_ties_in_the_merge, check_standalone_sharded_router,
          check_eval_mode, check_state_round_trip, check_construction_errors,
          check_broadcast_replicated, check_bf16_every_flow, check_bf16_sharded_router_inference,
          check_chunks_from_one_to_more_than_tokens, check_fused_kernels,
          check_local_kept_rows_enter_no_collective, check_local_frees_each_steps_exchange]


def main(rank, world, port, out_dir):
    """One rank: every check, its outcome ("ok" or the traceback) in out_dir/rank{r}.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results = {}
    for check in CHECKS:
        try:
            check(rank, world)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc(limit=-4)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
