"""From a trained MoE to MoRE: factor every router of a transformers MoE model into
R1 (E × r) · R2 (r × h) and measure, on the hidden states each router actually sees, how
often the top-k set survives.

Covers the architectures whose routers are `mlp.gate` modules (Mixtral's are
`block_sparse_moe.gate` before transformers 5) with a weight (E, h) and whose config names
k `num_experts_per_tok`: Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3 (and others shaped like
them), as far as the installed transformers has them. The inputs of each gate are captured
by forward hooks while the model runs on the user's tokens. The agreement is on the top-k
of the raw logits x Wᵀ: models that add a score bias or group-limited routing (DeepSeek-V3)
select from the same logits after a monotone map per expert, which this measure does not
model. write_factors makes the model route as its rank-r factorisation does (W replaced by
R1 R2, the architecture unchanged) and lm_loss measures what that costs.
Letters: N tokens, h hidden, E (M elsewhere) experts, k active, r rank.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..nn.router import factor_router, topk_agreement
from ..report import save_figure
from ..runtime import progress_bar


GATE_NAMES = ("mlp.gate", "block_sparse_moe.gate")


def find_routers(model) -> list[tuple[str, torch.Tensor]]:
    """(module name, weight (E, h)) of every router gate, in layer order."""
    found = [(name, mod.weight) for name, mod in model.named_modules()
             if name.endswith(GATE_NAMES) and getattr(mod, "weight", None) is not None
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
def capture_router_inputs(model, input_ids: torch.Tensor, *, batch: int = 8,
                          progress: bool = False) -> dict:
    """Each gate's input hidden states (N, h) on the token sequences input_ids (B, T)
    (progress: a bar over the sequences on stderr)."""
    names = [name for name, _ in find_routers(model)]
    modules = dict(model.named_modules())
    seen = {name: [] for name in names}
    hooks = [modules[name].register_forward_pre_hook(
        lambda mod, args, name=name: seen[name].append(args[0].reshape(-1, args[0].shape[-1])
                                                        .float().cpu()))
             for name in names]
    try:
        model.eval()
        bar = progress_bar(input_ids.shape[0], desc="running the model", enabled=progress)
        for b0 in range(0, input_ids.shape[0], batch):
            model(input_ids=input_ids[b0:b0 + batch])
            bar.update(min(batch, input_ids.shape[0] - b0))
        bar.close()
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(parts) for name, parts in seen.items()}


def convert_routers(model, inputs: dict, ranks: list[int], *, method: str = "svd",
                    progress: bool = False) -> dict:
    """Per layer and rank: the float32 factors, and the top-k agreement of the factorisation
    with the original router, measured in float64 (float32 rounding would reorder near-tied
    logits even at full rank). progress: a bar over the routers on stderr."""
    k = top_k_of(model)
    layers, factors = [], {}
    routers = find_routers(model)
    bar = progress_bar(len(routers), desc="factoring routers", enabled=progress)
    for name, weight in routers:
        W = weight.detach().double().cpu()
        x = inputs[name].double()
        full = (x @ W.T).topk(k, dim=1).indices
        row = {"layer": name, "experts": W.shape[0], "hidden": W.shape[1], "tokens": x.shape[0],
               "ranks": []}
        for r in ranks:
            if r > min(W.shape):
                raise ValueError(f"--rank {r} exceeds min(experts, hidden) = {min(W.shape)} of "
                                 f"{name}")
            R1, R2 = factor_router(W, r, method, dtype=torch.float64)
            same, overlap = topk_agreement(((x @ R2.T) @ R1.T).topk(k, dim=1).indices, full)
            row["ranks"].append({"rank": r, "set_agreement": same, "mean_overlap": overlap,
                                 "rel_error": float((R1 @ R2 - W).norm() / W.norm())})
            factors.setdefault(r, {})[f"{name}.R1"] = R1.float().contiguous()
            factors[r][f"{name}.R2"] = R2.float().contiguous()
        layers.append(row)
        bar.update()
    bar.close()
    return {"top_k": k, "method": method, "layers": layers, "factors": factors}


@torch.no_grad()
def lm_loss(model, input_ids: torch.Tensor, *, batch: int = 8) -> float:
    """The mean next-token cross-entropy of the model over the sequences input_ids (B, T)."""
    total, count = 0.0, 0
    model.eval()
    for b0 in range(0, input_ids.shape[0], batch):
        ids = input_ids[b0:b0 + batch]
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += float(model(input_ids=ids, labels=ids).loss) * n
        count += n
    return total / max(count, 1)


@torch.no_grad()
def write_factors(model, factors: dict) -> int:
    """Replace every router's weight W (E, h) with R1 R2 from factors ({name.R1, name.R2},
    one rank), in W's dtype: the architecture keeps its (E, h) gate, so transformers loads
    the result with no moremoe code, and it routes as the rank-r router does. Returns the
    number of routers replaced."""
    routers = find_routers(model)
    for name, weight in routers:
        R1, R2 = factors[f"{name}.R1"], factors[f"{name}.R2"]
        weight.copy_((R1.double() @ R2.double()).to(weight.dtype))
    return len(routers)


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
    return save_figure(fig, path)
