"""The shared DDP trainer. Reads top to bottom: set up, resume from the newest readable finished checkpoint, loop,
stop (at the end, or at a checkpoint when asked to)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from hpcjobs.contract import LaunchContract
from hpcjobs.runfolder import RunFolder, append_jsonl
from hpcjobs.states import FinalState, StopOutcome
from trainers import checkpoint, faults, perf, preemption, resume, startup, tracking
from trainers.config import ConfigError, ResumeError, TrainConfig
from trainers.dist import DistContext
from trainers.logtee import Tee
from trainers.progress import Bar, Terminal, summary
from trainers.resume import check_compatible, lr_lambda
from trainers.task import Task

__all__ = ["ResumeError", "Training", "check_compatible", "lr_lambda", "train"]  # also trainers.trainer's names


@dataclass
class Position:
    """Where training stands: optimizer steps done, and the next micro-batch of which epoch to read."""

    step: int = 0
    epoch: int = 0
    micro: int = 0


def log(ctx: DistContext, msg: str) -> None:
    if ctx.is_main:
        print(f"[hpcjobs rank 0] {msg}", flush=True)


def resolve_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def default_optimizer(model: nn.Module, lr: float, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused CUDA kernel updates every parameter in one launch per group (torch's default is the foreach path).
    on_cuda = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True if on_cuda else None)


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = cast("tuple[Any, ...]", np.random.get_state())  # the legacy tuple
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():  # this rank's device only: a resume may see other GPUs (one per task)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class EpochOrder(Sampler[Any]):
    """This rank's samples of one epoch (DistributedSampler's shuffle), from micro-batch `start` on; `at()` moves it
    before each pass over the loader. With workers it yields (epoch, index) pairs for SeededSamples."""

    def __init__(self, dataset: Any, ctx: DistContext, cfg: TrainConfig, micro: int) -> None:
        self.shards: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=ctx.world_size,
                                                                  rank=ctx.rank, shuffle=True, seed=cfg.seed,
                                                                  drop_last=True)
        self.micro, self.with_epoch = micro, cfg.num_workers > 0
        self.per_epoch = len(self.shards) // micro
        if self.per_epoch == 0:
            raise ValueError(f"the dataset ({len(dataset)} samples) is too small for one micro-batch of {micro} on "
                             f"each of {ctx.world_size} ranks")
        self.epoch = self.start = 0

    def at(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start
        self.shards.set_epoch(epoch)

    def __len__(self) -> int:
        return (self.per_epoch - self.start) * self.micro

    def __iter__(self) -> Iterator[Any]:
        order = list(self.shards)[self.start * self.micro: self.per_epoch * self.micro]
        return iter([(self.epoch, i) for i in order] if self.with_epoch else order)


class SeededSamples(Dataset[Any]):
    """The dataset as worker processes read it: each sample's Python, NumPy and torch RNGs are seeded from (seed,
    epoch, index) before it is read. A worker's stream would otherwise depend on which worker got the sample and on
    how many it read before, so random augmentation would differ across worker counts and after a mid-epoch resume.
    Only used with workers: in the main process it would reset the training RNG (dropout)."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        s = int(np.random.SeedSequence([self.seed, epoch, index]).generate_state(1)[0])
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)
        return self.dataset[index]


def micro_batches(dataset: Any, ctx: DistContext, cfg: TrainConfig, micro: int, pos: Position) -> Iterator[Any]:
    """Micro-batches forever, epoch after epoch, starting exactly at `pos` (so a resume reads what comes next).
    One loader for the whole run: its workers (if any) stay up across epochs."""
    order = EpochOrder(dataset, ctx, cfg, micro)
    workers = cfg.num_workers
    loader = DataLoader(SeededSamples(dataset, cfg.seed) if workers else dataset, batch_size=micro, sampler=order,
                        drop_last=True, num_workers=workers, pin_memory=ctx.device.type == "cuda",
                        persistent_workers=workers > 0,
                        generator=torch.Generator().manual_seed(cfg.seed))  # not the global RNG: it is checkpointed
    epoch, start = pos.epoch, pos.micro
    while True:
        order.at(epoch, start)
        for i, batch in enumerate(loader, start):
            yield epoch, i + 1, batch
        epoch, start = epoch + 1, 0


def settle_ddp_buckets(net: nn.Module, task: Task, dataset: Any, micro: int, device: torch.device,
                       autocast: Any, optimizer: torch.optim.Optimizer) -> None:
    """DDP regroups its gradient buckets after the first backward, and the all-reduce sums each element in an
    order that depends on that grouping (gloo's ring with more than two ranks). A run resumed at step k would
    reduce step k+1 with the first grouping while the uninterrupted run used the regrouped one, and the weights
    would drift by a few ULPs. So every run, fresh or resumed, does one throwaway backward first (RNG states
    restored, gradients dropped): every real step then reduces with the settled grouping."""
    saved = rng_state()
    batch = to_device(next(iter(DataLoader(dataset, batch_size=micro))), device)
    net.eval()  # no running-statistics updates; the graph (and so the bucket order) is the same
    with autocast:
        loss = task.loss(net, batch)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    net.train()
    set_rng_state(saved)


def evaluate(model: nn.Module, task: Task, dataset: Any, ctx: DistContext, micro: int, autocast: Any) -> float:
    """The mean of the validation batches' losses over all ranks' shards. The training RNG streams are untouched
    (no shuffling, the loader gets its own generator) and the raw module is used (no DDP hooks), so evaluating
    changes nothing that a resumed run would have to reproduce."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                                          shuffle=False)
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, generator=torch.Generator())
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss sum, batches
    model.eval()
    with torch.no_grad(), autocast:
        for batch in loader:
            totals[0] += task.loss(model, to_device(batch, ctx.device)).double()
            totals[1] += 1
    model.train()
    if ctx.world_size > 1:
        torch.distributed.all_reduce(totals)
    return (totals[0] / totals[1]).item()


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
        device, world = ctx.device, ctx.world_size
        self.micro = cfg.micro_batch(world)
        self.precision = resolve_precision(cfg.precision, device)
        self.lr = cfg.lr * cfg.lr_factor(world)
        self.math = perf.configure_math(self.precision, cfg.deterministic, device)
        threads = torch.get_num_threads()  # trainers.dist.cpu_threads: within the CPUs this rank may run on
        log(ctx, f"task {task.name} | {world} rank(s), {ctx.backend} on {device.type}, {threads} thread"
                 f"{'s' * (threads != 1)} per rank | batch {self.micro}×"
                 f"{cfg.grad_accum} per rank, {self.micro * cfg.grad_accum * world} global | lr {cfg.lr:g} × "
                 f"{cfg.lr_factor(world):g} ({cfg.lr_scaling} scaling) = {self.lr:g} | precision {self.precision}"
                 + "".join(f", {word}" for word in (self.math, "compiled" if cfg.compile else "") if word))

        # Same initial weights on every rank, then per-rank RNG streams (dropout differs across ranks).
        seed_all(cfg.seed)
        self.model = task.model().to(device)
        self.optimizer = (task.optimizer(self.model.parameters(), self.lr) if task.optimizer
                          else default_optimizer(self.model, self.lr, cfg))
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision == "fp16")
        seed_all(cfg.seed * 100003 + ctx.rank + 1)
        self.pos = Position()
        self.resumed_from = self.resume()
        self.prepare()
        self.take_over_run_folder()

    def resume(self) -> checkpoint.CheckpointRef | None:
        """Always try to resume: the newest finished checkpoint that every rank can read wins; its LR schedule goes
        on (re-planned only by --extend). Every state is read before any is applied, and none is kept once applied
        (the loaded tensors would double the memory of the model and optimizer for the whole run)."""
        cfg, ctx = self.cfg, self.ctx

        def check(meta: dict[str, Any], where: str) -> None:
            check_compatible(meta, cfg, self.task, ctx.world_size, where)

        found = resume.newest_readable(self.folder, ctx, check)
        self.anchor, note = resume.lr_anchor(found.meta, cfg, self.lr) if found else (None, "")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.anchor))
        if found is None:
            log(ctx, f"no finished checkpoint in {self.folder.checkpoints}: starting at step 0")
            return None
        shared = found.shared
        self.model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.scaler.load_state_dict(shared["scaler"])
        self.pos = Position(**shared["position"])
        set_rng_state(found.mine["rng"])
        log(ctx, f"resumed from {found.ref.path} (step {self.pos.step}, epoch {self.pos.epoch}, micro-batch "
                 f"{self.pos.micro})")
        if note:
            log(ctx, f"schedule: {note}")
        return found.ref

    def prepare(self) -> None:
        """Everything the loop reads: the validation set, the DDP wrapper, the data from the resumed position."""
        cfg, ctx, task = self.cfg, self.ctx, self.task
        self.val_set = task.val_data() if cfg.eval_every and task.val_data else None
        if cfg.eval_every and self.val_set is None:
            raise ValueError(f"--eval-every {cfg.eval_every}: task {task.name}'s val_data gave no dataset")
        self.best = checkpoint.read_best(self.folder.checkpoints) if cfg.keep_best else None
        device, world = ctx.device, ctx.world_size
        # Gradients as views into DDP's buckets: no copy into the buckets and no second copy of the gradients.
        self.ddp = (DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True) if world > 1 else None)
        net = self.ddp or self.model
        self.net = cast(nn.Module, torch.compile(net)) if cfg.compile else net
        self.agreement = preemption.Agreement(ctx.control_group)
        self.cadence = preemption.Cadence(cfg.stop_check_every, self.pos.step, ctx.control_group)
        dataset = task.train_data()
        self.data = micro_batches(dataset, ctx, cfg, self.micro, self.pos)
        self.autocast = torch.autocast(device.type, dtype=torch.float16 if self.precision == "fp16" else
                                       torch.bfloat16, enabled=self.precision in ("bf16", "fp16"))
        if world > 1:
            # The uncompiled DDP module: its graph is the same, and compiling an eval-mode graph first would make
            # the first step compile again for train mode.
            settle_ddp_buckets(self.ddp or self.net, task, dataset, self.micro, device, self.autocast, self.optimizer)
        self.first_step = self.pos.step
        self.last_saved = self.pos.step if self.resumed_from is not None else -1
        peak = perf.peak_flops(device, self.precision, tf32=self.math == "TF32 matmuls")
        self.meter = Meter(ctx, cfg, task, self.folder, self.micro * cfg.grad_accum * world, self.pos.step,
                           Tee.active, peak_flops=peak * world if peak and task.flops_per_sample else None)

    def take_over_run_folder(self) -> None:
        """Rank 0, once this start is sure to train and before it logs anything: metrics.jsonl loses the records a
        start interrupted after its last checkpoint left past this step (never a step twice), and a final word of
        an earlier end no longer holds while the run trains again."""
        if not self.ctx.is_main:
            return
        dropped = resume.trim_metrics(self.folder.metrics, self.pos.step)
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
        """One optimizer step: grad_accum micro-batches (gradients all-reduced on the last one only)."""
        cfg = self.cfg
        for i in range(cfg.grad_accum):
            self.pos.epoch, self.pos.micro, batch = next(self.data)
            batch = to_device(batch, self.ctx.device)
            last = i == cfg.grad_accum - 1
            with (self.ddp.no_sync() if self.ddp is not None and not last else _nullcontext), self.autocast:
                loss = self.task.loss(self.net, batch) / cfg.grad_accum
            self.scaler.scale(loss).backward()
            self.meter.add(loss)
        if cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pos.step += 1

    def first_step_done(self) -> None:
        """Start-up is over (compilation, loading, a cold node): a hung rank should now end the job quickly."""
        startup.mark("first_step")
        startup.record(self.folder, self.ctx.env)
        seconds = self.ctx.training_timeout()
        if seconds is not None:
            log(self.ctx, f"first step done: training collectives now time out after {seconds:g} s")

    def after_step(self) -> None:
        cfg, step = self.cfg, self.pos.step
        if step % cfg.log_every == 0 or step == cfg.steps:
            self.meter.flush(step, float(self.scheduler.get_last_lr()[0]))
        self.meter.tick(step)
        if self.val_set is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            self.evaluate()
        if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.steps:
            self.save()

    def evaluate(self) -> None:
        step = self.pos.step
        val_loss = evaluate(self.model, self.task, self.val_set, self.ctx, self.micro, self.autocast)
        self.meter.record_eval(step, val_loss)
        if self.cfg.keep_best and (self.best is None or val_loss < self.best["value"]):
            self.save()
            if self.ctx.is_main:
                checkpoint.mark_best(self.folder.checkpoints, step, "val_loss", val_loss)
            self.best = {"step": step, "value": val_loss}

    def save(self) -> None:
        """Commit a checkpoint of this step, once: a stop or an end right after a periodic save reuses it."""
        if self.last_saved == self.pos.step:
            return
        shared_state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                        "position": vars(self.pos).copy()}
        meta = {"config": self.cfg.as_dict(), "task": self.task.name, "task_config": self.task.config,
                "lr_anchor": list(self.anchor) if self.anchor else None}  # how a resume re-plans the schedule
        checkpoint.save_checkpoint(self.folder.checkpoints, self.pos.step, shared_state, {"rng": rng_state()},
                                   rank=self.ctx.rank, world_size=self.ctx.world_size, barrier=self.ctx.barrier,
                                   keep=self.cfg.keep, meta=meta)
        self.last_saved = self.pos.step

    def stop(self) -> int:
        self.agreement.close()
        self.save()
        log(self.ctx, f"stop requested: checkpoint step-{self.pos.step} committed")
        self.meter.close()
        return 1 if preemption.finish_stop(self.pos.step, self.contract) == StopOutcome.CAP else 0

    def finish(self) -> int:
        self.agreement.close()
        self.save()
        self.meter.close()
        step = self.pos.step
        if self.ctx.is_main:
            self.folder.write_final(FinalState.FINISHED, f"reached step {step}", step, job_id=self.ctx.env.job_id)
            log(self.ctx, summary(self.folder, step, self.first_step, time.time() - self.t0))
        return 0

class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_nullcontext = _NullContext()


class Meter:
    """Loss and throughput between logging intervals; the only host-device syncs happen in flush(). On rank 0 it
    writes metrics.jsonl, logs to the --tracker trackers (trainers.tracking) and draws the progress bar when the
    rank was started on a terminal (`terminal.was_tty`)."""

    def __init__(self, ctx: DistContext, cfg: TrainConfig, task: Task, run: RunFolder, samples_per_step: int,
                 start_step: int, terminal: Terminal | None, peak_flops: float | None = None) -> None:
        self.ctx, self.run, self.samples_per_step = ctx, run, samples_per_step
        self.tokens_per_sample = task.tokens_per_sample
        self.flops_per_sample, self.peak_flops = task.flops_per_sample, peak_flops  # peak: all ranks together
        self.loss_sum = torch.zeros((), device=ctx.device)
        self.steps, self.total_steps = start_step, cfg.steps
        self.restart = ctx.env.restart
        self.bar: Bar | None = None
        # Every rank checks the packages: a missing one refuses the start on all ranks alike, not on rank 0 alone.
        tracking.require(cfg.trackers())
        self.trackers = (tracking.open_trackers(cfg.trackers(), run, cfg.as_dict(), start_step) if ctx.is_main
                         else [])
        self.t0 = time.perf_counter()  # after opening them (seconds): the first interval's throughput is training's
        if ctx.is_main and terminal is not None and terminal.was_tty:
            self.bar = Bar(terminal, cfg.steps, start_step)

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach()

    def tick(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step)

    def flush(self, step: int, lr: float) -> None:
        if self.ctx.world_size > 1:
            torch.distributed.all_reduce(self.loss_sum)
            self.loss_sum /= self.ctx.world_size
        n = max(1, step - self.steps)
        loss = self.loss_sum.item() / n
        dt = time.perf_counter() - self.t0
        samples_s = n * self.samples_per_step / dt if dt > 0 else 0.0
        self.loss_sum.zero_()
        self.steps, self.t0 = step, time.perf_counter()
        if not self.ctx.is_main:
            return
        rec = {"step": step, "loss": loss, "lr": lr, "samples_per_s": samples_s, "time": time.time(),
               "restart": self.restart}
        if self.tokens_per_sample:
            rec["tokens_per_s"] = samples_s * self.tokens_per_sample
        if self.peak_flops:
            rec["mfu"] = samples_s * self.flops_per_sample / self.peak_flops
        append_jsonl(self.run.metrics, rec)
        self.run.write_heartbeat(step, loss=loss, restart=self.restart)
        tokens = f" | {rec['tokens_per_s']:,.0f} tok/s" if self.tokens_per_sample else ""
        mfu = f" | MFU {rec['mfu']:.1%}" if self.peak_flops else ""
        print(f"[hpcjobs rank 0] step {step} | loss {loss:.4f} | lr {lr:.3g} | {samples_s:,.1f} samples/s{tokens}"
              f"{mfu}", flush=True)
        values = {k: v for k, v in rec.items() if k not in ("step", "time", "restart")}
        for tracker in self.trackers:
            tracker.log(values, step)

    def record_eval(self, step: int, val_loss: float) -> None:
        if not self.ctx.is_main:
            return
        append_jsonl(self.run.metrics, {"step": step, "val_loss": val_loss, "time": time.time(),
                                        "restart": self.restart})
        print(f"[hpcjobs rank 0] step {step} | val_loss {val_loss:.4f}", flush=True)
        for tracker in self.trackers:
            tracker.log({"val_loss": val_loss}, step)

    def close(self) -> None:
        """Idempotent: the loop's `finally` closes it again after a stop or a failure. The trackers learn whether
        the run is done (its last step logged) or only this start."""
        for tracker in self.trackers:
            tracker.close(finished=self.steps >= self.total_steps)
        self.trackers = []
        if self.bar is not None:
            self.bar.close()
            self.bar = None
