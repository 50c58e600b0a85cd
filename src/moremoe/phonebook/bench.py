"""`moremoe bench phonebook` (here, not in bench/, because it times the trainers of this
package): the phonebook training step's speed: milliseconds a step of the paper's h = 64, s = 8 pair
(MoE-32, MoRE-96) and of MoRE-768 at h = 512 (L = 6, batch 1,024 x 16 tokens), run op by op
(eager, no host sync), replayed from one CUDA graph (graph) and with the blocks
torch.compile'd before the capture (compiled); the trainer's loop as a search runs it, its
evaluations included (loop); and the steps a second of 1, 2, 4 and 8 runs sharing one GPU,
on CUDA streams of one process (streams) or as separate processes (processes).

Timings: eager and graph rows are the median over windows of steps between device events
after warm-up; streams rows time every stream's steps from one start event to the last end
event; processes rows use the host clock (no event spans processes); loop rows the host clock
of the whole loop. The eager, graph and compiled rows count the kernels a step launches on
a GPU (the profiler's kernel records over 4 steps; memcpy and memset apart as "copies").
Each row: device, versions, commit, date.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from ..bench.harness import ceilings, floor_ms
from ..nn.moe import MoEConfig
from ..report import table
from ..runtime import environment
from .trainer import PhonebookTrainConfig, PhonebookTrainer, phonebook_model_config
from .step import PhonebookStep

SIZE = 100_000              # phonebook entries (98 steps an epoch)
LR = 1e-3
MODELS = {"MoE-32": MoEConfig.moe(32, 4, 64, 8), "MoRE-96": MoEConfig.more(96, 4, 64, 8, 16),
          "MoRE-768": MoEConfig.more(768, 4, 512, 8, 16)}
QUICK_MODELS = {"MoE-8": MoEConfig.moe(8, 2, 32, 8), "MoRE-16": MoEConfig.more(16, 2, 32, 8, 8)}
CONCURRENT = (1, 2, 4, 8)
WINDOWS, WINDOW_STEPS = 5, {"eager": 10, "graph": 50, "compiled": 50}


BATCH = 1024          # phonebook entries a step (of pb.SEQ_LEN tokens each)


def _config(device, quick: bool) -> PhonebookTrainConfig:
    return PhonebookTrainConfig(size=2048 if quick else SIZE, lr=LR,
                                batch_size=64 if quick else BATCH, max_steps=10 ** 6,
                                threshold=float("inf"), device=str(device))


def _model(moe: MoEConfig, quick: bool):
    return phonebook_model_config(moe, layers=1 if quick else 6)


def _window_ms(step: PhonebookStep, n: int, device) -> float:
    """Milliseconds a step over one window of n steps (device events on the step's stream)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        step.run(n)
        return 1e3 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with step.on_stream():
        start.record()
    step.run(n)
    with step.on_stream():
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


TOP_KERNELS = 30      # the most launched kernel names a row keeps (where a step's launches go)


def count_kernel_events(events, top: int = 0) -> dict:
    """{"kernels", "copies"}: the device's kernel records among profiler events, and its
    memcpy / memset records apart; with top, "top_kernels": the `top` most frequent kernel
    names (cut to 120 characters) with their counts, most frequent first."""
    from torch.autograd import DeviceType
    dev = [e.name for e in events if e.device_type == DeviceType.CUDA]
    copies = sum(1 for n in dev if n.startswith(("Memcpy", "Memset")))
    out = {"kernels": len(dev) - copies, "copies": copies}
    if top:
        names = Counter(n[:120] for n in dev if not n.startswith(("Memcpy", "Memset")))
        out["top_kernels"] = [[n, c] for n, c in names.most_common(top)]
    return out


def kernels_a_step(step: PhonebookStep, device, n: int = 4) -> dict:
    """Kernels and copies a step on the device, over n profiled steps (a CUDA graph's
    kernels count one by one: what its replay launches), and the most launched kernels'
    names with their launches a step; empty off a GPU, where there is no device kernel to
    count."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.run(n)
        torch.cuda.synchronize(device)
    got = count_kernel_events(prof.events(), top=TOP_KERNELS)
    return {"kernels": got["kernels"] / n, "copies": got["copies"] / n,
            "top_kernels": [[name, c / n] for name, c in got["top_kernels"]]}


def measure_step(name: str, mode: str, device, quick: bool) -> dict:
    """ms a step of one run in `mode` (eager, graph, compiled), after a warm-up window, and
    the kernels it launches (issue 54: a launch-bound step)."""
    cfg = _config(device, quick)
    t0 = time.perf_counter()
    step = PhonebookStep(_model(_MODELS[name], quick), cfg, LR, device=device,
                         mode=mode)
    n = 2 if quick else WINDOW_STEPS[mode]
    _window_ms(step, n, device)                  # capture / compile, then warm
    setup = time.perf_counter() - t0
    ms = statistics.median(_window_ms(step, n, device) for _ in range(2 if quick else WINDOWS))
    return {"variant": mode, "model": name, "ms": ms, "steps_per_s": 1e3 / ms,
            "setup_s": setup, "window_steps": n, **kernels_a_step(step, device)}


def measure_loop(name: str, device, quick: bool) -> dict:
    """The trainer's loop (advance / settle, an evaluation every 100 steps): host clock."""
    cfg = _config(device, quick)
    steps = 20 if quick else 500
    trainer = PhonebookTrainer(_model(_MODELS[name], quick), cfg, LR, name=name)
    trainer.advance()
    trainer.settle()                             # capture and the first interval
    t0, first = time.perf_counter(), trainer.step.steps
    while trainer.step.steps - first < steps:
        trainer.advance()
        trainer.settle()
    done = trainer.step.steps - first
    ms = 1e3 * (time.perf_counter() - t0) / done
    return {"variant": "loop", "model": name, "ms": ms, "steps_per_s": 1e3 / ms,
            "eval_every": cfg.eval_every, "steps": done}


def measure_streams(name: str, k: int, device, quick: bool) -> dict:
    """Aggregate steps a second of k runs of one model on their own streams (one process)."""
    cfg = _config(device, quick)
    runs = [PhonebookStep(_model(_MODELS[name], quick), cfg, LR, device=device,
                          stream=torch.cuda.Stream(device)) for _ in range(k)]
    n = 4 if quick else 60
    for r in runs:
        r.run(2)                                 # capture
    torch.cuda.synchronize(device)
    totals = []
    for _ in range(2 if quick else 3):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for r in runs:
            r.stream.wait_event(start)
        for _ in range(n):
            for r in runs:
                r.run(1)
        for r in runs:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(r.stream)
            ends.append(ev)
        torch.cuda.synchronize(device)
        totals.append(max(start.elapsed_time(e) for e in ends))
    ms = statistics.median(totals)
    return {"variant": "streams", "model": name, "concurrent": k,
            "steps_per_s": 1e3 * k * n / ms, "ms": ms / n, "steps_each": n}


def _process_run(moe, device, quick, n, barrier, out) -> None:
    step = PhonebookStep(_model(moe, quick), _config(device, quick), LR,
                         device=torch.device(device))
    step.run(2)
    torch.cuda.synchronize(device)
    barrier.wait()
    t0 = time.time()
    step.run(n)
    torch.cuda.synchronize(device)
    out.put((t0, time.time()))


def measure_processes(name: str, k: int, device, quick: bool) -> dict:
    """Aggregate steps a second of k processes, one run each, on the same GPU."""
    ctx = torch.multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    n = 4 if quick else 200
    procs = [ctx.Process(target=_process_run, args=(_MODELS[name], str(device), quick, n,
                                                    barrier, out)) for _ in range(k)]
    for p in procs:
        p.start()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"variant": "processes", "model": name, "concurrent": k,
            "steps_per_s": k * n / seconds, "ms": 1e3 * seconds / n, "steps_each": n,
            "timer": "host"}


def _floor(name: str, device, quick: bool, ceil: dict) -> dict:
    """A step's FLOPs (forward + backward) and bytes (the weights read twice, the gradients
    written, AdamW's weights and two moments read and written: 32 a parameter), and the
    time they take at the measured matmul rate and copy bandwidth."""
    cfg = _config(device, quick)
    model = _model(_MODELS[name], quick)
    tokens = cfg.rows * (model.max_seq_len - 1)
    flops = model.training_flops_per_token(model.max_seq_len - 1) * tokens
    nbytes = 32 * model.total_params()
    return {"size": cfg.size, "batch": cfg.rows, "flops_per_step": flops,
            "bytes_per_step": nbytes, "floor_ms": floor_ms(flops, nbytes, ceil)}


def _models(quick: bool, points=None) -> dict:
    """The models timed: the quick pair, the paper's points' pairs (their keys), or the
    default h = 64 pair and MoRE-768."""
    if quick:
        return QUICK_MODELS
    if not points:
        return MODELS
    from .paper import POINTS, RANK, TOP_K
    out = {}
    for key in points:
        p = POINTS[key]
        out[f"{key} MoE-{p.moe_experts}"] = MoEConfig.moe(p.moe_experts, TOP_K, p.hidden,
                                                          p.width)
        out[f"{key} MoRE-{p.more_experts}"] = MoEConfig.more(p.more_experts, TOP_K, p.hidden,
                                                             p.width, RANK)
    return out


def trial_minutes(name: str, ms: float) -> dict:
    """{size: minutes} of a whole trial (1,500 epochs, batch 1,024) at `ms` a step, for the
    paper's capacity of a point's model and the grid's next size: what a search's long run
    costs (the evaluations of the loop rows included)."""
    from .paper import PAPER_GRID, POINTS
    key, model = name.split(" ", 1) if " " in name else (None, name)
    if key not in POINTS:
        return {}
    p = POINTS[key]
    cap = p.paper_moe if model.startswith("MoE") else p.paper_more
    sizes = [cap] + [g for g in PAPER_GRID if g > cap][:1]
    return {str(n): ms * PhonebookTrainConfig(size=n).planned_steps() / 6e4 for n in sizes}


_MODELS: dict = {}        # name -> MoEConfig of this run's models (run_phonebook sets it)


def run_phonebook(device, *, quick: bool = False, progress=None, modes=("eager", "graph",
                                                                        "compiled"),
                  points=None):
    """Every row: each model in each step mode, the loop, streams and processes (of the
    first pair); with points, the pairs of those paper points (h64-s8, h256-s8, ...), their
    loop rows with the minutes of a whole trial at the paper's capacity and the next size."""
    env = {**environment(device), **ceilings(device)}
    _MODELS.clear()
    _MODELS.update(_models(quick, points))
    names = list(_MODELS)
    pair = names[:2]
    cuda = device.type == "cuda"
    work = [(measure_step, (n, m)) for n in names for m in modes
            if m == "eager" or (cuda and m == "graph")]
    if cuda:                    # compiling comes last: tens of seconds a model
        work += [(measure_loop, (n,)) for n in pair]
        work += [(measure_streams, (n, k)) for n in pair for k in CONCURRENT]
        work += [(measure_processes, (pair[1], k)) for k in (2, 4)]
        work += [(measure_step, (n, "compiled")) for n in names if "compiled" in modes]
    for i, (fn, args) in enumerate(work, 1):
        try:
            row = fn(*args, device, quick)
        except Exception as err:    # noqa: BLE001 - a variant that fails is a row that says so
            row = {"variant": fn.__name__.removeprefix("measure_"), "model": args[0],
                   "error": f"{type(err).__name__}: {err}"[:300]}
        if row.get("variant") == "loop" and row.get("ms"):
            row["trial_minutes"] = trial_minutes(args[0], row["ms"])
        row = {"bench": "phonebook", **row, **_floor(args[0], device, quick, env), **env}
        progress and progress(i, len(work), row)
        yield row


def phonebook_table(rows: list[dict]) -> str:
    out = [[r["model"], r["variant"], r.get("concurrent", 1),
            f"{r['ms']:.2f}" if r.get("ms") is not None else r.get("error", "-"),
            f"{r['steps_per_s']:.1f}" if r.get("steps_per_s") else "-",
            f"{r['kernels']:,.0f}" if r.get("kernels") is not None else "-",
            ", ".join(f"{int(n):,}: {m:,.0f} min" for n, m in r.get("trial_minutes",
                                                                     {}).items()) or "-"]
           for r in rows]
    return table(out, ["model", "variant", "runs at once", "ms a step (each)",
                       "steps/s (all)", "kernels a step", "a 1,500-epoch trial at (size: time)"])
