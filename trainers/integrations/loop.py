"""The part of a one-line `resumable(...)` loop that does not depend on the library that saves the state: shared by
trainers/integrations/accelerate_loop.py (`accelerator.save_state`) and deepspeed_loop.py
(`engine.save_checkpoint`), which differ only in how a state is written, read, refused and skipped into.

What is shared: the arguments' one-line refusals; the loop over the epochs with `(step, batch)` pairs counted as
`enumerate` would; the stop checks at the cadence (trainers/integrations/checks.py) and the save at a step that ended
a gradient accumulation, between the pending and completion marks (marks.py); each rank's place in the data (epoch,
batch, the RNG streams and the samplers' generators at that epoch's first draw, so that the resumed epoch's order is
drawn again as the stopped start drew it); the resume of the newest complete state, with the batches already trained
on skipped by index; the progress records (account.py) and the protocol's signal handlers (signals.py) for the length
of the loop. `HPCJOBS_HOOKS=0` makes it the plain loop over the epochs.

Extracted from accelerate_loop.py when the DeepSpeed helper came: the same code resumes both exactly (the accelerate
tests, tests/test_accelerate_loop.py, pass unchanged; tests/test_deepspeed_loop.py for ZeRO-2 and ZeRO-3), at the
cost per step of a time.time() and a comparison (account.py) plus the cadence's checks (checks.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint.state import rng_state, set_rng_state
from trainers.integrations import check_every, enabled
from trainers.integrations.account import ACCOUNT
from trainers.integrations.marks import barrier, mark_complete, mark_pending, run_folder, say, settle
from trainers.integrations.signals import joined

END = object()
"""What `next` gives past a loader's last batch."""


def checked(epochs: int, max_steps: int | None, save_every: int) -> None:
    """A bad argument of `resumable(...)`: one line, exit 2, on every rank."""
    for name, value, least in (("epochs", epochs, 1), ("max_steps", max_steps, 1), ("save_every", save_every, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            say(f"resumable({name}={value!r}): valid: a whole number from {least}. HINT: e.g. {name}={max(least, 1)}")
            raise SystemExit(2)


def states_folder(folder: str | Path | None, name: str) -> Path:
    """Where the states go: `folder` when given, else RUN/checkpoints/NAME (outside a launched rank:
    `hpcjobs-checkpoints/` in the working directory)."""
    run = run_folder()
    return Path(folder) if folder is not None else run.checkpoints / name if run else Path("hpcjobs-checkpoints")


def start(loop: ResumableLoop) -> Iterator[tuple[int, Any]]:
    """The loop with the protocol, or the plain loop where HPCJOBS_HOOKS=0."""
    if not enabled(os.environ):
        return loop.batches(None)
    check_every(os.environ)  # also under plain torchrun, where no launcher checked it
    return loop.run()


class ResumableLoop:
    """The loop; a library's subclass says how a state is saved (`write`), loaded (`load`), when a step may be saved
    (`boundary`) and how a DataLoader is skipped into (`skip_loader`)."""

    def __init__(self, owner: Any, loader: Any, epochs: int, max_steps: int | None, save_every: int,
                 epoch_end: Callable[[int], None] | None, root: Path) -> None:
        self.owner = owner
        """What saves and loads the state: an Accelerator, a DeepSpeed engine."""
        self.loader, self.epochs, self.max_steps, self.save_every = loader, epochs, max_steps, save_every
        self.epoch_end, self.root = epoch_end, root
        self.device: torch.device = torch.device(getattr(owner, "device", "cpu"))
        self.guard: Any = None  # a StopGuard while the loop runs (signals.joined)
        self.asked = False
        self.epoch_start: tuple[dict[str, Any] | None, list[torch.Tensor]] = (None, [])

    # --- what a library's subclass says ------------------------------------------------------------------------------

    def boundary(self) -> bool:
        """Whether the step just ended a gradient accumulation (the accumulated gradients are not saved)."""
        return True

    def write(self, folder: Path, position: dict[str, Any]) -> None:
        raise NotImplementedError

    def load(self, newest: Path) -> dict[str, Any]:
        """Load `newest` on every rank (or refuse it in one line, exit 2) and return this rank's position."""
        raise NotImplementedError

    def skip_loader(self, batches: int) -> Any:
        raise NotImplementedError

    # --- the loop ----------------------------------------------------------------------------------------------------

    def run(self) -> Iterator[tuple[int, Any]]:
        at = self.resume()
        ACCOUNT.begin(at["step"] if at else 0)
        with joined(self):  # the protocol's handlers for the length of the loop
            try:
                yield from self.batches(at)
            finally:  # also when the script breaks out of the loop
                ACCOUNT.end()
                self.guard.close()  # a pipelined reduce still in flight, before the script ends its group

    def batches(self, at: dict[str, Any] | None) -> Iterator[tuple[int, Any]]:
        """The loop itself, with the protocol (self.guard set) or without it (HPCJOBS_HOOKS=0)."""
        step = at["step"] if at else 0
        for epoch in range(at["epoch"] if at else 0, self.epochs):
            it, done = self.begin(epoch, at), at["batch"] if at else 0
            at = None
            batch = next(it, END)
            while batch is not END and (self.max_steps is None or step < self.max_steps):
                yield step, batch
                step, done = step + 1, done + 1
                if self.guard is not None:
                    ACCOUNT.step_done(step)
                batch = next(it, END)  # one ahead: whether this step ended the epoch
                if batch is END and self.epoch_end is not None:
                    self.epoch_end(epoch)
                last = step == self.max_steps or (batch is END and epoch == self.epochs - 1)
                if self.guard is not None and not last:
                    self.step_end(step, (epoch + 1, 0) if batch is END else (epoch, done))

    # --- the stop and the saves --------------------------------------------------------------------------------------

    def step_end(self, step: int, where: tuple[int, int]) -> None:
        """Every rank, every step: the agreement at the cadence's steps (its answer the same on every rank), then a
        save when one is due at a step that ended a gradient accumulation."""
        self.asked |= self.guard.step_ended()
        if not self.boundary():
            return
        if self.asked or (self.save_every and step % self.save_every == 0):
            self.save(step, where)
        if self.asked:
            ACCOUNT.end()
            self.guard.requeue_and_exit(step)

    def save(self, step: int, where: tuple[int, int]) -> None:
        folder = self.root / f"checkpoint-{step}"
        mark_pending(folder)
        barrier()  # no rank writes into the folder before it is marked
        epoch, batch = where
        first_rng, gens = self.epoch_start if batch else (None, [g.get_state() for g in generators(self.loader)])
        self.write(folder, {"step": step, "epoch": epoch, "batch": batch, "first_rng": first_rng, "generators": gens})
        mark_complete(folder, step)

    # --- the resume --------------------------------------------------------------------------------------------------

    def resume(self) -> dict[str, Any] | None:
        """Load the newest complete state (every rank) and return this rank's place in the data, or None."""
        newest = settle(self.root, owned=True)
        return None if newest is None else dict(self.load(newest))

    def begin(self, epoch: int, at: dict[str, Any] | None) -> Iterator[Any]:
        """The epoch's batches; on the resumed epoch, drawn as the stopped start drew them and from where it
        stopped. Records the RNG streams and generators of the epoch's first draw, for a save within it."""
        set_epoch(self.loader, epoch)
        gens = generators(self.loader)
        for gen, state in zip(gens, at["generators"] if at else [], strict=False):
            gen.set_state(state)
        if not at or not at["batch"]:
            self.epoch_start = (rng_state(self.device), [g.get_state() for g in gens])
            return iter(self.loader)
        now = rng_state(self.device)
        self.epoch_start = (at["first_rng"], list(at["generators"]))
        set_rng_state(at["first_rng"], self.device)  # the epoch's draw as the stopped start made it
        it = iter(self.skip(at["batch"]))
        first = next(it, END)
        set_rng_state(now, self.device)  # then the streams as they were at the stop
        return it if first is END else itertools.chain([first], it)

    def skip(self, batches: int) -> Any:
        if isinstance(self.loader, torch.utils.data.DataLoader):
            if isinstance(self.loader.dataset, torch.utils.data.IterableDataset):
                say(f"the training data ({type(self.loader.dataset).__name__}) cannot be skipped into by index: "
                    f"its first {batches} batches of this epoch are read again and dropped")
            return self.skip_loader(batches)
        say(f"the training data ({type(self.loader).__name__}) is not a DataLoader: its first {batches} batches of "
            "this epoch are read again and dropped")
        return itertools.islice(self.loader, batches, None)


def generators(loader: Any) -> list[torch.Generator]:
    """The torch.Generators the loader draws its order and seeds from, in a fixed order: the loader's own, the one
    accelerate keeps in step across ranks, and its samplers'."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "batch_sampler", None)
    holders = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
               inner, getattr(inner, "sampler", None))
    found: dict[int, torch.Generator] = {}
    for gen in [getattr(loader, "synchronized_generator", None)] + [getattr(h, "generator", None) for h in holders]:
        if isinstance(gen, torch.Generator):
            found.setdefault(id(gen), gen)
    return list(found.values())


def set_epoch(loader: Any, epoch: int) -> None:
    """The epoch for the loader's samplers (a DistributedSampler's order, accelerate's seedable sampler), as
    accelerate's prepared loader sets it at each pass, and as a script's own loop would for a plain DataLoader."""
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(epoch)
        return
    if not isinstance(loader, torch.utils.data.DataLoader):
        return  # any other iterable: its own business
    from trainers.integrations.lightning_data import set_epoch as set_samplers_epoch

    set_samplers_epoch(loader, epoch)
