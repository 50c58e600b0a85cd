"""GPU tests of the grouped expert kernels (`pytest -m gpu` on the device machine): full size
in bf16 against the reference, fp32 products as torch's fp32 matmul precision says, and
int64-safe offsets with N·k·h > 2^31."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _setup(N, h, s, M, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(N, M, device="cuda", generator=g) if N * M <= 2 ** 31 else None
    idx = (logits.topk(k, 1).indices if logits is not None else
           torch.randint(0, M, (N, k), device="cuda", generator=g))
    gates = torch.softmax(torch.randn(N, k, device="cuda", generator=g), -1)
    ws = [(torch.randn(*shape, device="cuda", generator=g) * 0.05).bfloat16()
          for shape in ((M, s, h), (M, s, h), (M, h, s))]
    return x, gates, idx.int(), ws


@pytest.mark.parametrize("pair", [True, False])
def test_full_size_forward_and_backward_bf16(pair):
    """pair: the gate and up weight gradients in one launch (dw_pair, the default; its two
    64 x 64 accumulators spill on sm_90) or two."""
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.ops.reference import swiglu_experts_ref
    x, gates, idx, ws = _setup(65536, 512, 64, 8192, 4)
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    ref = swiglu_experts_ref(x, gates, idx, *ws, upcast=True)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    dy = torch.randn_like(y)
    got = mg.backward(dy, x, gates, idx, *ws, act, xg, xu, cfg={"dw_pair": pair})
    xr, gr = x.float().requires_grad_(), gates.clone().requires_grad_()
    wr = [w.float().requires_grad_() for w in ws]
    (swiglu_experts_ref(xr, gr, idx, *wr) * dy.float()).sum().backward()
    for a, b in zip(got, (xr.grad, gr.grad, *[w.grad for w in wr])):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_fp32_products_follow_torchs_matmul_precision(precision):
    """fp32 inputs at odd sizes, every path (fused inference, two-kernel forward, backward
    with the weight gradients in pieces): exact fp32 products at torch's default "highest"
    (element by element within fp32's summation error of the fp64 reference), TF32 at
    "high" (the trainer's setting: inputs rounded to 10 mantissa bits, about 5e-4 each, so
    within 1e-2 of the reference's norm)."""
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.ops.reference import swiglu_experts_ref

    def check(got, want, tol):
        if precision == "highest":
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        else:
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-2

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        N, h, s, M, k = 301, 80, 48, 13, 3
        x = torch.randn(N, h, device="cuda", generator=g)
        idx = torch.randn(N, M, device="cuda", generator=g).topk(k, 1).indices.int()
        gates = torch.softmax(torch.randn(N, k, device="cuda", generator=g), -1)
        ws = [torch.randn(*shape, device="cuda", generator=g) * 0.3
              for shape in ((M, s, h), (M, s, h), (M, h, s))]
        ref = swiglu_experts_ref(x.double(), gates.double(), idx, *[w.double() for w in ws])
        for fused in (True, False):
            check(mg.forward(x, gates, idx, *ws, cfg={"fused": fused}), ref, 1e-4)
        y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
        dy = torch.randn(N, h, device="cuda", generator=g)
        got = mg.backward(dy, x, gates, idx, *ws, act, xg, xu, cfg={"dw_piece_rows": 16})
        x64, g64 = x.double().requires_grad_(), gates.double().requires_grad_()
        w64 = [w.double().requires_grad_() for w in ws]
        (swiglu_experts_ref(x64, g64, idx, *w64) * dy.double()).sum().backward()
        for a, want in zip(got, (x64.grad, g64.grad, *[w.grad for w in w64])):
            check(a, want, 1e-3)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.gpu_serial          # tens of GB: the GPU to itself
def test_int64_offsets_beyond_2_pow_31():
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.ops.reference import swiglu_experts_ref
    N, h, s, M, k = 2 ** 20 + 5, 512, 64, 256, 4
    assert N * k * h > 2 ** 31
    x, gates, idx, ws = _setup(N, h, s, M, k, seed=1)
    y = mg.forward(x, gates, idx, *ws)
    tail = slice(N - 2048, N)
    ref = swiglu_experts_ref(x[tail], gates[tail], idx[tail], *ws, upcast=True)
    assert ((y[tail].float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu_serial          # tens of GB: the GPU to itself
@pytest.mark.parametrize("combine", ["pairs", "atomic"])
def test_one_kernel_forward_full_size_and_beyond_2_pow_31(combine):
    """The fused inference forward (act on chip), with pair rows or fp32 atomics, at full
    size and with N·k·h > 2^31 pair-row offsets."""
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.ops.reference import swiglu_experts_ref
    for N, M, seed in ((65536, 8192, 0), (2 ** 20 + 5, 256, 1)):
        x, gates, idx, ws = _setup(N, 512, 64, M, 4, seed=seed)
        y = mg.forward(x, gates, idx, *ws, cfg={"fused": True}, combine=combine)
        tail = slice(N - 2048, N)
        ref = swiglu_experts_ref(x[tail], gates[tail], idx[tail], *ws, upcast=True)
        assert ((y[tail].float() - ref).norm() / ref.norm()).item() < 1e-2
        two = mg.forward(x[tail], gates[tail], idx[tail], *ws)
        assert ((y[tail].float() - two.float()).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("N", [4, 64])
def test_split_h_decode_forward_at_large_h(N):
    """Decoding sizes at h = 4,096: the gate/up reduction split over programs (the default
    there) against the reference and against the unsplit kernels."""
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.ops.reference import swiglu_experts_ref
    x, gates, idx, ws = _setup(N, 4096, 64, 8192, 4, seed=2)
    y = mg.forward(x, gates, idx, *ws)
    ref = swiglu_experts_ref(x, gates, idx, *ws, upcast=True)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    one = mg.forward(x, gates, idx, *ws, cfg={"fused": False, "split_h": 1})
    assert ((y.float() - one.float()).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("N,k,M", [(1, 4, 16384), (4, 4, 8192), (64, 4, 64), (256, 4, 1024),
                                   (255, 4, 2), (128, 8, 8192)])
def test_one_launch_routing_metadata_on_the_gpu(N, k, M):
    from moremoe.kernels.routing_meta import routing_meta, routing_meta_torch
    g = torch.Generator(device="cuda").manual_seed(N + M)
    idx = torch.randint(0, M, (N, k), device="cuda", generator=g, dtype=torch.int32)
    a, b = routing_meta(idx, M, 64), routing_meta_torch(idx, M, 64)
    for field in ("order", "offsets", "block_expert", "block_start"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("N,k,M", [(16384, 4, 32), (16384, 4, 96), (257, 4, 7), (4096, 4, 254),
                                   (65536, 1, 1)])
def test_the_counting_sort_metadata_on_the_gpu(N, k, M):
    """kernels/routing_count.py compiled for the GPU: the phonebook pair's shapes (16,384
    tokens, k = 4, M = 32 and 96), the most bins, one expert; equal to the torch ops."""
    from moremoe.kernels.routing_meta import routing_meta, routing_meta_torch
    g = torch.Generator(device="cuda").manual_seed(N + M)
    idx = torch.randint(0, M, (N, k), device="cuda", generator=g, dtype=torch.int32)
    a = routing_meta(idx, M, 64, counting=True, sorting=False)
    b = routing_meta_torch(idx, M, 64)
    for field in ("order", "offsets", "block_expert", "block_start"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("N,k,M,first", [(65536, 4, 256, 0), (65536, 4, 1792, 0),
                                         (65536, 4, 8192, 0), (65536, 1, 128, 0),
                                         (3000, 4, 400, 150)])
def test_the_sort_and_count_metadata_on_the_gpu(N, k, M, first):
    """routing_count.sorted_meta compiled for the GPU: the presets' and the study's shapes
    (65,536 tokens, M = 256 to 8,192), one past the counting sort's tile (k = 1, M = 128),
    a shard; equal to the torch ops field by field (the atomics' counts are integers)."""
    from moremoe.kernels.routing_meta import routing_meta, routing_meta_torch
    g = torch.Generator(device="cuda").manual_seed(N + M)
    idx = torch.randint(0, M + 2 * first, (N, k), device="cuda", generator=g,
                        dtype=torch.int32)
    a = routing_meta(idx, M, 64, first_expert=first, counting=False, sorting=True)
    b = routing_meta_torch(idx, M, 64, first_expert=first)
    for field in ("order", "offsets", "block_expert", "block_start"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("N,k,M", [(16384, 4, 96), (200, 4, 8192), (16384, 4, 1792)])
def test_pair_order_on_the_gpu(N, k, M):
    """routing_meta.pair_order's kernels (the counting sort, the one launch) and its sort
    (past the counting sort's tile) against one stable sort and M + 1 binary searches."""
    from moremoe.kernels.routing_meta import pair_order
    g = torch.Generator(device="cuda").manual_seed(N + M)
    idx = torch.randint(0, M, (N, k), device="cuda", generator=g, dtype=torch.int32)
    for a, b in zip(pair_order(idx, M), pair_order(idx, M, kernels=False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pairs,M,chunks,hot", [(65536 * 4, 96, 1, False),
                                                (65536 * 4, 8192, 1, True),
                                                (65536 * 4, 1792, 3, False)])
def test_the_weight_gradient_plan_on_the_gpu(pairs, M, chunks, hot):
    """expert_wgrad.plan's one launch against its torch ops at the phonebook's and the
    presets' pairs (a hot expert cut into many pieces; chunks of tokens), field for field."""
    from moremoe.kernels import expert_wgrad as wgrad
    g = torch.Generator(device="cuda").manual_seed(M)
    ids = torch.randint(0, M, (pairs,), device="cuda", generator=g)
    if hot:
        ids[: pairs // 2] = 7
    counts = torch.stack([torch.bincount(c, minlength=M) for c in ids.chunk(chunks)])
    offsets = torch.cat([counts.new_zeros(1), counts.reshape(-1).cumsum(0)])
    got, want = (wgrad.plan(offsets, M, chunks, wgrad.PIECE_ROWS, pairs, kernel=kernel)
                 for kernel in (True, False))
    assert (got.bound, got.slots, got.rows) == (want.bound, want.slots, want.rows)
    for a, b in zip(got[:4], want[:4]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["one_token", "all_on_one_expert", "most_experts_empty",
                                  "width_56"])
def test_auto_dispatch_edges_with_autograd(case):
    """SwiGLUExperts(impl="auto") takes the kernels on CUDA; edge cases (and a width that is
    not a multiple of 16, as the paper's MoRE-1792) through autograd."""
    from moremoe.nn.experts import SwiGLUExperts
    from moremoe.ops.reference import swiglu_experts_ref
    from moremoe.ops.dispatch import resolve_impl
    N, h, s, M, k = {"one_token": (1, 256, 64, 16384, 4), "all_on_one_expert": (3000, 128, 32, 64, 1),
                     "most_experts_empty": (777, 512, 128, 4096, 2),
                     "width_56": (5000, 512, 56, 1792, 4)}[case]
    x, gates, idx, _ = _setup(N, h, s, 8, k, seed=2)
    if case == "all_on_one_expert":
        idx = torch.full_like(idx, 5)
    elif case == "most_experts_empty":
        idx = torch.randint(0, 3, (N, k), device="cuda").int() * 1000 + torch.arange(
            k, device="cuda", dtype=torch.int32)
    elif case == "one_token":
        idx = torch.tensor([[0, 9000, 16383, 77]], device="cuda", dtype=torch.int32)
    else:
        idx = torch.randn(N, M, device="cuda").topk(k, 1).indices.int()
    ex = SwiGLUExperts(h, s, M).cuda().bfloat16()
    assert resolve_impl("auto", x) == "triton"
    xr, gr = x.clone().requires_grad_(), gates.clone().requires_grad_()
    y = ex(xr, gr, idx)
    xf, gf = x.float().requires_grad_(), gates.clone().requires_grad_()
    wf = [w.detach().float().requires_grad_() for w in (ex.w_gate, ex.w_up, ex.w_down)]
    ref = swiglu_experts_ref(xf, gf, idx, *wf)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (ref * dy.float()).sum().backward()
    for got, want in ((xr.grad, xf.grad), (gr.grad, gf.grad), (ex.w_gate.grad, wf[0].grad),
                      (ex.w_up.grad, wf[1].grad), (ex.w_down.grad, wf[2].grad)):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2
    used = torch.zeros(M, dtype=torch.bool, device="cuda")
    used[idx.long().flatten()] = True
    assert (ex.w_up.grad[~used] == 0).all()
    assert (ex.w_up.grad[used].flatten(1).abs().sum(1) > 0).all()      # every used expert


def test_fp32_weights_with_bf16_x_equal_the_cast_weights_at_training_size():
    """The MoRE-1792 layer of the h = 512 pair at one micro-batch: fp32 master weights read by
    the kernels give the products of the bf16-cast weights bit for bit, and fp32 weight
    gradients that round to the bf16 ones."""
    from moremoe.kernels import swiglu_experts as mg
    x, gates, idx, ws16 = _setup(16384, 512, 56, 1792, 4, seed=2)
    ws32 = [w.float() for w in ws16]
    out32 = mg.forward(x, gates, idx, *ws32, save=True)
    out16 = mg.forward(x, gates, idx, *ws16, save=True)
    for a, b in zip(out32, out16):
        assert torch.equal(a, b)
    dy = torch.randn_like(out16[0])
    got = mg.backward(dy, x, gates, idx, *ws32, *out32[1:])
    want = mg.backward(dy, x, gates, idx, *ws16, *out16[1:])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for dw32, dw16 in zip(got[2:], want[2:]):
        assert dw32.dtype == torch.float32 and torch.equal(dw32.bfloat16(), dw16)


def test_a_shard_in_chunks_equals_the_whole_layers_slots_bf16():
    """An expert-parallel shard (experts [2048, 6144) of 8,192) run in 4 chunks on the GPU:
    y and every gradient as the reference's on the shard's slots."""
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.kernels.routing_meta import routing_meta
    from moremoe.ops.reference import swiglu_experts_ref
    x, gates, idx, ws = _setup(16384, 512, 64, 8192, 4, seed=1)
    lo, hi = 2048, 6144
    shard = [w[lo:hi].contiguous() for w in ws]
    bounds = (0, 4096, 8192, 12288, 16384)
    meta = routing_meta(idx, hi - lo, mg.config(512, 64)["BM"], first_expert=lo,
                        bounds=bounds)
    y, act, xg, xu = mg.forward(x, gates, idx, *shard, save=True, meta=meta,
                                first_expert=lo)
    ref = swiglu_experts_ref(x, gates, idx, *shard, upcast=True, first_expert=lo)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    dy = torch.randn_like(y)
    got = mg.backward(dy, x, gates, idx, *shard, act, xg, xu, meta=meta, first_expert=lo)
    xr, gr = x.float().requires_grad_(), gates.clone().requires_grad_()
    wr = [w.float().requires_grad_() for w in shard]
    (swiglu_experts_ref(xr, gr, idx, *wr, first_expert=lo) * dy.float()).sum().backward()
    for a, b in zip(got, (xr.grad, gr.grad, *[w.grad for w in wr])):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-2


def test_hot_experts_in_pieces_at_the_presets_micro_batch():
    """The h = 512 pair's micro-batch (16,384 tokens, M = 256, k = 4) with half the tokens
    on expert 3 and a quarter on expert 7 (a router at the start of training): the weight
    gradients in pieces of 512 rows equal one program an expert's within bf16's summation
    error, and the fp32 reference's."""
    from moremoe.kernels import swiglu_experts as mg
    from moremoe.ops.reference import swiglu_experts_ref
    x, gates, idx, ws = _setup(16384, 512, 64, 256, 4)
    n = torch.arange(16384, device="cuda")
    idx[:, 0] = torch.where(n % 2 == 0, 3, idx[:, 0])
    idx[:, 1] = torch.where(n % 4 == 1, 7, idx[:, 1])
    sorted_ = idx.sort(1).values                       # rows that name an expert twice dropped
    ok = (sorted_[:, 1:] != sorted_[:, :-1]).all(1)
    x, gates, idx = x[ok], gates[ok], idx[ok]
    assert (idx == 3).sum() > 6000
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    dy = torch.randn_like(y)
    pieces = mg.backward(dy, x, gates, idx, *ws, act, xg, xu)
    whole = mg.backward(dy, x, gates, idx, *ws, act, xg, xu, cfg={"dw_piece_rows": 2 ** 62})
    xr, gr = x.float().requires_grad_(), gates.clone().requires_grad_()
    wr = [w.float().requires_grad_() for w in ws]
    (swiglu_experts_ref(xr, gr, idx, *wr) * dy.float()).sum().backward()
    for a, b, want in zip(pieces[2:], whole[2:], (w.grad for w in wr)):
        # the same fp32 terms summed in another grouping: at most (rows) x eps x the
        # largest partial sum apart, then each rounded to the weights' dtype (bf16): one
        # rounding step of the largest value more
        big = b.float().abs().max().item()
        bound = (x.shape[0] * torch.finfo(torch.float32).eps + torch.finfo(a.dtype).eps) * big
        assert (a.float() - b.float()).abs().max().item() <= bound
        assert ((a.float() - want).norm() / want.norm()).item() < 2e-2
