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


def another_blas(monkeypatch, seed):
    """F.linear as another machine's BLAS might sum: each fp32 result moved by up to 2^-20
    of itself (well inside the error bound of the sums the routers do)."""
    plain = torch.nn.functional.linear
    g = torch.Generator().manual_seed(seed)

    def linear(a, w, b=None):
        y = plain(a, w, b)
        if y.dtype != torch.float32:
            return y
        noise = (torch.rand(y.shape, generator=g) * 2 - 1) * 2.0 ** -20
        return y * (1 + noise)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
