"""From a trained MoE to MoRE: factor every router of a transformers MoE model into
R1 (E × r) · R2 (r × h) and measure, on the hidden states each router actually sees, how
often the top-k set survives.

Covers the architectures whose routers are `mlp.gate` modules with a weight (E, h) and
whose config names k `num_experts_per_tok`: Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3 (and
others shaped like them). The inputs of each gate are captured by forward hooks while the
model runs on the user's tokens. The agreement is on the top-k of the raw logits x Wᵀ:
models that add a score bias or group-limited routing (DeepSeek-V3) select from the same
logits after a monotone map per expert, which this measure does not model.
Letters: N tokens, h hidden, E (M elsewhere) experts, k active, r rank.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..nn.router import factor_router


def find_routers(model) -> list[tuple[str, torch.Tensor]]:
    """(module name, weight (E, h)) of every router gate, in layer order."""
    found = [(name, mod.weight) for name, mod in model.named_modules()
             if name.endswith("mlp.gate") and getattr(mod, "weight", None) is not None
             and mod.weight.dim() == 2]
    if not found:
        raise ValueError("no MoE router found: expected modules named '*.mlp.gate' with a "
                         "(experts, hidden) weight (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3)")
    return found


def top_k_of(model) -> int:
    k = getattr(model.config, "num_experts_per_tok", None)
    if not k:
        raise ValueError("the model's config has no num_experts_per_tok (the router's k)")
    return int(k)


@torch.no_grad()
def capture_router_inputs(model, input_ids: torch.Tensor, *, batch: int = 8) -> dict:
    """Each gate's input hidden states (N, h) on the token sequences input_ids (B, T)."""
    names = [name for name, _ in find_routers(model)]
    modules = dict(model.named_modules())
    seen = {name: [] for name in names}
    hooks = [modules[name].register_forward_pre_hook(
        lambda mod, args, name=name: seen[name].append(args[0].reshape(-1, args[0].shape[-1])
                                                        .float().cpu()))
             for name in names]
    try:
        model.eval()
        for b0 in range(0, input_ids.shape[0], batch):
            model(input_ids=input_ids[b0:b0 + batch])
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(parts) for name, parts in seen.items()}


def _sets(logits_NE: torch.Tensor, k: int) -> torch.Tensor:
    return logits_NE.topk(k, dim=1).indices.sort(dim=1).values


def convert_routers(model, inputs: dict, ranks: list[int], *, method: str = "svd") -> dict:
    """Per layer and rank: the factors and the top-k agreement with the original router."""
    k = top_k_of(model)
    layers, factors = [], {}
    for name, weight in find_routers(model):
        W = weight.detach().float().cpu()
        x = inputs[name]
        full = _sets(x @ W.T, k)
        row = {"layer": name, "experts": W.shape[0], "hidden": W.shape[1], "tokens": x.shape[0],
               "ranks": []}
        for r in ranks:
            if r > min(W.shape):
                raise ValueError(f"--rank {r} exceeds min(experts, hidden) = {min(W.shape)} of "
                                 f"{name}")
            R1, R2 = factor_router(W, r, method)
            got = _sets((x @ R2.T) @ R1.T, k)
            overlap = (got[:, :, None] == full[:, None, :]).any(dim=2).double().mean(dim=1)
            row["ranks"].append({"rank": r, "set_agreement": float((got == full).all(1).double()
                                                                   .mean()),
                                 "mean_overlap": float(overlap.mean()),
                                 "rel_error": float((R1 @ R2 - W).norm() / W.norm())})
            factors.setdefault(r, {})[f"{name}.R1"] = R1.contiguous()
            factors[r][f"{name}.R2"] = R2.contiguous()
        layers.append(row)
    return {"top_k": k, "method": method, "layers": layers, "factors": factors}


def plot_agreement(result: dict, path: str | Path, title: str) -> Path:
    """Top-k set agreement against r, one line per layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(result["layers"])
    for i, layer in enumerate(result["layers"]):
        ranks = [r["rank"] for r in layer["ranks"]]
        ax.plot(ranks, [r["set_agreement"] for r in layer["ranks"]], marker="o",
                color=plt.cm.viridis(i / max(1, n - 1)),
                label=layer["layer"] if i in (0, n - 1) else None)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("router rank r")
    ax.set_ylabel(f"tokens with the same top-{result['top_k']} set")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
