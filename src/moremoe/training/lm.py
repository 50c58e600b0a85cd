"""Language-model pretraining of the MoE / MoRE transformer (paper Section 4.2, Appendix C.2).

Recipe: AdamW (β = 0.9, 0.95, ε = 1e-8) with decoupled weight decay 0.01 on every matrix
(embeddings, attention, experts, routers) and none on the RMSNorm scales; the router weights
(W, or R1 and R2) in their own group at optim.router_lr (default: lr, the paper's choice);
cosine learning rate after a linear warmup over 5 % of the steps; global grad-norm clipping
at 1.0; bf16 autocast on CUDA; loss = LM loss + balance_coef · Switch loss (computed per
micro-batch and rank); gradient accumulation (DDP syncs only on the last micro-step).

Runs on CPU, one GPU, or several through torchrun (parallel/ddp.py). The run directory holds
log.jsonl (one event per line), summary.json and checkpoints/ (training/checkpoint.py
writes them, model/checkpoint.py reads them).
A stop (steps, --max-minutes, Ctrl-C or SIGTERM) checkpoints and writes the summary; a
crash outside the optimizer update does the same before it re-raises. A resumed run
continues bit for bit as the uninterrupted one would have (on the same device and threads).
"""
from __future__ import annotations

import contextlib
import math
import signal
from pathlib import Path

import numpy as np
import torch

from ..checks import UserError
from ..eval.perplexity import evaluate_perplexity
from ..eval.routing import normalized_entropy
from ..model import Transformer, checkpoint as stored
from ..parallel import ddp, expert_plan, fsdp, plan
from ..report import check_output_dir, write_json
from ..runtime import autocast_dtype, environment
from ..tasks.text import open_tokens, read_meta
from . import checkpoint as ckpt, footprint, run_plot
from .config import RunConfig, check_impls, default_out, planned_steps
from .data import Batches, check_ids, check_same_data, data_record, rows_of
from .metrics import (ExpertCoverage, RunLog, StepClock, StepProfiler, echo_line, peak_tflops,
                      printer)
from .bank_sync import BankSync, in_place_plan
from .optim import (HiddenGrads, clipped_step, cosine_with_warmup, in_place_expert_banks,
                    make_optimizer, set_grad_dtype, zero_grads)
from .signals import StopSignals, exit_status

class NonFiniteStep(UserError):
    """A training step whose loss or gradient norm is NaN or infinite (train.nan_policy)."""


class LMTrainer:
    """One pretraining run; ``run()`` trains, evaluates, checkpoints and returns the summary."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, force: bool = False,
                 echo=None):
        self.cfg, t = cfg, cfg.train
        if t.data is None:
            raise ValueError("train.data is not set: pass --data DIR (a directory from "
                             "`moremoe data prepare`)")
        self.info = ddp.init(t.device)
        expert_plan.check_layout(cfg.parallel.expert, experts=cfg.model.experts,
                                 kind=cfg.model.kind, world=self.info.world)
        self.dev, self.main = self.info.device, self.info.main
        check_impls(cfg.model, self.dev)       # a kernel this device cannot run: no file yet
        self.compile_mode = plan.compile_mode(  # a mode that cannot run stops before any work
            t.compile_mode if t.compile else "default", self.dev, self.info.world,
            data=cfg.parallel.data)
        plan.check_bucket(cfg.parallel.bucket_mb, compiled=t.compile, world=self.info.world,
                          data=cfg.parallel.data)
        self.out = Path(t.out or default_out(cfg))
        if self.main:                                       # before any data is read
            held = ckpt.check_run_dir(self.out, force=force, writes=ckpt.run_writes(t))
            check_output_dir(self.out, "--out (train.out)")
        self.echo = (echo or printer()) if self.main else (lambda text: None)
        self._load_data()
        self._build()
        if self.main and force and held:    # a run's files: a folder without one loses none
            ckpt.clear_run(self.out)
        self.log = RunLog(self.out, enabled=self.main, tensorboard=t.tensorboard)
        self._plot_failed = False
        self.coverage = ExpertCoverage()
        self._resume_or_start(resume)

    # ------------------------------------------------------------------ set-up
    def _load_data(self) -> None:
        t, m = self.cfg.train, self.cfg.model
        self.meta = read_meta(t.data)
        self.vocab = m.vocab if m.vocab is not None else int(self.meta["vocab_size"])
        if int(self.meta["vocab_size"]) > self.vocab:
            raise ValueError(f"model.vocab={self.vocab} is smaller than the data's "
                             f"vocab_size={self.meta['vocab_size']}")
        train_rows = rows_of(open_tokens(t.data, "train"), m.seq_len)
        self.batches = Batches(train_rows, batch_size=t.batch_size, world=self.info.world,
                               grad_accum=t.grad_accum, seed=t.seed, vocab=self.vocab,
                               source=str(Path(t.data) / "train.bin"))
        val = rows_of(open_tokens(t.data, "val"), m.seq_len)
        world = self.info.world         # every rank gets the same number of rows (or none)
        n = min(val.shape[0], t.eval_batches * t.batch_size * world) // world * world
        self.val_rows = val[:n]
        check_ids(np.asarray(self.val_rows), self.vocab, str(Path(t.data) / "val.bin"))
        self.total = planned_steps(self.cfg, self.batches.global_batch)
        self.tokens_per_step = self.batches.global_batch * m.seq_len
        self.data = data_record(self.meta, t.data, train_rows.size, val.size)

    def _build(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        self.model_config = cfg.model.transformer_config(self.vocab)
        world = self.info.world
        self.memory = footprint.memory_plan(cfg, self.model_config, self.dev, world=world)
        self.echo(self.memory.table())
        footprint.check_fits(self.memory, self.model_config.total_params(), self.dev, world,
                             options=footprint.shrink_options(cfg, self.dev, world))
        with torch.device(self.dev):   # a CPU core takes over a minute for 7.9B weights
            self.model = Transformer(self.model_config)
        self.model.fuse_head_and_loss(cfg.train.fused_loss)
        self._pending = None        # a checkpoint's optimizer and scheduler, once they exist
        self.amp = autocast_dtype(self.dev) if cfg.train.autocast else None
        self.flops_per_token = self.model_config.training_flops_per_token(cfg.model.seq_len)
        self.peak = peak_tflops(self.dev, cfg.train.peak_tflops)
        self.step, self.tokens = 0, 0
        self.skipped, self._skipped_in_a_row = 0, 0       # non-finite steps skipped

    def _wrapped(self) -> None:
        """Compile, shard or replicate over the ranks, then build the optimizer over the
        parameters as they are now (FSDP2's are shards) and load a checkpoint's states."""
        t, o, par = self.cfg.train, self.cfg.optim, self.cfg.parallel
        self.graphs = self.compile_mode in plan.CUDA_GRAPH_MODES and self.dev.type == "cuda"
        self.experts = expert_plan.ExpertPlan(self.info, par.expert) if par.expert > 1 else None
        in_place, skip = in_place_plan(self.model, self.info, o, par.data, self.experts)
        self.ddp_model = plan.parallelize(
            self.model, self.info, data=par.data, experts=self.experts, mode=self.compile_mode,
            compile_scope=t.compile_scope if t.compile else None, bucket_mb=par.bucket_mb,
            checkpointing=t.activation_checkpointing, reduce_dtype=par.reduce_dtype, ignore=skip)
        self.in_place = in_place_expert_banks(self.model) if in_place else []
        self.bank_sync = BankSync(self.model, self.in_place if skip else [], self.info)
        self.opt = make_optimizer(self.model, lr=o.lr, betas=o.betas, eps=o.eps,
                                  weight_decay=o.weight_decay, router_lr=o.router_lr,
                                  fused=self.dev.type == "cuda", moments=o.moments,
                                  update=o.update, grads=o.grads)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, cosine_with_warmup(
            self.total, o.warmup_frac, o.min_lr_frac))
        if self._pending is not None:
            state = self._pending["optimizer"]
            if self.experts is not None:
                state = self.experts.local_optim_state(state, self.model, self.opt)
            fsdp.load_optim_state(self.model, self.opt, state)
            self.sched.load_state_dict(self._pending["scheduler"])
            self._pending = None
        set_grad_dtype(self.model, o.grads, self.info.world)  # after the load: see optim.py
        self.hidden_grads = HiddenGrads(self.model, active=t.compile)
        self._zero_grads()

    def _zero_grads(self) -> None:
        """Free the gradients; under CUDA graphs keep them allocated and zero them in place:
        a .grad that autograd took over from a backward graph's output (it does when .grad is
        None) is overwritten by the next micro-step's replay (pytorch #169545). The expert
        banks that accumulate in place restart instead (no zeroing pass)."""
        zero_grads(self.opt, self.model, self.in_place, keep_allocated=self.graphs)

    def _resume_or_start(self, resume: bool) -> None:
        latest = stored.latest_checkpoint(self.out)
        broken = stored.incomplete_checkpoints(self.out)
        held_by_run = latest is not None or broken or ckpt.has_steps(self.out)
        if not resume and held_by_run and self.main:    # (the other ranks see rank 0's log)
            held = (f"checkpoints (latest {latest.name})" if latest is not None else
                    "incomplete checkpoints" if broken else "the log of a run")
            raise FileExistsError(f"{self.out} already holds {held}; pass --resume to "
                                  f"continue it, --force to start over (deleting it), or "
                                  f"another --out")
        after = [b for b in broken
                 if latest is None or stored.step_of(b[0]) > stored.step_of(latest)]
        if resume and latest is None and broken:
            raise FileExistsError(f"--resume: {self.out} has no complete checkpoint; incomplete: "
                                  f"{stored.describe_incomplete(broken)}; pass --force to start "
                                  f"over (deleting them)")
        if resume and after:
            self.echo(f"warning: skipping incomplete checkpoints "
                      f"{stored.describe_incomplete(after)}; resuming from the newest complete "
                      f"one, {latest} (the steps after it are trained again)")
        self._saved_step = 0      # the step last checkpointed (a fresh start: the init's)
        self._evaluated_step, self._eval_owed = None, False   # see evaluate() and _resume()
        if resume and latest is not None:
            self._resume(latest)
        else:
            self.log.truncate_after(-1)
            self.log.write("start", step=0, config=self.cfg.to_dict(), world=self.info.world,
                           device=str(self.dev), planned_steps=self.total,
                           params=self.model_config.total_params(),
                           flops_per_token=self.flops_per_token, memory=self.memory.to_dict())
        if self.main:
            write_json(self.out / "config.json", self.cfg.to_dict())
        self._wrapped()

    def _resume(self, path: Path) -> None:
        saved = ckpt.check_resumable(path, self.cfg, self.vocab, self.meta["vocab_size"],
                                     self.model_config.to_dict())
        stored.load_weights(self.model, path)
        state = ckpt.load_state(path)
        check_same_data(state.get("data_fingerprint"), self.data, path)
        self._pending = state           # loaded into the optimizer once it is built
        self.batches.load_state_dict(state["data"])
        self.step, self.tokens = state["step"], state["tokens"]
        # a run killed in this step's scheduled evaluation saved it unevaluated: it runs first
        self._eval_owed = (state.get("evaluated", True) is False and self.step > 0
                           and self.step % self.cfg.train.eval_every == 0)
        self.coverage.load(state.get("coverage"), self.dev)
        self._saved_step = self.step
        rngs = state.get("rng") or []
        if rngs:
            ckpt.set_rng_state(rngs[self.info.rank % len(rngs)])
        self.log.truncate_after(self.step)
        before = planned_steps(saved, self.batches.global_batch)
        self.log.write("resume", step=self.step, checkpoint=str(path),
                       planned_steps_before=before, planned_steps=self.total,
                       world=self.info.world, memory=self.memory.to_dict())
        self.echo(f"resumed from {path} at step {self.step}/{self.total}")
        if before != self.total:
            self.echo(f"warning: the schedule now has {self.total} steps, the checkpoint's "
                      f"run planned {before}: the learning rate from step {self.step} on "
                      f"follows the new cosine, so this is not the run that was started")

    # ------------------------------------------------------------------ training
    def _micro_batch(self, micro: int) -> torch.Tensor:
        x = torch.from_numpy(self.batches.micro_batch(micro, self.info.rank))
        if self.dev.type == "cuda":
            return x.pin_memory().to(self.dev, non_blocking=True)
        return x

    def _train_step(self) -> torch.Tensor:
        """One optimizer step; returns (loss, lm_loss, aux_loss, grad_norm, 1) on the device,
        or zeros when the step was skipped (train.nan_policy=skip)."""
        accum, sums = self.cfg.train.grad_accum, torch.zeros(3, device=self.dev)
        for j in range(accum):
            x_BT = self._micro_batch(j)
            last = j == accum - 1
            if self.graphs:                 # this micro-step may overwrite the last one's outputs
                torch.compiler.cudagraph_mark_step_begin()
            self.bank_sync.arm(last)             # DDP's in-place expert gradients
            with fsdp.no_sync(self.ddp_model, self.info, last):
                with torch.autocast(device_type=self.dev.type, dtype=self.amp,
                                    enabled=self.amp is not None), self.hidden_grads:
                    out = self.ddp_model(x_BT[:, :-1], x_BT[:, 1:])
                (out.loss / accum).backward()
            self.coverage.update(out.expert_counts)
            sums += torch.stack([out.loss, out.lm_loss, out.aux_loss]).detach().float()
        if self.experts is not None:
            self.experts.reduce_gradients()
        self.bank_sync.finish()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        gnorm = (fsdp.whole(torch.nn.utils.get_total_norm(grads)) if self.experts is None
                 else self.experts.total_norm(self.model.parameters()))
        vals = torch.cat([sums / accum, gnorm.detach().float().reshape(1).to(self.dev)])
        update = self._finite(vals)
        self._lrs = {g["name"]: g["lr"] for g in self.opt.param_groups}
        self._updating = True
        if update:      # the clip read by the update itself (no pass writes the gradients)
            clipped_step(self.opt, grads, gnorm.detach(), self.cfg.optim.clip or float("inf"))
        self.sched.step()
        self.batches.advance()
        self.step, self.tokens = self.step + 1, self.tokens + self.tokens_per_step
        self._updating = False
        self._zero_grads()
        return torch.cat([vals, vals.new_ones(1)]) if update else vals.new_zeros(5)

    def _finite(self, vals: torch.Tensor) -> bool:
        """Whether this step's loss and gradient norm are finite (one read back from the
        device per step, agreed on by every rank); if not, stop (nan_policy=stop) with the
        weights of the last finite step, or skip the update (nan_policy=skip)."""
        bad = (~torch.isfinite(vals)).any().float()
        if ddp.all_reduce(bad, self.info, "max").item() == 0:
            self._skipped_in_a_row = 0
            return True
        step, t = self.step + 1, self.cfg.train
        loss, gnorm = vals[0].item(), vals[3].item()
        self.log.write("nonfinite", step=step, loss=loss, grad_norm=gnorm, policy=t.nan_policy)
        what = f"step {step}: the loss is {loss:g} and the gradient norm {gnorm:g}"
        if t.nan_policy == "skip":
            self._skipped_in_a_row += 1
            self.skipped += 1
            if self._skipped_in_a_row < t.nan_skip_limit:
                self.echo(f"warning: {what}; the update is skipped (train.nan_policy=skip)")
                return False
            what += f", the {t.nan_skip_limit}th non-finite step in a row"
        self._zero_grads()
        raise NonFiniteStep(f"{what}: the run stops with the weights of step {self.step} "
                            f"(saved, no non-finite checkpoint is written); lower optim.lr, "
                            f"or pass --set train.nan_policy=skip to skip such steps")

    def _log_train(self, acc: torch.Tensor, clock: StepClock) -> dict:
        totals = ddp.all_reduce(acc, self.info, "mean").tolist()    # waits for the GPU
        steps, seconds = clock.window()
        applied = round(totals[4])           # steps not skipped (train.nan_policy=skip)
        vals = [v / applied if applied else None for v in totals[:4]]
        tok_s = steps * self.tokens_per_step / seconds
        lrs = self._lrs
        m = {"loss": vals[0], "lm_loss": vals[1], "aux_loss": vals[2], "grad_norm": vals[3],
             "lr": lrs["decay"], "router_lr": lrs.get("router"), "tokens": self.tokens,
             "tokens_per_s": tok_s, "step_ms": 1000 * seconds / max(steps, 1),
             "mfu": self._mfu(tok_s), "skipped": steps - applied}
        self.log.write("train", step=self.step, **m)
        self.echo(echo_line(self.step, self.total, m, first=clock.steps == 1))
        return m

    def _max(self, t: torch.Tensor) -> torch.Tensor:
        return ddp.all_reduce(t, self.info, "max")

    def _mfu(self, tokens_per_s: float) -> float | None:
        if self.peak is None:
            return None
        return self.flops_per_token * tokens_per_s / (self.info.world * self.peak * 1e12)

    def evaluate(self) -> dict | None:
        """Validation loss/perplexity and H_norm per layer over the first eval_batches ×
        batch_size × world validation rows, each rank taking every world-th."""
        if self.val_rows.shape[0] == 0:
            return None
        shard = self.val_rows[self.info.rank::self.info.world]
        # compiled blocks run eagerly: a few batches do not pay for compiling no-grad graphs
        with torch.compiler.set_stance("force_eager"):
            r = evaluate_perplexity(self.model, shard, batch_size=self.cfg.train.batch_size,
                                    device=self.dev, return_counts=True)
        totals = torch.tensor([r["loss"] * r["tokens"] if r["tokens"] else 0.0, r["tokens"]],
                              dtype=torch.float64, device=self.dev)
        ddp.all_reduce(totals, self.info)
        # under expert parallelism each rank's counts are its expert group's already
        counts = [ddp.all_reduce(c.to(self.dev), self.info).cpu() // self.cfg.parallel.expert
                  for c in r["expert_counts"]]
        loss = totals[0].item() / totals[1].item()
        ev = {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": int(totals[1].item()),
              "hnorm": [normalized_entropy(c) for c in counts],
              "expert_coverage": self.coverage.fractions(self._max)}
        self.log.write("eval", step=self.step, **ev)
        self._evaluated_step = self.step
        if self.main and (why := run_plot.refresh(self.out)) and not self._plot_failed:
            self.echo(f"loss.png not rendered ({why}); training goes on")
            self._plot_failed = True
        hn = ev["hnorm"]
        self.echo(f"eval step {self.step}: val loss {loss:.4f}, ppl {ev['val_ppl']:.2f}, "
                  f"H_norm mean {np.mean(hn):.3f} [{min(hn):.3f}, {max(hn):.3f}]")
        return ev

    def save(self, *, gather: bool = True) -> Path | None:
        """Checkpoint the current step (every rank calls it; rank 0 writes), unless this
        process already saved it (a stop right after a periodic save)."""
        if self._saved_step == self.step:
            return None
        if not fsdp.all_finite(self.model, self.info, sharded=self.experts is not None):
            raise NonFiniteStep(f"step {self.step}: the weights are not finite; no checkpoint "
                                f"is written (the last one is kept)")
        rngs = ddp.gather_objects(ckpt.rng_state(), self.info) if gather else [ckpt.rng_state()]
        coverage = self.coverage.state(self._max if gather else (lambda t: t))
        sharded = fsdp.is_sharded(self.model)      # every rank takes part in gathering
        weights = fsdp.model_state(self.model) if sharded or self.main else None
        optim = fsdp.optim_state(self.model, self.opt) if sharded or self.main else None
        if self.experts is not None:
            self.experts.gather_whole(self.model, self.opt, weights, optim)
        path = None
        if self.main:
            state = {"step": self.step, "tokens": self.tokens,
                     "optimizer": optim, "scheduler": self.sched.state_dict(),
                     "data": self.batches.state_dict(), "rng": rngs,
                     "world": self.info.world, "coverage": coverage,
                     "evaluated": self._evaluated_step == self.step,
                     "data_fingerprint": self.data["fingerprint"]}
            path = ckpt.save_checkpoint(self.out, self.step, weights,
                                        model_config=self.model_config,
                                        run_config=self.cfg.to_dict(), state=state,
                                        keep=self.cfg.train.keep)
            self.log.write("checkpoint", step=self.step, path=str(path))
        self._saved_step = self.step
        if gather:
            ddp.barrier(self.info)
        return path

    def _stop_reason(self, clock: StepClock, signals: StopSignals) -> str | None:
        t = self.cfg.train
        if self.step >= self.total:
            return "max_steps"
        if t.stop_step is not None and self.step >= t.stop_step:
            return "stop_step"
        flags = [float(t.max_minutes is not None and clock.elapsed() >= 60 * t.max_minutes),
                 float(signals.requested)]           # the signal's number, or 0
        if self.info.enabled:   # every rank must stop at the same step: the ranks agree at
            if self.step % t.log_every:      # log steps, which sync anyway (a collective read
                return None                  # back every step would stall the host each step)
            flags = ddp.all_reduce(torch.tensor(flags, device=self.dev), self.info,
                                   "max").tolist()
        if flags[0] > 0:
            return "max_minutes"
        return signal.Signals(int(flags[1])).name if flags[1] > 0 else None

    def run(self) -> dict:
        t = self.cfg.train
        # the profiled steps follow the warm-up and are left out of the timing (the profiler
        # slows them and writing its table takes seconds)
        clock = StepClock(self.dev, t.timing_warmup + t.profile_steps)
        profiler = StepProfiler(self.out / "profile.txt", self.dev, t.timing_warmup,
                                t.profile_steps if self.main else 0, pause=clock.paused)
        acc = torch.zeros(5, device=self.dev)
        self._updating, reason, last_eval = False, None, None
        self.echo(f"training {self.cfg.model.name} ({self.model_config.total_params():,} "
                  f"params) on {self.dev} x{self.info.world}: step {self.step} -> {self.total}, "
                  f"{self.batches.global_batch} rows of {self.cfg.model.seq_len} per step")
        try:
            with StopSignals() as signals:
                reason = self._stop_reason(clock, signals)
                profiler.stepped(clock.steps)          # starts here when timing_warmup = 0
                if self._eval_owed:
                    with clock.paused():
                        last_eval = self.evaluate()
                while reason is None:
                    acc += self._train_step()
                    profiler.stepped(clock.steps + 1)
                    clock.stepped()
                    reason = self._stop_reason(clock, signals)
                    if self.step % t.log_every == 0 or reason is not None or clock.steps == 1:
                        self._log_train(acc, clock)
                        acc.zero_()
                    if self.step % t.eval_every == 0 or reason is not None:
                        with clock.paused():
                            last_eval = self.evaluate()
                    if self.step % t.ckpt_every == 0 or (reason and t.save_on_stop):
                        with clock.paused():
                            self.save()
        except BaseException as err:
            # keep what was trained unless the error hit the middle of an update (the
            # state is then inconsistent) or other ranks may be stuck in a collective (a
            # non-finite step is seen by every rank at once)
            with contextlib.suppress(Exception):
                if not self._updating and isinstance(err, NonFiniteStep):
                    self.save()
                elif not self._updating and not self.info.enabled:
                    self.save(gather=False)
                self._finish(clock, f"error: {type(err).__name__}: {err}", last_eval)
            raise
        finally:
            profiler.close()        # a run that stopped inside the profiled steps
        if last_eval is None:
            last_eval = self.evaluate()
        return self._finish(clock, reason, last_eval)

    def _finish(self, clock: StepClock, reason: str, last_eval: dict | None) -> dict:
        step_s = clock.mean_step_seconds()
        tok_s = self.tokens_per_step / step_s if step_s else None
        peak = (torch.cuda.max_memory_allocated(self.dev) / 2**30
                if self.dev.type == "cuda" else None)
        # every rank's, unless an error may have left the others inside a collective
        peaks = ([peak] if reason.startswith("error") else ddp.gather_objects(peak, self.info))
        summary = {
            "name": self.cfg.model.name, "preset": self.cfg.preset, "out": str(self.out),
            "device": str(self.dev), "world": self.info.world, "stopped": reason,
            "finished": reason == "max_steps", "exit_code": exit_status(reason, self.info.world),
            "skipped_steps": self.skipped,
            "step": self.step, "planned_steps": self.total, "tokens": self.tokens,
            "steps_this_run": clock.steps, "wall_s": clock.elapsed(),
            "mean_step_ms": 1000 * step_s if step_s else None,
            "timing_warmup_steps": min(clock.steps, clock.warmup),   # + profiled steps
            "tokens_per_s": tok_s, "mfu": self._mfu(tok_s) if tok_s else None,
            "peak_tflops": self.peak, "flops_per_token": self.flops_per_token,
            "compile": (f"{self.cfg.train.compile_scope}, {self.compile_mode}"
                        if self.cfg.train.compile else None),
            "params": self.model_config.total_params(),
            "tokens_per_param": self.tokens / self.model_config.total_params(),
            "epochs": self.tokens / self.data["train_tokens"], "data": self.data,
            "global_batch": self.batches.global_batch, "seq_len": self.cfg.model.seq_len,
            "val_loss": last_eval["val_loss"] if last_eval else None,
            "val_ppl": last_eval["val_ppl"] if last_eval else None,
            "hnorm": last_eval["hnorm"] if last_eval else None,
            "expert_coverage": last_eval["expert_coverage"] if last_eval else None,
            "peak_memory_gib": peaks[0],
            "peak_memory_gib_per_rank": peaks if peaks[0] is not None else None,
            **{f"env_{k}": v for k, v in environment(self.dev).items()},
        }
        if self.main:
            self.log.write("end", **summary)
            write_json(self.out / "summary.json", summary)
        self.log.close()
        return summary


def train(cfg: RunConfig, *, resume: bool = False, force: bool = False, echo=None) -> dict:
    """Run one pretraining job (joining torchrun's process group when launched by it). A
    run directory already holding a run needs resume (continue it) or force (start over)."""
    if resume and force:
        raise ValueError("give --resume (continue the run) or --force (start it over), not both")
    precision = torch.get_float32_matmul_precision()
    try:
        trainer = LMTrainer(cfg, resume=resume, force=force, echo=echo)
        if trainer.dev.type == "cuda":      # TF32 for the fp32 matmuls outside autocast
            torch.set_float32_matmul_precision("high")
        try:
            # a signal after the loop's last look (the run ends anyway) must not kill a rank
            # in its last writes; the ranks leave together once rank 0 has written them
            with StopSignals():
                summary = trainer.run()
                ddp.barrier(trainer.info)
            return summary
        finally:
            ddp.destroy(trainer.info)
    finally:      # a process that trains and then checks fp32 numerics keeps full precision
        torch.set_float32_matmul_precision(precision)
