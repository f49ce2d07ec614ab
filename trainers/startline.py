"""The shared trainer's start line: the one line rank 0 prints when a start is set up, before the model is built.

Its own module because it is what a user reads to learn how a run was set up, and it grows with every feature that
changes how a step runs (math mode, compile, float8, activation checkpointing, the layout, offload, the allocator, the
memory plan): each adds its words here, not to the trainer's set-up. The words of each part come from the module
that owns the part (trainers.perf, trainers.activations, trainers.strategy, trainers.allocator, trainers.memory); an
empty word is left out. Tests read the wording (tests/test_gpu.py, tests/cluster/test_submit_cluster.py).
"""

from __future__ import annotations

import torch

from hpcjobs.protocol.settings.trainconfig import TrainConfig
from trainers import activations, allocator, memory, strategy
from trainers.dist import DistContext
from trainers.task import Task


def start_line(task: Task, cfg: TrainConfig, ctx: DistContext, micro: int, lr: float, precision: str,
               math: str) -> str:
    """`micro`: the per-rank micro-batch; `lr`: the scaled rate; `math`: trainers.perf.configure_math's words."""
    world = ctx.world_size
    threads = torch.get_num_threads()  # trainers.dist.cpu_threads: within the CPUs this rank may run on
    extras = (math, "compiled" * cfg.compile, "float8 linears" * cfg.fp8, activations.words(cfg),
              strategy.layout_words(cfg, world),
              "CPU offload" * cfg.cpu_offload, allocator.words(ctx.device),
              memory.plan_words(task, cfg, world, micro, precision, ctx.device))
    return (f"task {task.name} | {world} rank(s), {cfg.strategy}, {ctx.backend} on {ctx.device.type}, "
            f"{threads} thread{'s' * (threads != 1)} per rank | batch {micro}×{cfg.grad_accum} per rank, "
            f"{micro * cfg.grad_accum * world} global | lr {cfg.lr:g} × {cfg.lr_factor(world):g} "
            f"({cfg.lr_scaling} scaling) = {lr:g} | precision {precision}"
            + "".join(f", {word}" for word in extras if word))
