"""The shared trainer's checkpoints: sharded, optionally in the background, in trainers.checkpoint's folder protocol.
The Checkpointer is handed the trainer's named parts once (trainers.checkpoint.stateful) and saves and loads them by
name; where each goes is the part's place. With the trainer's parts, a step folder (RUN/checkpoints/step-N/) holds
  - the SHARDED parts' tensors (model, optimizer) in torch's Distributed Checkpoint format (`.metadata`,
    `__R_0.distcp`) under each part's name: every rank writes the shards it holds, and each tensor that every rank
    holds whole (all of them under DDP) is written by one rank, chosen before anything is copied (written_here);
  - shared.pt (rank 0): the small states, i.e. the optimizer's param groups, scheduler, GradScaler and position;
  - rank-R.pt (every rank): its RNG states;
  - meta.json and FINISHED, written by rank 0 once every rank's files are on disk, then the rename
    (`.step-N.tmp` → `step-N`). A kill at any point leaves the earlier checkpoints and at most a `.tmp` folder.
All of it is read without executing pickled code: `.metadata` (a pickle) through an allowlist of DCP's own metadata
classes (SafeReader), tensors with weights_only (a checkpoint holding anything else is refused), the small files
through torch.load(weights_only=True).

Loading asks DCP for exactly the tensors this rank holds now, so a rank reads its own shards only, and a checkpoint
written by N ranks loads at M ranks (DCP maps the saved chunks onto the new sharding).

Asynchronous saves: the tensors this rank writes are copied into host buffers (kept from one save to the next,
pinned on GPUs, allocated by a thread after the first step, not inside the first save), then a thread writes,
fsyncs and commits while training goes on. Only the model's buffers are copied before save() returns (a forward may
change them); parameters and optimizer state change only in the optimizer's step, so the thread copies them while
the next step's forward and backward run, and the trainer calls `before_update()` before each optimizer step to wait
for that copy. Its collectives (DCP's planning) run on a gloo group of their own (DistContext.checkpoint_group). At
most one save is in flight: the next save, a stop or the end waits for it, and an error in the thread is raised there.
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpcjobs.protocol.settings.trainflags import ResumeError
from trainers import checkpoint, ranklog
from trainers.checkpoint import saves
from trainers.checkpoint.dcp_files import METADATA, SafeReader, Writer, flat, mismatch, unreadable, written_here
from trainers.checkpoint.staging import reserve, specs, stage
from trainers.checkpoint.stateful import Parts, Place, Stateful, gather, place_of, small_entries
from trainers.dist import DistContext
from trainers.faults import maybe_die


class Checkpointer:
    """The one checkpoint manager of a trainer: handed its named parts once (trainers.checkpoint.stateful), it saves
    and loads them by name, and knows nothing else of the trainer."""

    def __init__(self, root: Path, ctx: DistContext, keep: int, states: Mapping[str, Stateful], every: int = 0,
                 last_step: int = 0) -> None:
        self.root, self.ctx, self.keep, self.states = root, ctx, keep, dict(states)
        self.every, self.last_step = every, last_step
        """The periodic interval (--ckpt-every; 0: none) and the run's last step, whose save is the end's own."""
        self.buffers: dict[str, torch.Tensor] = {}
        self.pending: threading.Thread | None = None
        self.staged: threading.Event | None = None
        self.failed: BaseException | None = None
        self.waited_s = 0.0
        """How long the last save() waited for the one before it (still being written): saves.jsonl says so."""
        self.previous: tuple[int, float] | None = None  # the last save's step and when it began (time.monotonic)
        self.advised = False
        self.reserving: threading.Thread | None = None  # reserve_in_background's

    def should_save(self, step: int) -> bool:
        """Whether the step just finished is a periodic save (torchtitan's should_save): the interval is the
        manager's; a stop's and the end's saves are asked for by the trainer."""
        return bool(self.every) and step % self.every == 0 and step < self.last_step

    def names(self, place: Place) -> tuple[str, ...]:
        """The keys a step folder's small file must hold for a load (shared.pt: SHARED; rank-R.pt: OWN)."""
        if place is Place.SHARED:
            return tuple(n for n, p in self.states.items() if place_of(p) is Place.SHARED) + tuple(
                kept for p in self.states.values() if place_of(p) is Place.SHARDED
                for kept in small_entries(p).values())
        return tuple(n for n, p in self.states.items() if place_of(p) is place)

    def save(self, step: int, meta: dict[str, Any], background: bool) -> None:
        """Save step `step` on every rank; returns once committed, or (`background`) once the tensors are staged.
        A background save that failed is raised here, except before a foreground save (a stop, the end), which is
        then the retry: a preemption must not lose its checkpoint to an earlier failure."""
        began = time.monotonic()
        if self.reserving is not None:
            self.reserving.join()
            self.reserving = None
        try:
            self.wait()
        except Exception as e:
            if background:
                raise
            ranklog.warn(f"hpcjobs: rank {self.ctx.rank}: the background save before step {step} failed ({e}); saving "
                         f"step {step} in the foreground", every_rank=True)
        self.waited_s = time.monotonic() - began
        if background and self.previous and self.waited_s > saves.WAIT_ADVICE_S and not self.advised:
            self.advised = True
            if self.ctx.rank == 0:
                ranklog.warn(saves.wait_advice(step, self.previous[0], began - self.previous[1], self.waited_s),
                             rank=self.ctx.rank)
        self.previous = (step, began)
        tmp = checkpoint.begin(self.root, step, self.ctx.rank, self.ctx.barrier, self.keep)
        parts = gather(self.states)
        parts.tensors = written_here(parts.tensors, self.ctx.rank, self.ctx.world_size)
        if not background:
            self.write(step, tmp, parts, meta)
            self.ctx.barrier()  # every rank returns knowing the checkpoint is committed
            return
        tensors, now = parts.tensors, parts.now
        changing = stage({n: {k: v for k, v in t.items() if k in now[n]} for n, t in tensors.items()}, self.buffers,
                         "", self.ctx.device)
        later = {n: {k: v for k, v in t.items() if k not in now[n]} for n, t in tensors.items()}
        small = Parts(changing, copy.deepcopy(parts.shared), copy.deepcopy(parts.own))
        self.staged = threading.Event()
        self.pending = threading.Thread(target=self.write_in_background, args=(step, tmp, small, later, meta),
                                        name=f"hpcjobs-save-{step}", daemon=True)
        self.pending.start()

    def reserve_in_background(self) -> None:
        """Allocate the host buffers of this rank's background saves in a thread now (after the first step: the
        optimizer's state exists), not inside the first save, where the optimizer step waits for them. The first
        save waits for this thread if it is still at work. Not yet measured on a GPU."""
        wanted = specs(written_here(gather(self.states).tensors, self.ctx.rank, self.ctx.world_size))
        self.reserving = threading.Thread(target=reserve, args=(wanted, self.buffers), name="hpcjobs-host-buffers",
                                          daemon=True)
        self.reserving.start()

    def write_in_background(self, step: int, tmp: Path, parts: Parts, later: dict[str, Any],
                            meta: dict[str, Any]) -> None:
        """The thread of an asynchronous save: copy the parameters and optimizer state into the host buffers while
        the next step's forward and backward run (they change neither), let the optimizer step go on, then write."""
        assert self.staged is not None
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)  # the current device is per thread: copies wait on this one's stream
        try:
            try:
                staged = stage(later, self.buffers, "", self.ctx.device)
            finally:
                self.staged.set()
            parts.tensors = {n: {**parts.tensors[n], **t} for n, t in staged.items()}
            self.write(step, tmp, parts, meta)
        except BaseException as e:  # noqa: BLE001 - raised by wait(), on the training thread
            self.failed = e

    def write(self, step: int, tmp: Path, parts: Parts, meta: dict[str, Any]) -> None:
        rank = self.ctx.rank
        try:
            checkpoint.write_files(self.root, tmp, step, rank, parts.shared, parts.own)
            mine: tuple[str, bool] = ("", False)
        except Exception as e:  # noqa: BLE001 - every rank must learn it before DCP's collectives, or they would hang
            mine, error = (str(e), isinstance(e, checkpoint.CheckpointSpaceError)), e
        words = [mine]
        if self.ctx.checkpoint_group is not None:
            words = [("", False)] * self.ctx.world_size
            dist.all_gather_object(words, mine, group=self.ctx.checkpoint_group)
        if mine[0]:
            raise error
        failed = next((w for w in words if w[0]), None)
        if failed is not None:  # another rank's: the same error here (a full disk is a full disk on every rank)
            if failed[1]:
                shutil.rmtree(tmp, ignore_errors=True)
                raise checkpoint.CheckpointSpaceError(failed[0])
            raise RuntimeError(f"checkpoint step-{step} was not written: {failed[0]}")
        maybe_die("save-shards", step)
        with checkpoint.full_disk_explained(self.root, tmp, step, rank):
            # Returns on rank 0 only once every rank has written its shards (DCP gathers their results before it
            # writes .metadata), and each rank wrote its rank-R.pt before: rank 0 may then commit alone.
            dcp.save(parts.tensors, storage_writer=Writer(tmp, sync_files=True),
                     process_group=self.ctx.checkpoint_group)
        maybe_die("save-written", step)
        if rank == 0:
            checkpoint.commit(self.root, tmp, step, {"world_size": self.ctx.world_size, **meta}, self.keep)

    def check(self) -> None:
        """After each step: a background save that has failed is raised now, not at the next save (a full disk
        should end the run at once, not after another interval that cannot be saved)."""
        if self.pending is not None and self.failed is not None and not self.pending.is_alive():
            self.wait()

    def before_update(self) -> None:
        """Before each optimizer step (the only thing that changes parameters and optimizer state): wait until a
        save in flight has copied them."""
        if self.staged is not None:
            self.staged.wait()
            self.staged = None

    def wait(self) -> None:
        """Until the save in flight (if any) is committed on this rank's side; raises what it raised."""
        if self.pending is not None:
            self.pending.join()
            self.pending = self.staged = None
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    def settle(self, timeout: float) -> None:
        """On the way out of a failed start: let a save in flight commit (a crash in the task must not cost the
        checkpoint that was being written), for at most `timeout` seconds; its own error is dropped (the one being
        raised is the story)."""
        if self.pending is not None:
            self.pending.join(timeout)

    def load(self, ref: checkpoint.CheckpointRef, shared: dict[str, Any], own: dict[str, Any]) -> None:
        """Every rank: load each part from `ref`, whose small files are read already (`shared`, and this rank's
        `own`: {} after a reshard, when the OWN parts are left as they are). The SHARDED parts first, their tensors
        read straight into this rank's (any sharding), then the others in the order they were named."""
        templates: dict[str, dict[str, Any]] = {}
        for name, part in self.states.items():
            if place_of(part) is Place.SHARDED:
                templates[name] = part.state_dict()  # the live tensors: filled in place
                for key in small_entries(part):
                    templates[name].pop(key)
        self.read_tensors(ref, templates)
        for name, part in self.states.items():
            place = place_of(part)
            if place is Place.SHARDED:
                part.load_state_dict({**templates[name], **{k: shared[kept] for k, kept in
                                                            small_entries(part).items()}})
            elif place is Place.SHARED:
                part.load_state_dict(shared[name])
            elif own:
                part.load_state_dict(own[name])

    def read_tensors(self, ref: checkpoint.CheckpointRef, tensors: dict[str, Any]) -> None:
        """Fill `tensors` (this rank's tensors of the SHARDED parts, any sharding) in place from `ref`; every rank
        calls it. Raises ResumeError when the checkpoint holds other tensors than these (the model changed), and
        checkpoint.CorruptCheckpoint on every rank if any rank could not read its part."""
        if not (ref.path / METADATA).is_file():
            raise checkpoint.CorruptCheckpoint(f"{METADATA} is missing (not a sharded checkpoint)")
        reader = SafeReader(ref.path)
        try:
            saved = reader.read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - a torn or foreign file: pickle raises many types
            raise unreadable(e) from None
        differ = [why for key, t in flat(tensors) if (why := mismatch(key, t, saved))]
        if differ:
            raise ResumeError(f"checkpoint {ref.path} holds other tensors than this model and optimizer "
                              f"({'; '.join(differ[:3])}{'; …' if len(differ) > 3 else ''}). HINT: resume with "
                              "the model it was written for, or start a new --run-dir")
        try:
            dcp.load(tensors, storage_reader=reader, process_group=self.ctx.checkpoint_group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's error into one
            raise unreadable(e) from None
