"""The data side of the loop: each rank's shard of every epoch, in an order that a resume continues exactly."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from hpcjobs.protocol.settings.trainconfig import TrainConfig
from trainers.checkpoint.state import Position
from trainers.dist import DistContext


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
