"""Generation whose routing does not depend on the batch (issue 35, part 4): a prompt decoded
alone and the same prompt among 64 others. Every router call of either run is replayed on
the same input rows in the other batch shape (the prompt's rows alone, or among the other
rows of the call), and must choose the same experts: the prefill at N = T against 64 T, and
each decode step at N = 1 against 64, on the path generate() takes (the reference on the
CPU, the fused kernels on a GPU). The whole outputs are printed beside it (`-s`): other
kernels (attention, the GEMMs) sum in another order at another batch, so the router's
inputs themselves may differ in their last bits between the two runs."""
import pytest
import torch

from moremoe.model import Transformer, TransformerConfig, generate
from moremoe.nn import MoEConfig
from moremoe.nn.router import _Router

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])]
ROW, B, T, NEW = 37, 64, 12, 6          # the prompt's row in the batch of 64


def _generate_recording(model, prompt_BT):
    calls = []

    def hook(mod, args, out):
        calls.append((mod, args[0].detach(), out.topk_idx.detach()))
    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, _Router)]
    try:
        return generate(model, prompt_BT, NEW), calls
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["more", "moe"])
def test_a_prompts_routing_does_not_depend_on_its_batch(device, dtype, arch):
    moe = (MoEConfig.more(96, 4, 64, 16, 16) if arch == "more"
           else MoEConfig.moe(32, 4, 64, 16))
    cfg = TransformerConfig(vocab=512, layers=2, heads=4, max_seq_len=T + NEW, moe=moe)
    model = Transformer(cfg).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 512, (B, T), generator=g).to(device)
    prompt = batch[ROW:ROW + 1]
    alone, alone_calls = _generate_recording(model, prompt)
    crowd, crowd_calls = _generate_recording(model, batch)
    assert len(alone_calls) == len(crowd_calls) == 2 * NEW
    with torch.no_grad():
        for (router, x, idx), (_, x_crowd, idx_crowd) in zip(alone_calls, crowd_calls):
            n = x.shape[0]                                   # T in the prefill, then 1
            mine = slice(ROW * n, (ROW + 1) * n)
            # the prompt's rows of the batched call, routed alone
            assert torch.equal(router(x_crowd[mine]).topk_idx, idx_crowd[mine])
            # the lone call's rows, routed among the batched call's other rows
            others = torch.cat([x_crowd[:mine.start], x, x_crowd[mine.stop:]])
            assert torch.equal(router(others).topk_idx[mine], idx)
            # both runs' inputs: which of the prompt's rows differ, and their routing
            same_x = (x == x_crowd[mine]).all(1)
            assert torch.equal(idx[same_x], idx_crowd[mine][same_x])
    differ = sum(a != b for a, b in zip(alone[0], crowd[ROW]))
    print(f"\n{arch} {dtype} on {device}: greedy tokens alone {alone[0]}, among {B} "
          f"{crowd[ROW]} ({differ} of {NEW} differ)")
