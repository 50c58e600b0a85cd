"""Whether another process computes on this test's GPU: timed assertions (one path against
another) do not hold on a GPU time-sliced with other work, and skip there, saying so."""
import os
import subprocess

import pytest
import torch


def others_on_this_gpu() -> list[int]:
    """PIDs of the other compute processes on the current CUDA device ([] where nvidia-smi
    cannot tell)."""
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError, RuntimeError, AssertionError, AttributeError):
        return []
    pids = []
    for line in out.splitlines():
        gpu, _, pid = (part.strip() for part in line.partition(","))
        if pid.isdigit() and int(pid) != os.getpid() and gpu.replace("GPU-", "") == \
                uuid.replace("GPU-", ""):
            pids.append(int(pid))
    return pids


def skip_timing_if_shared() -> None:
    pids = others_on_this_gpu()
    if pids:
        pytest.skip(f"the GPU is shared with {len(pids)} other process(es) (pids "
                    f"{', '.join(map(str, pids[:4]))}): timings would not hold")
