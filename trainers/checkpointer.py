"""The shared trainer's checkpoints: sharded, optionally in the background, in trainers.checkpoint's folder protocol.

A step folder (RUN/checkpoints/step-N/) holds
  - the model's and the optimizer's tensors in torch's Distributed Checkpoint format (`.metadata`, `__R_0.distcp`):
    every rank writes the shards it holds (under DDP each replicated tensor is written once, by one of the ranks);
  - shared.pt (rank 0): the small states, i.e. the optimizer's param groups, scheduler, GradScaler and position;
  - rank-R.pt (every rank): its RNG states;
  - meta.json and FINISHED, written by rank 0 once every rank's files are on disk, then the rename
    (`.step-N.tmp` → `step-N`). A kill at any point leaves the earlier checkpoints and at most a `.tmp` folder.
All of it is read without executing pickled code: DCP reads tensors with weights_only, and only tensors are asked
for; the small files go through torch.load(weights_only=True).

Loading asks DCP for exactly the tensors this rank holds now, so a rank reads its own shards only, and a checkpoint
written by N ranks loads at M ranks (DCP maps the saved chunks onto the new sharding).

Asynchronous saves: the tensors are copied into host buffers (kept from one save to the next, pinned on GPUs), then a
thread writes, fsyncs and commits while training goes on. Its collectives (DCP's planning) run on a gloo group of
their own (DistContext.checkpoint_group). At most one save is in flight: the next save, a stop or the end waits for
it, and an error in the thread is raised there.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from trainers import checkpoint
from trainers.dist import DistContext
from trainers.faults import maybe_die

METADATA = ".metadata"
"""DCP's index of a step folder: present in the shared trainer's checkpoints, absent in save_checkpoint's."""


@dataclass
class Parts:
    """One checkpoint's content, by where it goes."""

    tensors: dict[str, Any]
    """The model and optimizer tensors (DTensor shards under FSDP): DCP files."""
    shared: dict[str, Any]
    """Small states every rank has the same copy of: shared.pt, written by rank 0."""
    own: dict[str, Any]
    """This rank's states (its RNG streams): rank-R.pt."""


class Checkpointer:
    def __init__(self, root: Path, ctx: DistContext, keep: int) -> None:
        self.root, self.ctx, self.keep = root, ctx, keep
        self.buffers: dict[str, torch.Tensor] = {}
        self.pending: threading.Thread | None = None
        self.failed: BaseException | None = None

    def save(self, step: int, parts: Parts, meta: dict[str, Any], background: bool) -> None:
        """Save step `step` on every rank; returns once committed, or (`background`) once the tensors are staged."""
        self.wait()
        tmp = checkpoint.begin(self.root, step, self.ctx.rank, self.ctx.barrier, self.keep)
        if not background:
            self.write(step, tmp, parts, meta)
            self.ctx.barrier()  # every rank returns knowing the checkpoint is committed
            return
        staged = Parts(stage(parts.tensors, self.buffers, ""), copy.deepcopy(parts.shared), copy.deepcopy(parts.own))
        self.pending = threading.Thread(target=self.write_in_background, args=(step, tmp, staged, meta),
                                        name=f"hpcjobs-save-{step}", daemon=True)
        self.pending.start()

    def write_in_background(self, step: int, tmp: Path, parts: Parts, meta: dict[str, Any]) -> None:
        try:
            self.write(step, tmp, parts, meta)
        except BaseException as e:  # noqa: BLE001 - raised by wait(), on the training thread
            self.failed = e

    def write(self, step: int, tmp: Path, parts: Parts, meta: dict[str, Any]) -> None:
        rank = self.ctx.rank
        checkpoint.write_files(self.root, tmp, step, rank, parts.shared, parts.own)
        maybe_die("save-shards", step)
        with checkpoint.full_disk_explained(self.root, tmp, step, rank):
            # Returns on rank 0 only once every rank has written its shards (DCP gathers their results before it
            # writes .metadata), and each rank wrote its rank-R.pt before: rank 0 may then commit alone.
            dcp.save(parts.tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                     process_group=self.ctx.checkpoint_group)
        maybe_die("save-written", step)
        if rank == 0:
            checkpoint.commit(self.root, tmp, step, {"world_size": self.ctx.world_size, **meta}, self.keep)

    def wait(self) -> None:
        """Until the save in flight (if any) is committed on this rank's side; raises what it raised."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    def settle(self, timeout: float) -> None:
        """On the way out of a failed start: let a save in flight commit (a crash in the task must not cost the
        checkpoint that was being written), for at most `timeout` seconds; its own error is dropped (the one being
        raised is the story)."""
        if self.pending is not None:
            self.pending.join(timeout)

    def load(self, ref: checkpoint.CheckpointRef, tensors: dict[str, Any]) -> None:
        """Fill `tensors` (this rank's model and optimizer tensors, any sharding) in place from `ref`; every rank
        calls it. Raises checkpoint.CorruptCheckpoint on every rank if any rank could not read its part."""
        if not (ref.path / METADATA).is_file():
            raise checkpoint.CorruptCheckpoint(f"{METADATA} is missing (not a sharded checkpoint)")
        try:
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(ref.path), process_group=self.ctx.checkpoint_group)
        except Exception as e:  # noqa: BLE001 - DCP wraps every rank's error into one CheckpointException
            raise unreadable(e) from None


def stage(state: Any, buffers: dict[str, torch.Tensor], key: str) -> Any:
    """A copy of `state` whose tensors live in host buffers that are reused by the next save (pinned when the
    tensors are on a GPU: the copy is then a DMA). DTensors stay DTensors (same mesh and placements) around their
    local shard's copy, so DCP plans the same write."""
    if isinstance(state, dict):
        return {k: stage(v, buffers, f"{key}.{k}") for k, v in state.items()}
    if isinstance(state, DTensor):
        local = _stage_tensor(state.to_local(), buffers, key)
        return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False, shape=state.shape,
                                  stride=state.stride())
    if isinstance(state, torch.Tensor):
        return _stage_tensor(state, buffers, key)
    return copy.deepcopy(state)


def _stage_tensor(t: torch.Tensor, buffers: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    buf = buffers.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        buffers[key] = buf
    buf.copy_(t.detach(), non_blocking=t.is_cuda)
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()  # the thread must read whole copies
    return buf


def model_weights(ref: checkpoint.CheckpointRef) -> dict[str, torch.Tensor]:
    """The whole model of a finished checkpoint, in either layout (sharded, or save_checkpoint's shared.pt), on the
    CPU and without a process group; raises checkpoint.CorruptCheckpoint."""
    if not (ref.path / METADATA).is_file():
        shared, _ = checkpoint.read_states(ref, 0, shared_keys=("model",), own=False)
        return dict(shared["model"])
    try:
        return offline_tensors(ref.path, "model.")
    except Exception as e:  # noqa: BLE001 - DCP raises its own types for torn files
        raise unreadable(e) from None


def unreadable(e: BaseException) -> checkpoint.CorruptCheckpoint:
    return checkpoint.CorruptCheckpoint(f"sharded tensors: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def offline_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The full tensors saved under `prefix` (e.g. "model.") in a sharded step folder, on the CPU, without a process
    group: for `hpcjobs export` and tests. Every shard is read (this is the whole model, on purpose)."""
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    wanted = {fqn: torch.empty(m.size, dtype=m.properties.dtype)
              for fqn, m in meta.state_dict_metadata.items()
              if fqn.startswith(prefix) and isinstance(m, dcp.metadata.TensorStorageMetadata)}
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {fqn.removeprefix(prefix): t for fqn, t in wanted.items()}

