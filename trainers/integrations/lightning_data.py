"""Where a stopped Lightning start stood in its epoch's data, and how the next start goes on from exactly there
(trainers/integrations/lightning.py). Lightning restores its loop counters, but a plain DataLoader's new iterator
starts at the epoch's first batch: the resumed start would train on the epoch's first batches again and never see
its last ones. Here each training DataLoader's index sampler (its batch sampler, or its sampler without batching)
is wrapped in `SkipFirst`: on the resumed epoch it draws the epoch's order as the stopped start did (the sampler's
epoch set first, as Lightning's DistributedSampler needs; the global RNG as it was at the epoch's first batch, as a
RandomSampler needs) and skips the batches already trained on, by index, without loading them. Lightning's own
resumable loaders (with state_dict/load_state_dict) are left to Lightning.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainers.checkpoint.state import rng_state, set_rng_state
from trainers.integrations.marks import say


class SkipFirst:
    """An index sampler whose next epoch skips its first `skip` batches, drawn with the RNG state `rng` (None: the
    state of the moment). It keeps the RNG state of each epoch's first draw (`first_rng`) for a stop to save."""

    def __init__(self, inner: Any, skip: int, rng: dict[str, Any] | None, device: torch.device) -> None:
        self.inner, self.skip, self.rng, self.device = inner, skip, rng, device
        self.first_rng: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.inner)  # the whole epoch's: Lightning counts the skipped batches as done

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, drop_last, set_epoch: the wrapped one's
        if name in ("inner", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        now = rng_state(self.device)
        skip, rng, self.skip = self.skip, self.rng if self.skip else None, 0
        self.first_rng = now if rng is None else rng
        if rng is not None:
            set_rng_state(rng, self.device)
        it = iter(self.inner)
        if skip:
            next(itertools.islice(it, skip, skip), None)  # draws the order, reads no data
        if rng is not None:
            set_rng_state(now, self.device)
        yield from it


def train_loaders(trainer: Any) -> list[Any]:
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def position(folder: Path, rank: int) -> dict[str, Any] | None:
    path = folder / f"hpcjobs-rank-{rank}.pt"
    if not path.is_file():
        say(f"{folder} holds no position of rank {rank} (saved at another world size?): its RNG streams start anew")
        return None
    found: dict[str, Any] = torch.load(path, weights_only=False)
    return found


def save_position(trainer: Any, path: Path) -> None:
    """This rank's epoch, batches read of it, the RNG state at the epoch's first draw and now."""
    path.parent.mkdir(parents=True, exist_ok=True)
    first = next((s.first_rng for s in map(index_sampler, train_loaders(trainer)) if isinstance(s, SkipFirst)),
                 None)
    torch.save({"epoch": trainer.current_epoch, "batch": trainer.fit_loop.epoch_loop.batch_progress.current.ready,
                "first_rng": first, "rng": rng_state(trainer.strategy.root_device)}, path)


def index_sampler(loader: Any) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def rewind(trainer: Any, saved: dict[str, Any] | None) -> None:
    """At the train start: wrap the training loaders' index samplers; on a resume from hpcjobs's checkpoint
    (`saved`: this rank's position), skip the batches the stopped start had read and put its RNG streams back.
    The fetcher gets a fresh iterator: the one Lightning made earlier drew nothing yet (or, with workers, drew
    before the sampler's epoch was set)."""
    fetcher, device = trainer.fit_loop._data_fetcher, trainer.strategy.root_device
    if fetcher is None:
        return
    skip = trainer.fit_loop.epoch_loop.batch_progress.current.ready if saved else 0
    lost = []
    for loader in train_loaders(trainer):
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            continue  # Lightning saves and restores where such a loader stands
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
            lost.append(type(getattr(loader, "dataset", loader)).__name__)
            continue
        inner = index_sampler(loader)
        inner = inner.inner if isinstance(inner, SkipFirst) else inner
        attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        object.__setattr__(loader, attr, SkipFirst(inner, skip, saved and saved.get("first_rng"), device))
        set_epoch(loader, trainer.fit_loop.epoch_progress.current.processed)
    if skip and lost:
        say(f"the training data ({', '.join(lost)}) cannot be skipped into by index: this resumed epoch reads it "
            f"again from its start, not from batch {skip}. HINT: a map-style Dataset, or a DataLoader with "
            "state_dict/load_state_dict (torchdata's StatefulDataLoader), resumes exactly")
    elif skip:  # Lightning warns that such a resume "can cause unreliable results": not so here
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
    iter(fetcher)
    if saved is not None:
        set_rng_state(saved["rng"], device)


def set_epoch(loader: Any, epoch: int) -> None:
    """As Lightning's own `_set_sampler_epoch` does at each epoch start (again, with the same epoch, after this)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = {id(s): s for s in (loader.sampler, getattr(batch_sampler, "sampler", None)) if s is not None}
    for sampler in found.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
