"""The shared trainer's optimizer when the task names none (Task.optimizer None): AdamW, weight decay on matrices only.

Its own module because more than the trainer builds it: bench/gpu.py, bench/memory.py, bench/memplan.py and
bench/trainer_overhead.py build the same optimizer to measure what the trainer runs, and tests/test_parallelize.py
and tests/test_gpu.py check its kernel choice (trainers.trainer re-exports it under its old name). Weight decay goes
to parameters of two or more dimensions (weights), not to biases and norms' scales, as GPT-style recipes do; betas
(0.9, 0.95) as they do. Fused AdamW: one kernel launch per group on CUDA, and under --cpu-offload a vectorised CPU
kernel instead of a per-parameter loop.
"""

from __future__ import annotations

import torch
from torch import nn

from hpcjobs.protocol.settings.trainconfig import TrainConfig


def default_optimizer(model: nn.Module, lr: float, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one launch per group on CUDA; under --cpu-offload a vectorised CPU kernel, not a per-parameter loop.
    fused = cfg.cpu_offload or all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True if fused else None)
