"""An `accelerate` training loop under hpcjobs's stop protocol, with one changed line: the loop's header.

    for epoch in range(num_epochs):                                   # before
        for step, batch in enumerate(train_dataloader):
    for step, batch in resumable(accelerator, train_dataloader, epochs=num_epochs):   # after

Why a line and not zero: unlike `Trainer.train` or `Trainer.fit`, an accelerate loop is the script's own code, with
its own counters and its own `for epoch in range(...)`. hpcjobs could load a state and skip batches behind its back,
but the script would still count its epochs from 0 and run its per-epoch code again: no exact resume is possible
without owning the loop. `resumable` owns it, and nothing else:

- At its first batch it resumes the newest complete state of `RUN/checkpoints/accelerate/` with the script's own
  `accelerator.load_state` (model, optimizer, scheduler, scaler, `accelerator.step`, every rank's RNG streams, and the
  objects given to `accelerator.register_for_checkpointing`), and goes on with the batch after the stop: the epoch's
  order is drawn again as the stopped start drew it (the samplers' generators and the RNG streams as they were at that
  epoch's first batch, put back for the draw), the batches already trained on are skipped by index
  (`accelerator.skip_first_batches`: no data is read for them), and the RNG streams are the stop's again. A state a
  save left incomplete is moved aside to `incomplete/` with one line and the complete one before it is used.
- When the loop asks for the next batch (the step is over), at the steps the cadence names
  (trainers/integrations/checks.py, as for the Hugging Face Trainer: every step over a start's first 12, then about
  once a second of training), the ranks agree whether any of them was asked to stop. When one was, and the step
  ended a gradient accumulation (`accelerator.sync_gradients`: the accumulated gradients are not saved),
  `accelerator.save_state` writes `checkpoint-N/` (N: the steps done) with the pending and completion marks of
  trainers/integrations/marks.py, plus each rank's place in the data; rank 0 requeues (on Slurm, when the stop came
  from the profile's signal) and every rank exits 0: nothing after the loop runs on a stop.
- `save_every`: also save every that many steps (the same marks), for a job killed without warning.
- The protocol's signal handlers hold while the loop runs (trainers/integrations/signals.py): the code before and after
  it keeps the script's own (Ctrl-C stops it); a signal that came after the ranks' last agreement reaches them as the
  loop ends, also when the script leaves it with `break` (then within RESEND_S of signals.py). `HPCJOBS_HOOKS=0`
  makes it the plain loop over the epochs it replaces: no resume, no stop protocol, no save.

Not exact, as with Lightning: random transforms that draw from the global RNG inside the dataset (or any RNG in
DataLoader workers), and an IterableDataset, which is skipped into by reading its first batches again.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint.state import rng_state, set_rng_state
from trainers.integrations import check_every, enabled
from trainers.integrations.account import ACCOUNT
from trainers.integrations.marks import barrier, mark_complete, mark_pending, rank, run_folder, say, settle
from trainers.integrations.signals import joined

FOLDER = "accelerate"
"""Under the run folder's checkpoints/: the states a `resumable` loop saved."""
POSITION = "hpcjobs-position-{rank}.pt"
"""Each rank's place in the data, beside accelerate's own files in `checkpoint-N/`."""
_END = object()


def resumable(accelerator: Any, dataloader: Any, epochs: int = 1, max_steps: int | None = None, save_every: int = 0,
              epoch_end: Callable[[int], None] | None = None, folder: str | Path | None = None) \
        -> Iterator[tuple[int, Any]]:
    """The training loop's `(step, batch)` pairs, `step` counted from 0 over all epochs, as `enumerate` would, and
    resumed where a stop left it. `epochs` passes over `dataloader` (a prepared one, or any DataLoader), at most
    `max_steps` steps; `epoch_end(epoch)` runs after each epoch's last step (the script's per-epoch work: evaluation,
    an epoch scheduler). `folder`: where the states go, by default `RUN/checkpoints/accelerate` (outside a launched
    rank: `hpcjobs-checkpoints/` in the working directory)."""
    for name, value, least in (("epochs", epochs, 1), ("max_steps", max_steps, 1), ("save_every", save_every, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            say(f"resumable({name}={value!r}): valid: a whole number from {least}. HINT: e.g. {name}={max(least, 1)}")
            raise SystemExit(2)
    if getattr(dataloader, "use_stateful_dataloader", False):
        say("resumable() was given a stateful DataLoader (use_stateful_dataloader=True), whose position accelerate "
            "saves itself; valid: a DataLoader hpcjobs skips into. HINT: leave use_stateful_dataloader off, or keep "
            "your own loop")
        raise SystemExit(2)
    hooked = enabled(os.environ)
    if hooked:
        check_every(os.environ)  # also under plain torchrun, where no launcher checked it
    run = run_folder()
    root = Path(folder) if folder is not None else run.checkpoints / FOLDER if run else Path("hpcjobs-checkpoints")
    loop = Loop(accelerator, dataloader, epochs, max_steps, save_every, epoch_end, root)
    return loop.run() if hooked else loop.batches(None)


class Loop:
    def __init__(self, accelerator: Any, loader: Any, epochs: int, max_steps: int | None, save_every: int,
                 epoch_end: Callable[[int], None] | None, root: Path) -> None:
        self.accelerator, self.loader, self.epochs, self.max_steps = accelerator, loader, epochs, max_steps
        self.save_every, self.epoch_end, self.root = save_every, epoch_end, root
        self.device: torch.device = torch.device(getattr(accelerator, "device", "cpu"))
        self.guard: Any = None  # a StopGuard while the loop runs (signals.joined)
        self.asked = False
        self.epoch_start: tuple[dict[str, Any] | None, list[torch.Tensor]] = (None, [])

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
            batch = next(it, _END)
            while batch is not _END and (self.max_steps is None or step < self.max_steps):
                yield step, batch
                step, done = step + 1, done + 1
                if self.guard is not None:
                    ACCOUNT.step_done(step)
                batch = next(it, _END)  # one ahead: whether this step ended the epoch
                if batch is _END and self.epoch_end is not None:
                    self.epoch_end(epoch)
                last = step == self.max_steps or (batch is _END and epoch == self.epochs - 1)
                if self.guard is not None and not last:
                    self.step_end(step, (epoch + 1, 0) if batch is _END else (epoch, done))

    # --- the stop and the saves --------------------------------------------------------------------------------------

    def step_end(self, step: int, where: tuple[int, int]) -> None:
        """Every rank, every step: the agreement at the cadence's steps (its answer the same on every rank), then a
        save when one is due at a step that ended a gradient accumulation."""
        self.asked |= self.guard.step_ended()
        if not getattr(self.accelerator, "sync_gradients", True):
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
        with explicit_folder(self.accelerator):
            self.accelerator.save_state(str(folder))
        epoch, batch = where
        first_rng, gens = self.epoch_start if batch else (None, [g.get_state() for g in generators(self.loader)])
        torch.save({"step": step, "epoch": epoch, "batch": batch, "first_rng": first_rng, "generators": gens,
                    "world_size": world_size(self.accelerator)}, folder / POSITION.format(rank=rank()))
        mark_complete(folder, step)

    # --- the resume --------------------------------------------------------------------------------------------------

    def resume(self) -> dict[str, Any] | None:
        """Load the newest complete state (every rank) and return this rank's place in the data, or None."""
        newest = settle(self.root, owned=True)
        if newest is None:
            return None
        mine = newest / POSITION.format(rank=rank())
        saved = torch.load(mine, weights_only=False) if mine.is_file() else None
        if saved is None or saved["world_size"] != world_size(self.accelerator):
            was = f"was saved by {saved['world_size']} ranks" if saved else f"holds no position of rank {rank()}"
            say(f"{newest} {was}, this start has {world_size(self.accelerator)}: its data positions do not carry "
                "over. HINT: resume with as many ranks, or give this run another --run-dir to start over")
            raise SystemExit(2)  # on every rank
        say(f"resuming from {newest}")
        self.accelerator.load_state(str(newest))
        return dict(saved)

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
        first = next(it, _END)
        set_rng_state(now, self.device)  # then the streams as they were at the stop
        return it if first is _END else itertools.chain([first], it)

    def skip(self, batches: int) -> Any:
        if isinstance(self.loader, torch.utils.data.DataLoader):
            if isinstance(self.loader.dataset, torch.utils.data.IterableDataset):
                say(f"the training data ({type(self.loader.dataset).__name__}) cannot be skipped into by index: "
                    f"its first {batches} batches of this epoch are read again and dropped")
            return self.accelerator.skip_first_batches(self.loader, batches)
        say(f"the training data ({type(self.loader).__name__}) is not a DataLoader: its first {batches} batches of "
            "this epoch are read again and dropped")
        return itertools.islice(self.loader, batches, None)


@contextlib.contextmanager
def explicit_folder(accelerator: Any) -> Iterator[None]:
    """save_state into the folder given: with automatic_checkpoint_naming accelerate would pick its own (and count
    the save among the script's own, deleting old ones past total_limit)."""
    config: Any = getattr(accelerator, "project_configuration", None)
    automatic = bool(getattr(config, "automatic_checkpoint_naming", False))
    iteration = getattr(config, "iteration", 0)
    if automatic:
        config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        if config is not None:
            config.automatic_checkpoint_naming, config.iteration = automatic, iteration


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


def world_size(accelerator: Any) -> int:
    return int(getattr(accelerator, "num_processes", 1))
