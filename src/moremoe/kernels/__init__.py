"""Triton kernels. Importing this package never requires Triton: ``HAS_TRITON`` says whether
the kernels can be used, ``INTERPRET`` whether they run in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, how CI tests them)."""
import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # what the kernels take
MAX_K = 64                                                 # top-k the router sweep keeps
MAX_RANK = 512                                             # r the low-rank kernels hold
PEER_MAX_HIDDEN = 8192                                     # h the PEER kernels hold in registers


def usable_on(device) -> bool:
    """Whether the Triton kernels can run on tensors of this device."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")
