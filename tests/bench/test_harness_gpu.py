"""bench/harness.kernel_profile on a GPU: the kernels a call launches and their share of its
device time, the longest first; on a CPU nothing to profile."""
import pytest
import torch

from moremoe.bench.harness import kernel_profile


def test_kernel_profile_is_empty_off_a_gpu():
    assert kernel_profile(lambda: torch.ones(4) @ torch.ones(4), device=torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_profile_ranks_a_calls_kernels():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(16, device=dev)

    def call():
        a @ a            # one long GEMM
        b.add_(1)        # one short elementwise kernel
    got = kernel_profile(call, device=dev, calls=3, top=4)
    # cuBLAS may clear its workspace first (a Memset, counted as device work: H100, 4936895)
    memsets = sum("Memset" in name for name, _, _ in got["kernel_time"])
    assert got["kernels_per_call"] == pytest.approx(2 + memsets), got
    kernels = [row for row in got["kernel_time"] if "Memset" not in row[0]]
    assert len(kernels) == 2, got
    (big, t_big, share_big), (_, t_small, share_small) = kernels
    assert t_big > 10 * t_small and share_big > 0.9, got
    assert sum(share for _, _, share in got["kernel_time"]) <= 1.001, got
