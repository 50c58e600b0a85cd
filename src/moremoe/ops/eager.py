"""The custom ops' bodies outside torch.compile.

Each fused op is a torch.library custom op, so that torch.compile traces it; in eager mode
the op's dispatch costs 0.1–1 ms of host time a call on an H100 host (measured at N = 2,048,
benchmarks/NOTES.md), more than the router's or a decode step's GPU time. Outside
torch.compile the bodies are called directly: `call` for an op without autograd, and
`call_autograd` for one with, through an autograd.Function that runs the op's own
setup_context and backward. A test compares eager and compiled values and gradients.
"""
from __future__ import annotations

import torch


def call(op, body, *args):
    """op(*args) under torch.compile, body(*args) otherwise."""
    return op(*args) if torch.compiler.is_compiling() else body(*args)


class _Direct(torch.autograd.Function):
    """body's outputs with setup(ctx, inputs, output) and backward(ctx, *grads), as the
    custom op's register_autograd would run them; unused output gradients arrive as None."""

    @staticmethod
    def forward(ctx, body, setup, backward, *inputs):
        ctx.set_materialize_grads(False)
        out = body(*inputs)
        setup(ctx, inputs, out)
        ctx.backward_fn = backward
        outs = out if isinstance(out, tuple) else (out,)
        ctx.mark_non_differentiable(*(t for t in outs if not t.is_floating_point()))
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *ctx.backward_fn(ctx, *grads))


def call_autograd(op, body, setup, backward, *inputs):
    """The differentiable op under torch.compile; body with setup and backward otherwise
    (backward given the body of the op's backward op, not the op)."""
    if torch.compiler.is_compiling():
        return op(*inputs)
    return _Direct.apply(body, setup, backward, *inputs)
