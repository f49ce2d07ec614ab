"""A raw DeepSpeed training loop under hpcjobs's stop protocol, with one changed line: the loop's header.

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for epoch in range(num_epochs):                                   # before
        for step, batch in enumerate(loader):
    for step, batch in resumable(engine, loader, epochs=num_epochs):  # after

The loop, the stop checks at the cadence, the skip into the resumed epoch and the progress records are the accelerate
helper's (trainers/integrations/loop.py, shared with accelerate_loop.py); what is DeepSpeed's here:

- The save: `engine.save_checkpoint(RUN/checkpoints/deepspeed, tag="checkpoint-N", client_state=...)`, DeepSpeed's
  own format (the model, each rank's ZeRO shard of the optimizer, the scheduler given to `deepspeed.initialize`),
  between the pending and completion marks of marks.py. `client_state` holds every rank's place in the data and its
  RNG streams (gathered to every rank: DeepSpeed writes `client_state` once, from data-parallel rank 0). A save
  waits for a step that ended a gradient accumulation (the engine's micro-step count a multiple of
  `gradient_accumulation_steps()`): the accumulated gradients are not in a checkpoint.
- The resume, at the loop's first batch: the newest complete `checkpoint-N` (an incomplete one moved aside with one
  line) with `engine.load_checkpoint(folder, tag)`, then this rank's RNG streams and data position from its
  client_state. DeepSpeed restores `global_steps`, not its micro-step count: a resume starts at an accumulation's
  first micro-batch, where the count's remainder is 0 again.
- A checkpoint is tied to the world size that wrote it (one ZeRO shard per rank, and one data position per rank):
  another is refused in one line, exit 2 on every rank, before DeepSpeed reads a shard, naming DeepSpeed's
  universal-checkpoint conversion, as the Hugging Face integration refuses its DeepSpeed checkpoints
  (hf_trainer.same_world_size).
- A torch DataLoader (a DistributedSampler's, a shuffled one's) is skipped into by index, its batch sampler's first
  batches dropped without reading their samples; a DeepSpeedDataLoader (`training_data=` given to initialize) or an
  IterableDataset is read again up to the stop, with one line saying so.

Measured here (CPU, gloo, 2 ranks, deepspeed 0.19.8, tests/test_deepspeed_loop.py): ZeRO-2 and ZeRO-3, a Ctrl-C
after 12 steps saves at step 13, the same command resumes there, and the 30 losses and the final weights are
bit-identical to an uninterrupted run's; with gradient_accumulation_steps 2 the stop asked at step 13 waits for
step 14 and the resume is as exact (a run by hand); a resume with another seed differs from step 14 on. A 30-step run
of the example takes ~20 s on 2 CPU ranks, ~11 s of it DeepSpeed's start; the first DeepSpeed start on a machine
also builds its shared-memory op (deepspeed_shm_comm, ~110 s here, then cached under ~/.cache/torch_extensions).
`HPCJOBS_HOOKS=0` makes `resumable` the plain loop over the epochs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint.state import rng_state, set_rng_state
from trainers.integrations.loop import ResumableLoop, checked, start, states_folder
from trainers.integrations.marks import rank, say

FOLDER = "deepspeed"
"""Under the run folder's checkpoints/: the checkpoints a `resumable` DeepSpeed loop saved (one tag each)."""
POSITIONS = "hpcjobs_positions"
"""The client_state key of every rank's place in the data and RNG streams, by rank."""
_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def resumable(engine: Any, dataloader: Any, epochs: int = 1, max_steps: int | None = None, save_every: int = 0,
              epoch_end: Callable[[int], None] | None = None, folder: str | Path | None = None) \
        -> Iterator[tuple[int, Any]]:
    """The training loop's `(step, batch)` pairs for the engine `deepspeed.initialize` returned, `step` counted from
    0 over all epochs (one a micro-batch), as `enumerate` would, and resumed where a stop left it. `epochs` passes
    over `dataloader`, at most `max_steps` steps; `epoch_end(epoch)` runs after each epoch's last step. `folder`:
    where the checkpoints go, by default `RUN/checkpoints/deepspeed` (outside a launched rank:
    `hpcjobs-checkpoints/` in the working directory)."""
    checked(epochs, max_steps, save_every)
    return start(Loop(engine, dataloader, epochs, max_steps, save_every, epoch_end, states_folder(folder, FOLDER)))


class Loop(ResumableLoop):
    """The shared loop, its checkpoints saved and loaded by the DeepSpeed engine (`self.owner`)."""

    def boundary(self) -> bool:
        accumulate = self.owner.gradient_accumulation_steps() if hasattr(self.owner, "micro_steps") else 1
        return int(getattr(self.owner, "micro_steps", 0)) % int(accumulate) == 0

    def write(self, folder: Path, position: dict[str, Any]) -> None:
        mine = {**position, "rng": rng_state(self.device), "world_size": world_size(self.owner)}
        self.owner.save_checkpoint(str(folder.parent), tag=folder.name, client_state={POSITIONS: gathered(mine)},
                                    save_latest=False)

    def load(self, newest: Path) -> dict[str, Any]:
        same_world_size(newest, world_size(self.owner))
        say(f"resuming from {newest}")
        path, client = self.owner.load_checkpoint(str(newest.parent), tag=newest.name)
        positions = (client or {}).get(POSITIONS) if path is not None else None
        if not positions or len(positions) != world_size(self.owner):
            was = f"was saved by {len(positions)} ranks" if positions else "holds no data positions of hpcjobs"
            say(f"{newest} {was}, this start has {world_size(self.owner)}; valid: a checkpoint this loop saved at "
                "this world size. HINT: resume with as many ranks, or give this run another --run-dir to start over")
            raise SystemExit(2)  # on every rank: each read the same client_state
        mine = dict(positions[rank()])
        set_rng_state(mine["rng"], self.device)  # the streams at the stop (DeepSpeed saves none of them)
        return mine

    def skip_loader(self, batches: int) -> Any:
        return skip_batches(self.loader, batches)


def same_world_size(checkpoint: Path, world: int) -> None:
    """One ZeRO shard of the optimizer per rank: at another world size DeepSpeed fails on every rank once the model
    is built, or loads a wrong partition. Refused in one line before it reads one."""
    ranks = {m.group(1) for p in checkpoint.iterdir() if (m := _SHARD.search(p.name))}
    if ranks and len(ranks) != world:
        say(f"{checkpoint} holds DeepSpeed ZeRO shards for {len(ranks)} ranks and this start has {world} "
            f"rank{'s' if world != 1 else ''}; valid: the world size that wrote it (DeepSpeed's checkpoints and "
            f"this loop's data positions are tied to it). HINT: run with {len(ranks)} ranks, or convert it with "
            f"DeepSpeed's universal checkpoint conversion (python -m deepspeed.checkpoint.ds_to_universal "
            f"--input_folder {checkpoint} --output_folder ...) and load that with your own code in a new run")
        raise SystemExit(2)  # on every rank: each reads the same folder


def gathered(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's position, by rank, on every rank (one all-gather; the position alone without a group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def skip_batches(loader: torch.utils.data.DataLoader, batches: int) -> Any:
    """`loader` without its first `batches` batches: a DataLoader like it whose batch sampler drops their indices
    (no sample of theirs is read; the sampler draws its order, and the loader its workers' seed, as `loader` would).
    An IterableDataset, or a loader without a batch sampler, is read again up to there."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset) or loader.batch_sampler is None:
        import itertools

        return itertools.islice(loader, batches, None)
    return torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=SkipBatches(loader.batch_sampler, batches), num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers)


class SkipBatches:
    """A batch sampler's batches after its first `skip`."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[Any]:
        for i, indices in enumerate(self.inner):
            if i >= self.skip:
                yield indices

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def world_size(engine: Any) -> int:
    return int(getattr(engine, "world_size", 1))
