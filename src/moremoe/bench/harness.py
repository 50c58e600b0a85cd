"""One benchmark harness: the device's measured ceilings, median device-event timing after
warm-up with inputs rotated past L2, peak memory, and rows tagged with device, versions,
commit and date.
"""
from __future__ import annotations

import json
import re
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch

from ..report import dumps


@contextmanager
def bf16_on(device):
    """Modules built inside are created directly on the device in bf16 (no CPU init, no
    fp32 copy)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def free(device) -> None:
    """Hand cached blocks back between benchmark points (CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def device_slug(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the results folder name)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def time_ms(fn, *, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
            rotate: list | None = None, cpu_reps: int = 3) -> float:
    """Median milliseconds of fn(inputs) over device events, after warm-up. With ``rotate``
    (a list of input tuples), successive calls cycle through them so that inputs do not sit
    in L2 between calls. On the CPU: one warm-up call and the median of cpu_reps."""
    inputs = rotate or [()]
    state = {"i": 0}

    def call():
        args = inputs[state["i"] % len(inputs)]
        state["i"] += 1
        return fn(*args)

    if device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    import time
    times = []
    call()
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_fixed_ms(fn, *, device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup` calls, a fixed count (not
    do_bench's estimate from the first calls): ranks that time a collective together must
    make the same calls. Each call between two device events (CUDA), or the host clock."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        import time
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda.synchronize(device)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def peak_bytes(fn, *, device: torch.device) -> int | None:
    """Peak device memory fn() allocates above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def kernel_profile(fn, *, device: torch.device, calls: int = 3, top: int = 4) -> dict:
    """Where fn()'s device time goes: {"kernels_per_call", "kernel_time": [[name, us a call,
    share of the device time], ...] the `top` longest first} from torch.profiler's kernel
    records over `calls` calls after one unrecorded call (a first call's one-time work,
    a library's set-up or a compile, is not the call's); names cut to 80 characters;
    memcpy / memset count as kernels here, they take device time; {} off a GPU."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    us: dict[str, float] = {}
    n = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            n += 1
            us[e.name[:80]] = us.get(e.name[:80], 0.0) + e.time_range.elapsed_us() / calls
    total = sum(us.values()) or 1.0
    ranked = sorted(us.items(), key=lambda kv: -kv[1])[:top]
    return {"kernels_per_call": n / calls,
            "kernel_time": [[name, round(t, 2), round(t / total, 3)] for name, t in ranked]}


def rotation(make, nbytes: int, device: torch.device, cap: int = 8) -> list:
    """Enough independent input sets (from make()) to exceed twice the L2 cache."""
    if device.type != "cuda":
        return [make()]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    n = max(1, min(cap, -(-2 * l2 // max(nbytes, 1))))
    return [make() for _ in range(n)]


def ceilings(device: torch.device) -> dict:
    """Measured copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    if device.type != "cuda":
        return {"copy_bytes_per_s": None, "bf16_flops_per_s": None}
    src = torch.randn(1 << 28, device=device)              # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device)
    copy = 2 * src.numel() * 4 / (ms / 1e3)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device=device)
    return {"copy_bytes_per_s": copy, "bf16_flops_per_s": 2 * n ** 3 / (ms / 1e3)}


def floor_ms(flops: float, nbytes: float, ceil: dict) -> float | None:
    """The larger of FLOPs / matmul rate and bytes / copy bandwidth."""
    if not ceil.get("bf16_flops_per_s"):
        return None
    return 1e3 * max(flops / ceil["bf16_flops_per_s"], nbytes / ceil["copy_bytes_per_s"])


def append_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(dumps(row) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a results file; ValueError naming the file and line on a bad one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such results file")
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for n, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {n}: not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {n}: not a JSON object")
            rows.append(row)
    return rows


def _lines(f, path: Path):
    """(number, line) of a text file; a byte that is not UTF-8 is named with its line."""
    n = 0
    while True:
        try:
            line = f.readline()
        except UnicodeDecodeError:
            raise ValueError(f"{path}, line {n + 1}: not UTF-8 text (a binary file?); give a "
                             f"results file of JSON lines") from None
        if not line:
            return
        n += 1
        yield n, line


def read_rows_of(path: str | Path, bench: str, flag: str) -> list[dict]:
    """The rows of a results file of `moremoe bench <bench>` (each row's "bench" field);
    ValueError naming the file when it is empty or holds another benchmark's rows, so that
    no command draws, or appends to, another benchmark's file."""
    try:
        rows = read_jsonl(path)
    except ValueError as err:
        raise ValueError(f"{flag} {err}") from None
    want = f"`moremoe bench {bench}`"
    if not rows:
        raise ValueError(f"{flag} {path}: the file holds no rows; expected rows of {want}")
    others = {str(r["bench"]) for r in rows if "bench" in r} - {bench}
    if others:
        owners = " and ".join(f"`moremoe bench {o}`" for o in sorted(others))
        raise ValueError(f"{flag} {path}: not rows of {want}; they are rows of {owners}")
    untagged = sum("bench" not in r for r in rows)
    if untagged:
        raise ValueError(f"{flag} {path}: not rows of {want}; {untagged} of its {len(rows)} "
                         f"rows have no \"bench\" field, so no `moremoe bench` command wrote "
                         f"them")
    return rows


@torch.no_grad()
def router_seconds_per_token(router: torch.nn.Module, *, tokens: int = 16384,
                             seed: int = 0) -> float:
    """Median inference time of router(x) on its own device, divided by the tokens."""
    param = next(router.parameters())
    g = torch.Generator(device=param.device).manual_seed(seed)
    x = torch.randn(tokens, router.hidden, device=param.device, dtype=param.dtype, generator=g)
    was_training = router.training
    router.eval()
    try:
        ms = time_ms(lambda: router(x), device=param.device, cpu_reps=10)
    finally:
        router.train(was_training)
    return ms / 1e3 / tokens
