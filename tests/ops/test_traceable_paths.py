"""The plain-torch references inside a graph (torch.compile with fullgraph, as a CUDA-graph
capture needs): no host sync, no shape that depends on the ids, the eager values."""
import torch

from moremoe.ops.reference import swiglu_experts_ref


def test_experts_reference_traces_without_a_host_sync_and_keeps_its_values():
    g = torch.Generator().manual_seed(0)
    N, k, M, s, h = 6, 3, 8, 12, 16
    x = torch.randn(N, h, generator=g)
    idx = torch.randint(0, M, (N, k), generator=g, dtype=torch.int32)
    idx[0] = torch.tensor([5, 5, 2])              # one expert twice in a row
    gates = torch.softmax(torch.randn(N, k, generator=g), -1)
    w = [torch.randn(M, s, h, generator=g) / 4, torch.randn(M, s, h, generator=g) / 4,
         torch.randn(M, h, s, generator=g) / 4]
    eager = swiglu_experts_ref(x, gates, idx, *w)
    traced = torch.compile(swiglu_experts_ref, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = traced(x, gates, idx, *w)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
