"""The optimiser and schedule of every trainer (paper Appendix C): AdamW with decoupled weight
decay on every matrix (embeddings, attention, experts, routers) and none on the RMSNorm
scales, the router weights (W, or R1 and R2; PEER's query networks and sub-keys) in a group
of their own (at router_lr, default lr), and a cosine learning rate after a linear warmup.

optim.moments=bf16 keeps AdamW's two moments in bfloat16: 4 bytes of optimizer state a
parameter instead of 8, the fp32 weights staying the master copy. On a GPU (update=auto)
``SplitAdamW`` updates the tensors of at least 2^22 elements (the expert banks, the
embedding and the head) by one Triton pass each with bf16 moments and the small ones by
torch's fused AdamW with fp32 moments (a few MB); elsewhere ``LowPrecisionAdamW`` keeps
every moment in bf16, one pass a parameter (ops/adamw.py). Its measured effect on the
loss: benchmarks/NOTES.md (issues 27 and 36).

With fp32 moments on a GPU (optim.update=auto) the update is chosen by size, from the
measured step (benchmarks/NOTES.md, issue 27: MoRE-1792's norm, clip and AdamW 21.3 ms with
the one-pass Triton update against 26.5 with torch's fused AdamW, MoE-256 6.0 against 5.0):
``SplitAdamW``, torch's fused AdamW for the many small tensors (its multi-tensor launches)
and the one-pass update for tensors of at least 2^22 elements (the expert banks), where the
bytes a parameter (32 against 36: the fused update writes the scaled gradient back)
outweigh a launch each.

``clipped_step`` folds the global-norm clip into the update: the clip coefficient is a
device scalar that the update multiplies each gradient by as it reads it (torch's fused
AdamW: as its grad_scale), so no pass writes the clipped gradients before the update."""
from __future__ import annotations

import math

import torch

from ..nn.experts import SwiGLUExperts
from ..nn.peer import PEERLayer
from ..ops.adamw import CHUNK, adamw_
from .config import UPDATES
from ..ops.dispatch import resolve_impl
from ..nn.router import LinearRouter, LowRankRouter

ROUTERS = (LinearRouter, LowRankRouter)


def param_groups(model: torch.nn.Module, *, lr: float, weight_decay: float,
                 router_lr: float | None = None) -> list[dict]:
    """decay (matrices), no_decay (norm scales), router (router matrices, at router_lr)."""
    router = {id(p) for m in model.modules() if isinstance(m, ROUTERS) for p in m.parameters()}
    router |= {id(p) for m in model.modules() if isinstance(m, PEERLayer)
               for p in (m.query.weight, m.keys)}
    groups = {"decay": [], "no_decay": [], "router": []}
    for p in (p for p in model.parameters() if p.requires_grad):
        key = "router" if id(p) in router else ("decay" if p.dim() >= 2 else "no_decay")
        groups[key].append(p)
    lrs = {"decay": lr, "no_decay": lr, "router": router_lr if router_lr is not None else lr}
    wds = {"decay": weight_decay, "no_decay": 0.0, "router": weight_decay}
    return [{"name": k, "params": v, "lr": lrs[k], "weight_decay": wds[k]}
            for k, v in groups.items() if v]


def make_optimizer(model: torch.nn.Module, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                   weight_decay: float = 0.01, router_lr: float | None = None,
                   fused: bool = False, moments: str = "fp32", capturable: bool = False,
                   update: str = "auto", grads: str = "fp32") -> torch.optim.Optimizer:
    """AdamW over param_groups (fused: the one-kernel implementation; capturable: its step
    may be captured in a CUDA graph); update="auto" with fused and fp32 gradients:
    SplitAdamW (the large tensors by the one-pass update, their moments in `moments`; the
    small ones by torch's fused AdamW, fp32 moments), "fused": torch's fused AdamW for every
    tensor; moments="bf16" otherwise (bf16 gradients among them, which torch's fused AdamW
    does not read beside fp32 weights): LowPrecisionAdamW, every moment in bfloat16."""
    groups = param_groups(model, lr=lr, weight_decay=weight_decay, router_lr=router_lr)
    if moments not in ("fp32", "bf16"):
        raise ValueError(f"moments must be fp32 or bf16, got {moments!r}")
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
    big = torch.bfloat16 if moments == "bf16" else torch.float32
    if fused and not capturable and update == "auto" and grads == "fp32":
        return SplitAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, big_moments=big)
    if moments == "bf16":
        return LowPrecisionAdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps,
                             **({"fused": True} if fused else {}),
                             **({"capturable": True} if capturable else {}))


def set_grad_dtype(model: torch.nn.Module, grads: str, world: int) -> None:
    """optim.grads: "bf16" makes autograd produce and accumulate every trainable parameter's
    .grad in bfloat16 (Tensor.grad_dtype; the fp32 weights stay the master copy), one
    process only: DDP's buckets and FSDP2's reduce-scatter hold the parameters' dtype.
    Called after an optimizer state is loaded: torch's loader makes the state by a step
    over fp32 zero gradients, which a bf16 grad_dtype refuses."""
    if grads == "fp32":
        return
    if world > 1:
        raise ValueError(f"optim.grads=bf16 trains one process ({world} ranks here: DDP's "
                         f"buckets and FSDP2 reduce in the parameters' dtype); under torchrun "
                         f"use --set parallel.reduce_dtype=bf16 for bf16 traffic")
    if not hasattr(torch._C.TensorBase, "grad_dtype"):
        raise ValueError(f"optim.grads=bf16 needs Tensor.grad_dtype, which torch "
                         f"{torch.__version__} lacks; use optim.grads=fp32")
    for p in model.parameters():
        if p.requires_grad:
            p.grad_dtype = torch.bfloat16


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class SplitAdamW(torch.optim.AdamW):
    """torch's fused AdamW, except for the tensors of at least BIG elements, which the
    one-pass update of ops/adamw.py takes (the same arithmetic; a clip set as torch's
    grad_scale is read as its reciprocal coefficient, the gradient not written back), their
    moments in big_moments: fp32, or bf16 (optim.moments=bf16: the expert banks, the
    embedding and the head, 99.5 % of MoRE-1792's parameters, at 4 bytes of state a
    parameter; the small tensors, 9.6M, keep fp32 moments in torch's few multi-tensor
    launches, where one launch a tensor was exposed after the step's host sync). The state
    is torch's (its keys; the large tensors' step counter on the host, no read back per
    tensor), so checkpoints load into either class and into LowPrecisionAdamW, each moment
    cast to its tensor's dtype here."""

    BIG = 1 << 22

    def __init__(self, params, big_moments: torch.dtype = torch.float32, **kw):
        super().__init__(params, fused=True, **kw)
        self.big_moments = big_moments

    def _big(self, p: torch.Tensor) -> bool:
        return p.numel() >= self.BIG

    @torch.no_grad()
    def step(self, closure=None):
        held = [(p, p.grad) for g in self.param_groups for p in g["params"]
                if p.grad is not None and self._big(p)]
        for p, _ in held:                 # torch's fused step skips a tensor without .grad
            p.grad = None
        try:
            loss = super().step(closure)
        finally:
            for p, g in held:
                p.grad = g
        scale = getattr(self, "grad_scale", None)
        coef = None if scale is None else scale.reciprocal()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self._big(p):
                    _one_pass(self.state[p], p, group, coef, self.big_moments)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load for the small tensors (fp32 moments); the large ones' moments cast to
        big_moments and moved to their device one by one (no fp32 copy of them all)."""
        if self.big_moments == torch.float32:
            return super().load_state_dict(state_dict)
        _load_moments_apart(self, state_dict, self._big, self.big_moments)


def _load_moments_apart(opt: torch.optim.Optimizer, state_dict: dict, apart, dtype) -> None:
    """torch's load of state_dict into opt, except the states of the parameters p with
    apart(p): their moments cast to dtype and moved to p's device one by one (torch's
    loader casts every state tensor to its parameter's dtype, all at once)."""
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    own = {i: p for i, p in zip(ids, params) if apart(p)}
    saved = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(
        opt, {**state_dict, "state": {i: v for i, v in saved.items() if i not in own}})
    for i, p in own.items():
        if i in saved:
            opt.state[p] = {k: v if k == "step" else v.to(device=p.device, dtype=dtype)
                            for k, v in saved[i].items()}


def _one_pass(state: dict, p: torch.Tensor, group: dict, coef: torch.Tensor | None,
              moment_dtype: torch.dtype, chunk: int = CHUNK) -> None:
    """One parameter's AdamW update by ops/adamw.py, its state under torch's keys: the step
    counter on the host (a checkpoint's device counter is moved there: no read back a
    parameter), the moments in moment_dtype."""
    if not state:
        state["step"] = torch.tensor(0.0)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(p, dtype=moment_dtype)
    if state["step"].device.type != "cpu":      # a checkpoint of torch's fused AdamW
        state["step"] = state["step"].cpu()
    state["step"] += 1
    (beta1, beta2), t = group["betas"], float(state["step"])
    w, g, m, v = (_local(x) for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
    adamw_(w, g, m, v, lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
           weight_decay=group["weight_decay"], step=t, coef=coef, chunk=chunk)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """torch's AdamW update (decoupled weight decay, bias-corrected moments), step for step,
    with the moments exp_avg and exp_avg_sq stored in ``moment_dtype``: each update reads
    them into fp32, updates them and the fp32 parameters, and rounds them back (to nearest).
    Each parameter's update is one pass of ops/adamw.py (the Triton kernel on a GPU; on a
    CPU torch's ops in slices of at most CHUNK elements, so that their fp32 temporaries stay
    a few hundred MB whatever the largest parameter: an expert bank of MoRE-8192 has 1.3G
    elements). step(grad_coef=c) reads every gradient times the device scalar c (the clip).
    State keys and the step counter are torch's, so checkpoints read like AdamW's."""

    CHUNK = 1 << 25

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, moment_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.moment_dtype = moment_dtype

    @torch.no_grad()
    def step(self, closure=None, *, grad_coef: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _one_pass(self.state[p], p, group, grad_coef, self.moment_dtype,
                              self.CHUNK)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every state tensor to its parameter's dtype (fp32 here, and all
        of them at once: 8 bytes a parameter more at a resume); the moments stay in
        moment_dtype, moved to their parameter's device one by one."""
        _load_moments_apart(self, state_dict, lambda p: True, self.moment_dtype)


def _fused_banks(model: torch.nn.Module) -> list[SwiGLUExperts]:
    return [m for m in model.modules() if isinstance(m, SwiGLUExperts)
            and resolve_impl(m.impl, m.w_gate) == "triton"]


def in_place_expert_banks(model: torch.nn.Module) -> list[SwiGLUExperts]:
    """Every expert bank of the model that trains with the fused kernels where its weights
    are (impl "auto" on CUDA; "triton", also in the CPU interpreter), set to accumulate its
    weight gradients into .grad in its backward (nn/experts.py); the caller's zero_grads
    restarts them."""
    banks = _fused_banks(model)
    for m in banks:
        m.accumulate_grads_in_place()
    return banks


def in_place_bank_names(model: torch.nn.Module) -> list[str]:
    """The parameter names of the weights in_place_expert_banks(model) would take (for DDP
    to leave out of its buckets: their gradients are all-reduced after the backward)."""
    own = {id(w) for m in _fused_banks(model) for w in m.weights()}
    return [name for name, p in model.named_parameters() if id(p) in own]


class HiddenGrads:
    """optim.grads=bf16 under torch.compile: the parameters' bf16 .grad taken off them for
    the forward and put back before the backward accumulates into them. TorchDynamo cannot
    trace a parameter whose .grad has another dtype ("Inconsistent dtype between tensor and
    its gradient"): it breaks the graph there, and then compiles the frames under the break
    one by one, the fused kernels' launchers among them (a crash in Inductor's copy of a
    Triton kernel, measured on an H200). The forward never reads .grad."""

    def __init__(self, model: torch.nn.Module, active: bool):
        self.params = ([p for p in model.parameters()
                        if getattr(p, "grad_dtype", None) not in (None, p.dtype)]
                       if active else [])
        self.grads: list = []

    def __enter__(self):
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return self

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.grads = []
        return False


@torch.no_grad()
def zero_grads(opt: torch.optim.Optimizer, model: torch.nn.Module, banks: list,
               *, keep_allocated: bool) -> None:
    """Between steps: every .grad freed, or (keep_allocated) kept and zeroed in place, except
    the in-place banks' weights, whose buffers are restarted (their next backward stores
    over the old values) and made the .grad again."""
    if not keep_allocated:
        opt.zero_grad(set_to_none=True)
    else:
        own = {id(w) for m in banks for w in m.weights()}
        grads = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in own:
                if p.grad is None:
                    dtype = getattr(p, "grad_dtype", None) or p.dtype   # optim.grads
                    p.grad = torch.zeros_like(p, dtype=dtype)
                grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)
    for m in banks:
        m.restart_grads()


@torch.no_grad()
def clipped_step(opt: torch.optim.Optimizer, grads: list[torch.Tensor], norm: torch.Tensor,
                 max_norm: float) -> None:
    """opt.step() on the gradients times torch's clip_grad_norm_ coefficient
    min(1, max_norm / (norm + 1e-6)) (norm: the global 2-norm, a device scalar; max_norm inf:
    no clip), read by the update itself where it can (LowPrecisionAdamW's grad_coef, torch's
    fused AdamW's grad_scale = 1 / coefficient, which writes the scaled gradient back in
    the same pass); otherwise (torch's foreach AdamW, FSDP2's DTensor parameters under the
    fused one) one multiply over the gradients first, as clip_grad_norm_ does."""
    if max_norm == float("inf") or not grads:
        opt.step()
        return
    coef = (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)
    if isinstance(opt, LowPrecisionAdamW):
        opt.step(grad_coef=coef)
    elif opt.defaults.get("fused") and not any(hasattr(g, "to_local") for g in grads):
        opt.grad_scale = coef.reciprocal().reshape(())
        try:
            opt.step()
        finally:
            del opt.grad_scale
    else:
        local = [_local(g) for g in grads]        # FSDP2's shards: the global coefficient
        torch._foreach_mul_(local, coef.to(local[0].device))
        opt.step()


def cosine_with_warmup(total: int, warmup_frac: float, min_frac: float):
    """LR factor for the (i+1)-th step: linear warmup, then cosine down to min_frac."""
    warm = max(1, round(warmup_frac * total)) if warmup_frac > 0 else 0

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        progress = min(1.0, (i - warm) / max(1, total - warm))
        return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
