"""The start line's memory plan: the task's own estimate (Task.memory_plan, hpcjobs.protocol.planning.memory_plan) under
this run's settings, so a log shows what the peak should be beside what the GPU measures (metrics.jsonl's
peak_mem_gib)."""

from __future__ import annotations

import torch

from hpcjobs.protocol.planning.memory_plan import GIB, Setup
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from trainers.task import Task


def plan_words(task: Task, cfg: TrainConfig, world: int, micro: int, precision: str, device: torch.device) -> str:
    """`memory plan N GiB a GPU` (with the allocator's headroom) or, on the CPU, the tensors' bytes a rank; "" for a
    task without a plan."""
    if task.memory_plan is None:
        return ""
    setup = Setup(strategy=cfg.strategy, ranks=world, micro_batch=micro, precision=precision,
                  activation_checkpointing=cfg.checkpoints_every_block(), ac_mode=cfg.ac_mode,
                  grad_accum=cfg.grad_accum,
                  reduce_each_micro_batch=cfg.reduce_each_micro_batch, cpu_offload=cfg.cpu_offload,
                  gpu=device.type == "cuda")
    total = task.memory_plan(setup).total
    where = "a GPU" if setup.gpu else "of tensors a rank"
    amount = f"{total / GIB:.1f} GiB" if total >= GIB else f"{total / 2**20:.0f} MiB"
    return f"memory plan {amount} {where}"
