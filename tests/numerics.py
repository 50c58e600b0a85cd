"""Tolerances for comparing floats computed along two code paths (a different block
schedule, module layout or BLAS kernel): a sum of n terms in a dtype with unit roundoff u
can differ by about n·u relative between two summation orders, so values are compared to
that and never bit for bit. Indices, token ids and state dicts are compared exactly."""
import torch


def reduction_tol(dtype: torch.dtype, length: int, *, factor: float = 2.0) -> dict:
    """rtol = atol = factor · length · eps(dtype): the worst-case rounding difference of two
    orders of a length-term reduction, for torch.testing.assert_close(**reduction_tol(...))."""
    tol = factor * max(int(length), 1) * torch.finfo(dtype).eps
    return {"rtol": tol, "atol": tol}


def model_reduction_length(config) -> int:
    """The reductions one logit of a Transformer goes through, end to end: per layer the
    attention (head dim, then T positions), the router and the experts (h, then s), and
    the LM head (h); a PEER layer's experts sum over its k = H kappa single neurons."""
    moe = config.moe
    width = getattr(moe, "width", None) or moe.top_k
    per_layer = config.dim_per_head + config.max_seq_len + 2 * moe.hidden + width
    return config.layers * per_layer + moe.hidden
