"""Timing: median of repeated runs after warm-up, device events on GPU, perf_counter on CPU."""
from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, *, device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of fn() in seconds; on CUDA timed with events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def router_seconds_per_token(router: torch.nn.Module, *, tokens: int = 16384,
                             dtype: torch.dtype | None = None, repeats: int = 10,
                             seed: int = 0) -> float:
    """Median inference time of router(x) divided by the number of tokens."""
    param = next(router.parameters())
    g = torch.Generator(device=param.device).manual_seed(seed)
    x = torch.randn(tokens, router.hidden, device=param.device, dtype=dtype or param.dtype,
                    generator=g)
    was_training = router.training
    router.eval()
    try:
        secs = median_seconds(lambda: router(x), device=param.device, repeats=repeats)
    finally:
        router.train(was_training)
    return secs / tokens
