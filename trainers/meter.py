"""Loss and throughput of the shared trainer between logging intervals, and where rank 0 reports them."""

from __future__ import annotations

import time

import torch

from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from trainers import allocator, ranklog, tracking, watchdog
from trainers.dist import DistContext
from trainers.progress import Bar, Terminal
from trainers.task import Task


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
        self.grad_norm: torch.Tensor | None = None
        """The last step's gradient norm before clipping, as the strategy computed it (under fsdp a DTensor that
        one all-reduce turns into the number): read, and reduced, only in flush(), at log steps."""
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
        """Every step, on every rank: the progress bar and the hang watchdog's step mark."""
        watchdog.progress(step)
        if self.bar is not None:
            self.bar.update(step)

    def flush_rest(self, step: int, lr: float) -> None:
        """At a stop: the losses since the last logged step, which the resumed start will not log again."""
        if step > self.steps:
            self.flush(step, lr)

    def flush(self, step: int, lr: float) -> None:
        if self.ctx.world_size > 1:
            torch.distributed.all_reduce(self.loss_sum)
            self.loss_sum /= self.ctx.world_size
        n = max(1, step - self.steps)
        loss = self.loss_sum.item() / n
        dt = time.perf_counter() - self.t0
        samples_s = n * self.samples_per_step / dt if dt > 0 else 0.0
        self.loss_sum.zero_()
        norm, self.grad_norm = self.grad_norm, None
        grad_norm = None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.steps, self.t0 = step, time.perf_counter()
        if not self.ctx.is_main:
            return
        rec = {"step": step, "loss": loss, "lr": lr, "samples_per_s": samples_s, "time": time.time(),
               "restart": self.restart}
        if grad_norm is not None:
            rec["grad_norm"] = grad_norm
        if self.tokens_per_sample:
            rec["tokens_per_s"] = samples_s * self.tokens_per_sample
        if self.peak_flops:
            rec["mfu"] = samples_s * self.flops_per_sample / self.peak_flops
        if self.ctx.device.type == "cuda":  # the allocator's own counters: no device sync
            rec.update(allocator.figures(self.ctx.device))
        append_jsonl(self.run.metrics, rec)
        self.run.write_heartbeat(step, loss=loss, restart=self.restart)
        tokens = f" | {rec['tokens_per_s']:,.0f} tok/s" if self.tokens_per_sample else ""
        mfu = f" | MFU {rec['mfu']:.1%}" if self.peak_flops else ""
        ranklog.rank0(f"step {step} | loss {loss:.4f} | lr {lr:.3g} | {samples_s:,.1f} samples/s{tokens}{mfu}",
                      self.ctx.rank)
        values = {k: v for k, v in rec.items() if k not in ("step", "time", "restart")}
        for tracker in self.trackers:
            tracker.log(values, step)

    def record_eval(self, step: int, val_loss: float) -> None:
        if not self.ctx.is_main:
            return
        append_jsonl(self.run.metrics, {"step": step, "val_loss": val_loss, "time": time.time(),
                                        "restart": self.restart})
        ranklog.rank0(f"step {step} | val_loss {val_loss:.4f}", self.ctx.rank)
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
