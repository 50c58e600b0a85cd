"""How far the captured phonebook step drifts from the eager one (issue 34): the h = 64,
s = 8 pair at L = 2 (tests/phonebook/test_phonebook_gpu.py's models and settings) trained 60
steps from one initialisation in each step mode, twice eagerly (is the eager step itself
deterministic?), once from a CUDA graph and once from a graph of the compiled blocks. For
each weight matrix: how far it moved from the start in each mode, and how far each mode's
matrix lies from the first eager run's, relative to that move. Run with the source tree on
PYTHONPATH, so that two trees can be compared:

    PYTHONPATH=src python benchmarks/captured_step_drift.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch

from moremoe.nn import MoEConfig
from moremoe.runtime import environment
from moremoe.phonebook.trainer import PhonebookTrainConfig, phonebook_model_config
from moremoe.phonebook.step import PhonebookStep

PAIR = {"MoE-32": phonebook_model_config(MoEConfig.moe(32, 4, 64, 8), layers=2),
        "MoRE-96": phonebook_model_config(MoEConfig.more(96, 4, 64, 8, 16), layers=2)}
MODES = ("eager", "eager", "graph", "compiled")


def cfg() -> PhonebookTrainConfig:
    return PhonebookTrainConfig(size=3000, batch_size=256, lr=1e-3, max_steps=60,
                                eval_every=10, threshold=float("inf"), device="cuda")


def train(model_cfg, mode: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    step = PhonebookStep(model_cfg, cfg(), 1e-3, device=torch.device("cuda"), mode=mode)
    losses = []
    for _ in range(6):
        step.run(10)
        losses.append(step.read()["loss"])
    return losses, {n: p.detach().float().clone() for n, p in step.model.named_parameters()}


def main(out: str) -> None:
    rows = []
    for label, model_cfg in PAIR.items():
        torch.manual_seed(0)
        start = {n: p.detach().float().clone() for n, p in
                 PhonebookStep(model_cfg, cfg(), 1e-3, device=torch.device("cuda"),
                               mode="eager").model.named_parameters()}
        runs = [train(model_cfg, m) for m in MODES]
        ref = runs[0][1]
        for i, (mode, (losses, params)) in enumerate(zip(MODES, runs)):
            for name, p in params.items():
                moved = (p - start[name]).norm().item()
                moved_ref = (ref[name] - start[name]).norm().item()
                rows.append({"model": label, "run": i, "mode": mode, "param": name,
                             "moved": moved, "moved_eager": moved_ref,
                             "from_eager": (p - ref[name]).norm().item() / max(moved_ref, 1e-30),
                             "losses": losses if name.endswith("lm_head.weight") else None})
    with open(out, "w") as f:
        json.dump({**environment(torch.device("cuda")), "rows": rows}, f, indent=1)
    for r in rows:
        if r["run"] and (r["from_eager"] > 0 or r["losses"]):
            print(f"{r['model']:8} {r['run']} {r['mode']:8} {r['param']:32} moved "
                  f"{r['moved']:.4f} (eager {r['moved_eager']:.4f}) "
                  f"apart {r['from_eager']:.3f}" + (f" losses {r['losses']}" if r["losses"]
                                                    else ""))


if __name__ == "__main__":
    main(sys.argv[1])
