"""Ops: plain-torch references (``reference``) and, where built, fused kernels behind autograd."""
