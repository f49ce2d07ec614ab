"""The shared trainer. Reads top to bottom: build the model under its strategy (ddp | fsdp), resume from the newest
readable finished checkpoint, loop, stop (at the end, or at a checkpoint when asked to). What each part holds lives
in its own module: the strategy (trainers.strategy), the saved parts and how they are written, the position and
RNG streams (trainers.checkpoint), the data order (trainers.data), the logging (trainers.meter), the start line
(trainers.startline), the default optimizer (trainers.optimizer), the validation pass (trainers.evaluation), the
precision and math mode (trainers.perf), the DDP bucket settling (trainers.ddp_buckets)."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.runfolder import FIRST_STEP, READY, RunFolder
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError
from hpcjobs.protocol.states import FinalState, StopOutcome
from trainers import checkpoint, faults, perf, preemption, ranklog, startup, strategy, watchdog
from trainers.agreement import Agreement, Cadence
from trainers.checkpoint import saves
from trainers.checkpoint.resume import Resumed, check_compatible, lr_anchor, lr_lambda, newest_readable, trim_metrics
from trainers.checkpoint.sharded import Checkpointer
from trainers.checkpoint.state import Position, RngState, reseed, seed_all
from trainers.checkpoint.stateful import ModelState, OptimizerState, Place, Stateful
from trainers.data import micro_batches, to_device
from trainers.ddp_buckets import settle_ddp_buckets
from trainers.dist import DistContext
from trainers.evaluation import evaluate
from trainers.localtier import SHARED, LocalTier
from trainers.logtee import Tee
from trainers.meter import Meter
from trainers.optimizer import default_optimizer
from trainers.progress import summary
from trainers.startline import start_line
from trainers.task import Task

__all__ = ["Training", "default_optimizer", "train"]


SETTLE_S = 60.0
"""How long a failing start waits for its save in flight to commit before it ends (Checkpointer.settle)."""


def log(ctx: DistContext, msg: str) -> None:
    ranklog.rank0(msg, ctx.rank)  # "[hpcjobs rank 0] msg" on stdout, from rank 0 only


def train(task: Task, cfg: TrainConfig, run: RunFolder, ctx: DistContext, contract: LaunchContract | None = None,
          ) -> int:
    """Train to cfg.steps; returns the process exit code (0 also when stopped and requeued). `contract` is the
    rank's launch contract (None: the one the launcher exported, else the defaults with `run` as the run folder).
    Raises ResumeError (a ConfigError: the launcher refuses the start) when the run folder's checkpoint was written
    under other settings."""
    contract = contract or LaunchContract.current() or LaunchContract(run_dir=str(run.path))
    return Training(task, cfg, run, ctx, contract).loop()


class Training:
    """One start of a run on this rank: set up and resume when made, then `loop()` to the end or to a stop."""

    def __init__(self, task: Task, cfg: TrainConfig, run: RunFolder, ctx: DistContext,
                 contract: LaunchContract) -> None:
        self.task, self.cfg, self.folder, self.ctx, self.contract = task, cfg, run, ctx, contract
        self.t0 = time.time()
        if cfg.eval_every and task.val_data is None:
            raise ConfigError(f"--eval-every {cfg.eval_every}: task {task.name} has no validation set; valid: "
                              "--eval-every 0 for it. HINT: give the Task a val_data, or drop --eval-every")
        world = ctx.world_size
        self.micro = cfg.micro_batch(world)
        self.precision = perf.resolve_precision(cfg.precision, ctx.device)
        self.lr = cfg.lr * cfg.lr_factor(world)
        self.math = perf.configure_math(self.precision, cfg.deterministic, ctx.device)
        why = strategy.compile_unavailable(ctx.device) if cfg.compile else None
        if why:
            log(ctx, f"--compile: {why}; running eager (same results, slower). HINT: install it, or drop --compile")
            self.cfg = cfg = dataclasses.replace(cfg, compile=False)
        log(ctx, start_line(task, cfg, ctx, self.micro, self.lr, self.precision, self.math))
        # Without the frozen parameters (save_frozen=False), the model's state is partial: loaded not strictly.
        self.state_options = StateDictOptions(ignore_frozen_params=not task.save_frozen, strict=task.save_frozen)
        self.local = LocalTier(cfg.local_ckpt_every, ctx, run.path, cfg.steps)  # node-local tier: trainers.localtier
        self.build()
        self.resumed_from = self.resume()
        self.prepare()
        self.take_over_run_folder()
        startup.mark(READY)  # built, resumed (or not), data ready: the rest of start-up is the first step itself

    def build(self) -> None:
        """The model (same initial weights on every rank) under its strategy, the optimizer and the GradScaler,
        then per-rank RNG streams (dropout differs across ranks). Built again after a load that failed halfway."""
        cfg, ctx = self.cfg, self.ctx
        seed_all(cfg.seed)
        self.model = strategy.build_model(self.task.model, cfg, ctx)
        if cfg.strategy == "ddp":
            self.model.to(ctx.device)  # FSDP2 moves each unit's shard to the device as it shards it
        self.strategy = strategy.make(self.model, ctx, cfg, self.precision, self.task.parallelize)
        self.optimizer = (self.task.optimizer(self.model.parameters(), self.lr) if self.task.optimizer
                          else default_optimizer(self.model, self.lr, cfg))
        fp16 = self.precision == "fp16"
        if cfg.strategy == "fsdp":  # overflow in any rank's shard skips the step on every rank
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            self.scaler: torch.amp.GradScaler = ShardedGradScaler(ctx.device.type, enabled=fp16)
        else:
            self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=fp16)
        seed_all(cfg.seed * 100003 + ctx.rank + 1)
        self.pos = Position()
        # The plan from step 0; a resume gives it the saved run's anchor (LambdaLR saves no closure: it stays).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.dirty = False
        self.checkpointer = Checkpointer(self.folder.checkpoints, ctx, cfg.keep, self.states(), every=cfg.ckpt_every,
                                         last_step=cfg.steps)

    def states(self) -> dict[str, Stateful]:
        """What a checkpoint holds, by name (the names are the keys in its files: trainers.checkpoint.stateful)."""
        return {"model": ModelState(self.model, self.state_options),
                "optimizer": OptimizerState(self.model, self.optimizer, self.state_options),
                "scheduler": self.scheduler, "scaler": self.scaler, "position": self.pos,
                "rng": RngState(self.ctx.device)}

    def rebuild(self) -> None:
        """After a load that failed halfway: fresh weights and optimizer, as if it never happened. The old ones are let
        go first, cycles included (FSDP's hooks make some), so a rank never holds two models and two optimizers."""
        del self.model, self.strategy, self.optimizer, self.scaler, self.scheduler, self.checkpointer
        gc.collect()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        self.build()

    def resume(self) -> checkpoint.CheckpointRef | None:
        """Always try to resume: the newest finished checkpoint that every rank can read wins; its LR schedule goes
        on (re-planned only by --extend). Every rank's small files are read before any state is applied."""
        cfg, ctx = self.cfg, self.ctx

        def check(meta: dict[str, Any], where: str) -> bool:
            return check_compatible(meta, cfg, self.task, ctx.world_size, where)

        keys = self.checkpointer.names(Place.SHARED), self.checkpointer.names(Place.OWN)
        found = self.local.resume(self.folder.checkpoints, self.states(), check)  # newer than shared storage only
        self.dirty = self.local.tried
        found = found or newest_readable(self.folder, ctx, check, self.load, keys)
        if found is None and self.dirty:
            self.rebuild()
        self.anchor, note = lr_anchor(found.meta, cfg, self.lr) if found else (None, "")
        if found is None:
            log(ctx, f"no finished checkpoint in {self.folder.checkpoints}: starting at step 0")
            return None
        self.scheduler.lr_lambdas = [lr_lambda(cfg, self.anchor)] * len(self.optimizer.param_groups)  # as LambdaLR
        if not found.mine:  # resharded: the saved streams belong to other ranks (docs/how-to/fsdp.md, "Resharding")
            reseed(cfg.seed, ctx.rank, self.pos.step)
        resharded = "" if found.mine else f", resharded from {found.meta.get('world_size')} ranks"
        log(ctx, f"resumed from {found.ref.path} (step {self.pos.step}, epoch {self.pos.epoch}, micro-batch "
                 f"{self.pos.micro}){resharded}")
        self.local.say(self.pos.step)
        if note:
            log(ctx, f"schedule: {note}")
        return found.ref

    def load(self, found: Resumed) -> None:
        """Every rank: each named part from the checkpoint (the model's and optimizer's tensors read straight into
        this rank's shards). (The trainer's single-file layout, from before the sharded one, is no longer read: no
        released version wrote it.)"""
        self.dirty = True
        self.checkpointer.load(found.ref, found.shared, found.mine)

    def prepare(self) -> None:
        """Everything the loop reads: the validation set, the compiled net, the data from the resumed position."""
        cfg, ctx, task = self.cfg, self.ctx, self.task
        self.val_set = task.val_data() if cfg.eval_every and task.val_data else None
        if cfg.eval_every and self.val_set is None:
            raise ValueError(f"--eval-every {cfg.eval_every}: task {task.name}'s val_data gave no dataset")
        self.best = checkpoint.read_best(self.folder.checkpoints) if cfg.keep_best else None
        self.net = self.strategy.net
        self.agreement = Agreement(ctx.control_group)
        self.cadence = Cadence(cfg.stop_check_every, self.pos.step, ctx.control_group)
        dataset = task.train_data()
        self.data = micro_batches(dataset, ctx, cfg, self.micro, self.pos)
        low = self.precision in ("bf16", "fp16") and not self.strategy.mixed_precision  # FSDP2 casts by itself
        self.autocast = torch.autocast(ctx.device.type, dtype=torch.float16 if self.precision == "fp16" else
                                       torch.bfloat16, enabled=low)
        ddp = getattr(self.strategy, "ddp", None)
        if ddp is not None:
            # The uncompiled DDP module: its graph is the same, and compiling an eval-mode graph first would make
            # the first step compile again for train mode.
            settle_ddp_buckets(ddp, task, dataset, self.micro, ctx.device, self.autocast, self.optimizer)
        self.first_step = self.pos.step
        self.last_saved = self.pos.step if self.resumed_from is not None and self.local.used == SHARED else -1
        world = ctx.world_size
        peak = perf.peak_flops(ctx.device, self.precision, tf32=self.math == "TF32 matmuls")
        self.meter = Meter(ctx, cfg, task, self.folder, self.micro * cfg.grad_accum * world, self.pos.step,
                           Tee.active, peak_flops=peak * world if peak and task.flops_per_sample else None)

    def take_over_run_folder(self) -> None:
        """Rank 0, once this start is sure to train and before it logs anything: metrics.jsonl loses the records a
        start interrupted after its last checkpoint left past this step (never a step twice), and a final word of
        an earlier end no longer holds while the run trains again."""
        if not self.ctx.is_main:
            return
        dropped = trim_metrics(self.folder.metrics, self.pos.step)
        if dropped:
            log(self.ctx, f"metrics.jsonl: dropped {dropped} line(s) past step {self.pos.step}, logged after the "
                          "checkpoint this start resumes from (it logs those steps again)")
        if self.pos.step < self.cfg.steps:
            self.folder.final.unlink(missing_ok=True)

    def loop(self) -> int:
        cfg, pos = self.cfg, self.pos
        fault_armed = faults.armed()
        self.net.train()
        try:
            while pos.step < cfg.steps:
                self.step()
                if pos.step == self.first_step + 1:
                    self.first_step_done()
                if fault_armed:
                    faults.maybe_die("step", pos.step)
                self.after_step()
                if self.stop_agreed():
                    return self.stop()
            return self.finish()
        except BaseException:
            self.checkpointer.settle(SETTLE_S)
            raise
        finally:
            self.meter.close()

    def stop_agreed(self) -> bool:
        """Whether every rank agrees to stop at this step; asked only at the cadence's steps (the same on all)."""
        if not self.cadence.due(self.pos.step):
            return False
        if self.cadence.chosen:
            every, step_s = self.cadence.chosen
            self.cadence.chosen = None
            log(self.ctx, f"stop checks every {every} step(s) (slowest rank's step: {step_s * 1000:.1f} ms)")
        return self.agreement.any_rank_pipelined(preemption.requested_locally())

    def step(self) -> None:
        """One optimizer step: grad_accum micro-batches, gradients reduced on the last one only."""
        cfg = self.cfg
        for i in range(cfg.grad_accum):
            self.pos.epoch, self.pos.micro, batch = next(self.data)
            batch = to_device(batch, self.ctx.device)
            with self.strategy.accumulate(last=i == cfg.grad_accum - 1), self.autocast:
                loss = self.task.loss(self.net, batch) / cfg.grad_accum
            self.scaler.scale(loss).backward()
            self.meter.add(loss)
        if cfg.grad_clip > 0 or self.logs_at(self.pos.step + 1):  # the norm: to clip, else only to log it
            self.scaler.unscale_(self.optimizer)
            self.meter.grad_norm = self.strategy.clip(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        self.checkpointer.before_update()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pos.step += 1

    def first_step_done(self) -> None:
        """Start-up is over (compilation, loading, a cold node): a hung rank should now end the job quickly."""
        startup.mark(FIRST_STEP)
        startup.record(self.folder, self.ctx.env, self.first_step, resumed_tier=self.local.used)
        if self.cfg.async_save and self.checkpointer.every:
            self.checkpointer.reserve_in_background()
        seconds = self.ctx.training_timeout()
        if seconds is not None:
            log(self.ctx, f"first step done: training collectives now time out after {seconds:g} s")

    def logs_at(self, step: int) -> bool:
        return step % self.cfg.log_every == 0 or step == self.cfg.steps

    def after_step(self) -> None:
        self.checkpointer.check()
        cfg, step = self.cfg, self.pos.step
        if self.logs_at(step):
            self.meter.flush(step, float(self.scheduler.get_last_lr()[0]))
        self.meter.tick(step)
        if self.val_set is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            self.evaluate()
        if self.local.due(step):
            self.local.save(step, self.states(), self.meta)
        if self.checkpointer.should_save(step):
            self.save(background=cfg.async_save)

    def evaluate(self) -> None:
        step = self.pos.step
        val_loss = evaluate(self.model, self.task, self.val_set, self.ctx, self.micro, self.autocast)
        self.meter.record_eval(step, val_loss)
        if self.cfg.keep_best and (self.best is None or val_loss < self.best["value"]):
            self.save()  # in the foreground: best.json only ever names a committed checkpoint
            if self.ctx.is_main:
                checkpoint.mark_best(self.folder.checkpoints, step, "val_loss", val_loss)
            self.best = {"step": step, "value": val_loss}

    def save(self, background: bool = False) -> None:
        """Commit a checkpoint of this step, once: a stop or an end right after a periodic save waits for that one
        instead. In the foreground, every rank returns once it is committed."""
        began = time.time()
        if self.last_saved == self.pos.step:
            if not background:
                self.checkpointer.wait()
                self.ctx.barrier()
                saves.record(self.folder, self.ctx.env, self.pos.step, began, background)
            return
        watchdog.saving(self.pos.step)  # the hang watchdog allows for it, and bounds it
        self.checkpointer.save(self.pos.step, self.meta(), background)
        watchdog.saved(until=self.checkpointer.pending)  # a background save: in flight while its thread writes
        self.last_saved = self.pos.step
        saves.record(self.folder, self.ctx.env, self.pos.step, began, background, self.checkpointer.waited_s)

    def meta(self) -> dict[str, Any]:
        return {"config": self.cfg.as_dict(), "task": self.task.name, "task_config": self.task.config,
                "lr_anchor": list(self.anchor) if self.anchor else None}  # how a resume re-plans the schedule

    def stop(self) -> int:
        self.agreement.close()
        self.save()
        self.local.close()  # the stop's shared checkpoint is newer
        log(self.ctx, f"stop requested: checkpoint step-{self.pos.step} committed")
        self.meter.flush_rest(self.pos.step, float(self.scheduler.get_last_lr()[0]))
        self.meter.close()
        outcome = preemption.finish_stop(self.pos.step, self.contract, group=self.ctx.control_group)
        return 1 if outcome == StopOutcome.CAP else 0

    def finish(self) -> int:
        self.agreement.close()
        self.save()
        self.local.close()
        self.meter.close()
        step = self.pos.step
        if self.ctx.is_main:
            self.folder.write_final(FinalState.FINISHED, f"reached step {step}", step, job_id=self.ctx.env.job_id)
            log(self.ctx, summary(self.folder, step, self.first_step, time.time() - self.t0))
        return 0
