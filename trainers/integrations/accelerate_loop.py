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

The loop, its stop and its resume are trainers/integrations/loop.py's, shared with deepspeed_loop.py; what is
accelerate's here: `save_state`/`load_state`, a position file per rank, `sync_gradients`, `skip_first_batches`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainers.integrations.loop import ResumableLoop, checked, generators, set_epoch, start, states_folder
from trainers.integrations.marks import rank, say

__all__ = ["FOLDER", "POSITION", "Loop", "explicit_folder", "generators", "resumable", "set_epoch", "world_size"]

FOLDER = "accelerate"
"""Under the run folder's checkpoints/: the states a `resumable` loop saved."""
POSITION = "hpcjobs-position-{rank}.pt"
"""Each rank's place in the data, beside accelerate's own files in `checkpoint-N/`."""


def resumable(accelerator: Any, dataloader: Any, epochs: int = 1, max_steps: int | None = None, save_every: int = 0,
              epoch_end: Callable[[int], None] | None = None, folder: str | Path | None = None) \
        -> Iterator[tuple[int, Any]]:
    """The training loop's `(step, batch)` pairs, `step` counted from 0 over all epochs, as `enumerate` would, and
    resumed where a stop left it. `epochs` passes over `dataloader` (a prepared one, or any DataLoader), at most
    `max_steps` steps; `epoch_end(epoch)` runs after each epoch's last step (the script's per-epoch work: evaluation,
    an epoch scheduler). `folder`: where the states go, by default `RUN/checkpoints/accelerate` (outside a launched
    rank: `hpcjobs-checkpoints/` in the working directory)."""
    checked(epochs, max_steps, save_every)
    if getattr(dataloader, "use_stateful_dataloader", False):
        say("resumable() was given a stateful DataLoader (use_stateful_dataloader=True), whose position accelerate "
            "saves itself; valid: a DataLoader hpcjobs skips into. HINT: leave use_stateful_dataloader off, or keep "
            "your own loop")
        raise SystemExit(2)
    return start(Loop(accelerator, dataloader, epochs, max_steps, save_every, epoch_end,
                      states_folder(folder, FOLDER)))


class Loop(ResumableLoop):
    """The shared loop, its states saved and loaded by the Accelerator (`self.owner`)."""

    def boundary(self) -> bool:
        return bool(getattr(self.owner, "sync_gradients", True))

    def write(self, folder: Path, position: dict[str, Any]) -> None:
        with explicit_folder(self.owner):
            self.owner.save_state(str(folder))
        torch.save({**position, "world_size": world_size(self.owner)}, folder / POSITION.format(rank=rank()))

    def load(self, newest: Path) -> dict[str, Any]:
        mine = newest / POSITION.format(rank=rank())
        saved = torch.load(mine, weights_only=False) if mine.is_file() else None
        if saved is None or saved["world_size"] != world_size(self.owner):
            was = f"was saved by {saved['world_size']} ranks" if saved else f"holds no position of rank {rank()}"
            say(f"{newest} {was}, this start has {world_size(self.owner)}: its data positions do not carry "
                "over. HINT: resume with as many ranks, or give this run another --run-dir to start over")
            raise SystemExit(2)  # on every rank
        say(f"resuming from {newest}")
        self.owner.load_state(str(newest))
        return dict(saved)

    def skip_loader(self, batches: int) -> Any:
        return self.owner.skip_first_batches(self.loader, batches)


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


def world_size(accelerator: Any) -> int:
    return int(getattr(accelerator, "num_processes", 1))
