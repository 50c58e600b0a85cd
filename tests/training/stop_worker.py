"""One torchrun rank of test_torchrun_stop: ten budget stops in a row in this process
(`moremoe train` through its main, each resuming the last), and after each a look at what
rank 0 wrote: the stop's checkpoint and summary must be complete when train() returns on
any rank (the ranks leave its last barrier together). Writes its exit statuses and what it
saw to OUT/rank<R>.json, and exits as the last run's rank would.

    torchrun --nproc_per_node 2 tests/training/stop_worker.py DATA OUT [--set K=V ...]
"""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from moremoe.cli.main import main
from moremoe.model import checkpoint as stored
from moremoe.parallel import ddp


def look(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    latest = stored.latest_checkpoint(out)
    return {"step": summary["step"], "stopped": summary["stopped"],
            "exit_code": summary["exit_code"], "checkpoint": latest and latest.name,
            "incomplete": [str(p) for p, _ in stored.incomplete_checkpoints(out)]}


def run(data: str, out: Path, sets: list[str]) -> list[dict]:
    seen, step = [], 0
    for k in range(10):
        budget = ["--stop-step", str(step + 1)] if k % 2 == 0 else ["--max-minutes", "2e-4"]
        code = main(["train", "--preset", "tiny-moe", "--data", data, "--out", str(out),
                     "--device", "cpu", "--resume", *budget, *sets])
        seen.append({"status": code, **look(out)})
        step = seen[-1]["step"]
    return seen


if __name__ == "__main__":
    data, out, sets = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    # the ten runs share one process group: one made anew would read the last one's
    # addresses from torchrun's store and fail to connect
    ddp.destroy = lambda info: None
    seen = run(data, out / "run", sets)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    sys.exit(seen[-1]["status"])
