"""A small MLP classifier on synthetic Gaussian blobs: the quickest task that still learns something.

    hpcjobs submit --profile local trainers.tasks.classifier --steps 100
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from hpcjobs.protocol.settings.taskflags import BUNDLED
from trainers.task import Task


def blobs(n: int, features: int, classes: int, seed: int = 1234, split: int = 0) -> TensorDataset:
    """`split` 0 is the training set; another split draws other samples around the same centers."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 3
    if split:
        g = torch.Generator().manual_seed(seed + split)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return TensorDataset(x, y)


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random augmentation as data pipelines do it: Gaussian noise on each input, drawn when the sample is read (in a
    loader worker, when there are workers)."""

    def __init__(self, data: TensorDataset, std: float) -> None:
        self.data, self.std = data, std

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return x + self.std * torch.randn_like(x), y


def make_task(args: list[str]) -> Task:
    ns = BUNDLED["trainers.tasks.classifier"].parse(args)  # declared torch-free: submit checks them too

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(ns.features, ns.hidden), nn.ReLU(), nn.Dropout(ns.dropout),
                             nn.Linear(ns.hidden, ns.hidden), nn.ReLU(), nn.Linear(ns.hidden, ns.classes))

    return Task(name="classifier", model=model,
                train_data=lambda: Noisy(blobs(ns.samples, ns.features, ns.classes), ns.noise),
                val_data=lambda: blobs(max(64, ns.samples // 8), ns.features, ns.classes, split=1),
                loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]), config=vars(ns).copy(),
                defaults=BUNDLED["trainers.tasks.classifier"].defaults(ns))
