"""The shared DDP trainer. Reads top to bottom: set up, resume if a finished checkpoint exists, loop, stop."""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from hpcjobs.contract import LaunchContract
from hpcjobs.runfolder import RunFolder, append_jsonl
from hpcjobs.states import FinalState, StopOutcome
from trainers import checkpoint, faults, preemption
from trainers.config import TrainConfig
from trainers.dist import DistContext
from trainers.task import Task


class ResumeError(ValueError):
    pass


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


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:  # a closure LambdaLR calls with the step
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def default_optimizer(model: nn.Module, lr: float, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=None)


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = cast("tuple[Any, ...]", np.random.get_state())  # the legacy tuple
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def micro_batches(dataset: Any, ctx: DistContext, cfg: TrainConfig, micro: int, pos: Position) -> Iterator[Any]:
    """Micro-batches forever, epoch after epoch, starting exactly at `pos` (so a resume reads what comes next)."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                                          shuffle=True, seed=cfg.seed, drop_last=True)
    per_epoch = len(sampler) // micro
    if per_epoch == 0:
        raise ValueError(f"the dataset ({len(dataset)} samples) is too small for one micro-batch of {micro} on "
                         f"each of {ctx.world_size} ranks")
    epoch, start = pos.epoch, pos.micro
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)[start * micro: per_epoch * micro]
        loader = DataLoader(dataset, batch_size=micro, sampler=order, drop_last=True,
                            num_workers=cfg.num_workers, pin_memory=ctx.device.type == "cuda",
                            generator=torch.Generator().manual_seed(cfg.seed + epoch),
                            persistent_workers=False)
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


def check_compatible(meta: dict[str, Any], cfg: TrainConfig, task: Task, world: int, where: str) -> None:
    saved_cfg = meta.get("config", {})
    diffs = [f"{k}: {saved_cfg.get(k)!r} → {getattr(cfg, k)!r}" for k in TrainConfig.RESUME_KEYS
             if k in saved_cfg and saved_cfg[k] != getattr(cfg, k)]
    if meta.get("task") != task.name:
        diffs.append(f"task: {meta.get('task')!r} → {task.name!r}")
    if meta.get("task_config", {}) != task.config:
        diffs.append(f"task config: {meta.get('task_config')} → {task.config}")
    if diffs:
        raise ResumeError(f"checkpoint {where} was written with other settings ({'; '.join(diffs)}); resuming "
                          "would not continue the same run. HINT: use the same settings, or a new --run-dir.")
    if meta.get("world_size") != world:
        raise ResumeError(f"checkpoint {where} was written by {meta.get('world_size')} ranks, this run has {world}; "
                          "the data order and per-rank RNG states would not continue exactly. HINT: resume with "
                          f"{meta.get('world_size')} ranks, or start a new --run-dir.")


def train(task: Task, cfg: TrainConfig, run: RunFolder, ctx: DistContext, contract: LaunchContract | None = None,
          ) -> int:
    """Train to cfg.steps; returns the process exit code (0 also when stopped and requeued). `contract` is the
    rank's launch contract (None: the one the launcher exported, else the defaults with `run` as the run folder)."""
    contract = contract or LaunchContract.current() or LaunchContract(run_dir=str(run.path))
    device, world = ctx.device, ctx.world_size
    micro = cfg.micro_batch(world)
    precision = resolve_precision(cfg.precision, device)
    lr = cfg.lr * cfg.lr_factor(world)
    log(ctx, f"task {task.name} | {world} rank(s), {ctx.backend} on {device.type} | batch {micro}×{cfg.grad_accum}"
             f" per rank, {micro * cfg.grad_accum * world} global | lr {cfg.lr:g} × {cfg.lr_factor(world):g} "
             f"({cfg.lr_scaling} scaling) = {lr:g} | precision {precision}")

    # Same initial weights on every rank, then per-rank RNG streams (dropout differs across ranks).
    seed_all(cfg.seed)
    model = task.model().to(device)
    optimizer = (task.optimizer(model.parameters(), lr) if task.optimizer else default_optimizer(model, lr, cfg))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    seed_all(cfg.seed * 100003 + ctx.rank + 1)
    pos = Position()

    # Always try to resume: the newest finished checkpoint in this run folder wins.
    ref = checkpoint.latest(run.checkpoints)
    if ref is not None:
        meta = ref.meta()
        check_compatible(meta, cfg, task, world, str(ref.path))
        shared, mine = checkpoint.load_checkpoint(ref, ctx.rank)
        model.load_state_dict(shared["model"])
        optimizer.load_state_dict(shared["optimizer"])
        scheduler.load_state_dict(shared["scheduler"])
        scaler.load_state_dict(shared["scaler"])
        pos = Position(**shared["position"])
        set_rng_state(mine["rng"])
        log(ctx, f"resumed from {ref.path} (step {pos.step}, epoch {pos.epoch}, micro-batch {pos.micro})")
    else:
        log(ctx, f"no finished checkpoint in {run.checkpoints}: starting at step 0")

    val_set = task.val_data() if cfg.eval_every and task.val_data else None
    if cfg.eval_every and val_set is None:
        raise ValueError(f"--eval-every {cfg.eval_every}: task {task.name} has no validation set; HINT: give the "
                         "Task a val_data, or drop --eval-every")
    best = checkpoint.read_best(run.checkpoints) if cfg.keep_best else None

    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else model
    agreement = preemption.Agreement(ctx.control_group)
    dataset = task.train_data()
    data = micro_batches(dataset, ctx, cfg, micro, pos)
    autocast = torch.autocast(device.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
                              enabled=precision in ("bf16", "fp16"))
    if world > 1:
        settle_ddp_buckets(net, task, dataset, micro, device, autocast, optimizer)
    meter = Meter(ctx, cfg, task, run, micro * cfg.grad_accum * world, pos.step)
    last_saved = pos.step if ref is not None else -1

    def save() -> None:
        """Commit a checkpoint of this step, once: a stop or an end right after a periodic save reuses it."""
        nonlocal last_saved
        if last_saved == pos.step:
            return
        shared_state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "position": vars(pos).copy()}
        checkpoint.save_checkpoint(run.checkpoints, pos.step, shared_state, {"rng": rng_state()}, rank=ctx.rank,
                                   world_size=world, barrier=ctx.barrier, keep=cfg.keep,
                                   meta={"config": cfg.as_dict(), "task": task.name, "task_config": task.config})
        last_saved = pos.step

    fault_armed = faults.armed()
    net.train()
    while pos.step < cfg.steps:
        for i in range(cfg.grad_accum):
            pos.epoch, pos.micro, batch = next(data)
            batch = to_device(batch, device)
            last = i == cfg.grad_accum - 1
            with (cast(DDP, net).no_sync() if world > 1 and not last else _nullcontext), autocast:
                loss = task.loss(net, batch) / cfg.grad_accum
            scaler.scale(loss).backward()
            meter.add(loss)
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        pos.step += 1
        if fault_armed:
            faults.maybe_die("step", pos.step)

        if pos.step % cfg.log_every == 0 or pos.step == cfg.steps:
            meter.flush(pos.step, float(scheduler.get_last_lr()[0]))
        if val_set is not None and (pos.step % cfg.eval_every == 0 or pos.step == cfg.steps):
            val_loss = evaluate(model, task, val_set, ctx, micro, autocast)
            meter.record_eval(pos.step, val_loss)
            if cfg.keep_best and (best is None or val_loss < best["value"]):
                save()
                if ctx.is_main:
                    checkpoint.mark_best(run.checkpoints, pos.step, "val_loss", val_loss)
                best = {"step": pos.step, "value": val_loss}
        if cfg.ckpt_every and pos.step % cfg.ckpt_every == 0 and pos.step < cfg.steps:
            save()
        if pos.step % cfg.stop_check_every == 0 and agreement.any_rank_pipelined(preemption.requested_locally()):
            agreement.close()
            save()
            log(ctx, f"stop requested: checkpoint step-{pos.step} committed")
            meter.close()
            return 1 if preemption.finish_stop(pos.step, contract) == StopOutcome.CAP else 0

    agreement.close()
    save()
    meter.close()
    if ctx.is_main:
        run.write_final(FinalState.FINISHED, f"reached step {pos.step}", pos.step)
    log(ctx, f"finished at step {pos.step}; checkpoints in {run.checkpoints}, metrics in {run.metrics}")
    return 0


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_nullcontext = _NullContext()


class Meter:
    """Loss and throughput between logging intervals; the only host-device syncs happen in flush()."""

    def __init__(self, ctx: DistContext, cfg: TrainConfig, task: Task, run: RunFolder, samples_per_step: int,
                 start_step: int) -> None:
        self.ctx, self.run, self.samples_per_step = ctx, run, samples_per_step
        self.tokens_per_sample = task.tokens_per_sample
        self.loss_sum = torch.zeros((), device=ctx.device)
        self.steps = start_step
        self.t0 = time.perf_counter()
        self.restart = ctx.env.restart
        self.tb = None
        self.bar = None
        if ctx.is_main and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run.path / "tensorboard"))
        if ctx.is_main and sys.stdout.isatty():
            from rich.progress import Progress
            self.bar = Progress(transient=True)
            self.bar.start()
            self.task_id = self.bar.add_task("training", total=cfg.steps)

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach()

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
        append_jsonl(self.run.metrics, rec)
        self.run.write_heartbeat(step, loss=loss, restart=self.restart)
        tokens = f" | {rec['tokens_per_s']:,.0f} tok/s" if self.tokens_per_sample else ""
        print(f"[hpcjobs rank 0] step {step} | loss {loss:.4f} | lr {lr:.3g} | {samples_s:,.1f} samples/s{tokens}",
              flush=True)
        if self.tb is not None:
            self.tb.add_scalar("loss", loss, step)
            self.tb.add_scalar("lr", lr, step)
        if self.bar is not None:
            self.bar.update(self.task_id, completed=step)

    def record_eval(self, step: int, val_loss: float) -> None:
        if not self.ctx.is_main:
            return
        append_jsonl(self.run.metrics, {"step": step, "val_loss": val_loss, "time": time.time(),
                                        "restart": self.restart})
        print(f"[hpcjobs rank 0] step {step} | val_loss {val_loss:.4f}", flush=True)
        if self.tb is not None:
            self.tb.add_scalar("val_loss", val_loss, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.stop()
