"""The shared trainer's validation pass (--eval-every): the mean loss of the validation set over all ranks' shards.

Its own module because it must change nothing a resumed run would have to reproduce: the training RNG streams are
untouched (no shuffling; the loader gets its own generator) and the raw module is used (no DDP hooks, so no bucket
rebuild and no gradient reduction), which tests/test_exactness.py's kill-and-resume cases with --eval-every check
bit for bit. It reports progress to the hang watchdog per batch: a long validation set is not a hang.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from trainers import watchdog
from trainers.data import to_device
from trainers.dist import DistContext
from trainers.task import Task


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
            watchdog.alive()  # progress, though not a step: the hang watchdog's bound starts again
    model.train()
    if ctx.world_size > 1:
        torch.distributed.all_reduce(totals)
    return (totals[0] / totals[1]).item()
