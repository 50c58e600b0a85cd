"""optim.grads=bf16: the parameters' .grad in bfloat16 (fp32 master weights, bf16 AdamW
moments), one process: the update reads bf16 gradients, the loss follows the fp32 run, the
memory plan counts 2 bytes a gradient, and the layouts it cannot serve are one-line errors."""
import json

import pytest
import torch

from moremoe.training import footprint
from moremoe.training.compose import build_run_config
from moremoe.training.config import OptimSpec
from moremoe.training.lm import train
from moremoe.training.optim import set_grad_dtype

from runs import quiet

SETS = ["model.seq_len=32", "train.batch_size=4", "train.grad_accum=2", "train.log_every=1",
        "train.eval_every=100", "train.eval_batches=1", "train.ckpt_every=100",
        "train.max_steps=6", "optim.moments=bf16"]


def _losses(out):
    lines = (out / "log.jsonl").read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e["event"] == "train"]


def test_bf16_gradients_reach_the_update_and_follow_the_fp32_run(text_data, tmp_path,
                                                                  monkeypatch):
    import moremoe.training.lm as lm
    seen, real = [], lm.clipped_step
    monkeypatch.setattr(lm, "clipped_step",
                        lambda opt, grads, *a: seen.append({g.dtype for g in grads})
                        or real(opt, grads, *a))
    for grads in ("bf16", "fp32"):
        cfg = build_run_config(preset="tiny-more", data=str(text_data), device="cpu",
                               out=str(tmp_path / grads), overrides=SETS + [f"optim.grads={grads}"])
        train(cfg, echo=quiet)
    assert seen[0] == {torch.bfloat16} and seen[-1] == {torch.float32}
    got, want = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp32")
    assert len(got) == 6 and got[0] == pytest.approx(want[0], rel=1e-6)   # same first loss
    assert got != want                                     # the update saw other gradients
    assert got == pytest.approx(want, rel=2e-2)            # and follows the same curve
    start = json.loads((tmp_path / "bf16" / "log.jsonl").read_text().splitlines()[0])
    assert start["memory"]["grads"] == "bf16"


def test_bf16_gradients_halve_the_planned_gradient_bytes():
    plans = {}
    for grads in ("fp32", "bf16"):
        cfg = build_run_config(preset="h512-s64-more1792", overrides=[
            "optim.moments=bf16", f"optim.grads={grads}"])
        plans[grads] = footprint.memory_plan(cfg, cfg.model.transformer_config(50257),
                                             torch.device("cpu"), have=2**40)
    n = sum(p.params for p in plans["fp32"].parts)
    assert plans["fp32"].state_bytes() - plans["bf16"].state_bytes() == 2 * n
    assert "grads (bf16)" in plans["bf16"].table()


@pytest.mark.parametrize("sets, words", [
    ({"grads": "fp16"}, "optim.grads must be one of fp32, bf16"),
    ({"grads": "bf16"}, "needs optim.moments=bf16"),
    ({"grads": "bf16", "moments": "bf16", "expert_grads": "in_place"}, "expert_grads=auto or autograd"),
])
def test_what_bf16_gradients_cannot_serve_is_named(sets, words):
    with pytest.raises(ValueError, match=words):
        OptimSpec(**sets)


def test_bf16_gradients_are_one_process():
    with pytest.raises(ValueError, match="parallel.reduce_dtype=bf16"):
        set_grad_dtype(torch.nn.Linear(2, 2), "bf16", world=2)


def test_bf16_gradients_resume_exactly(text_data, tmp_path):
    """Stopped at step 2 and resumed: the losses of the run that never stopped (loading the
    optimizer state made fp32 gradients for parameters whose .grad is bf16, and failed)."""
    sets = SETS + ["optim.grads=bf16", "train.ckpt_every=2"]
    kw = dict(preset="tiny-more", data=str(text_data), device="cpu")
    train(build_run_config(out=str(tmp_path / "whole"), overrides=sets, **kw), echo=quiet)
    cut = tmp_path / "cut"
    train(build_run_config(out=str(cut), overrides=sets, stop_step=2, **kw), echo=quiet)
    train(build_run_config(out=str(cut), overrides=sets, **kw), resume=True, echo=quiet)
    assert _losses(cut) == pytest.approx(_losses(tmp_path / "whole"), rel=1e-6)


def test_bf16_gradients_leave_the_compiled_graph_whole(text_data, tmp_path):
    """Under torch.compile the bf16 .grad of the second micro-step's parameters is hidden
    from TorchDynamo, which otherwise breaks the graph on them and compiles the frames below
    one by one (the fused kernels' launchers among them: a crash on the GPU)."""
    import torch._inductor.config
    from torch._dynamo.utils import counters
    torch._dynamo.reset()       # a fresh `moremoe train`'s state, not earlier tests' graphs
    counters.clear()
    cfg = build_run_config(preset="tiny-more", data=str(text_data), device="cpu",
                           out=str(tmp_path / "run"),
                           overrides=SETS[:-2] + ["train.max_steps=1", "train.compile=true",
                                                  "optim.moments=bf16", "optim.grads=bf16"])
    # what is asserted is the graph, not inductor's C++: compiled without SIMD code, which
    # g++ failed on in the lowest versions' suite ("at::vec has not been declared")
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        train(cfg, echo=quiet)
    reasons = " ".join([*counters["graph_break"], *counters["unimplemented"]])
    assert "between tensor and its gradient" not in reasons
    assert len(_losses(tmp_path / "run")) == 1
