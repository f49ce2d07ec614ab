"""The torch files of a step folder: shared.pt (rank 0) and rank-R.pt (every rank), written fsynced and without zip
CRCs, read back without executing pickled code (weights_only) and checked before anything is applied."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint.errors import CorruptCheckpoint, corrupt
from trainers.checkpoint.folder import SHARED, CheckpointRef, full_disk_explained


class _Crc32Off:
    """`with no_crc32():` torch.save without the zip CRC32 of each record: computing it costs more than the disk write
    (~9x here, see bench/checkpoint.py) and torch.load never checks it; torn files are already excluded by the
    fsync + FINISHED marker + atomic rename protocol. The setting is process-wide and the background writer saves
    while the training thread may too: the first one in turns it off, the last one out restores it."""

    def __init__(self) -> None:
        self.lock, self.inside, self.saved = threading.Lock(), 0, True

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        from torch.utils.serialization import config

        with self.lock:
            if self.inside == 0:
                self.saved, config.save.compute_crc32 = config.save.compute_crc32, False
            self.inside += 1
        try:
            yield
        finally:
            with self.lock:
                self.inside -= 1
                if self.inside == 0:
                    config.save.compute_crc32 = self.saved


no_crc32 = _Crc32Off()


def _write(obj: Any, path: Path) -> None:
    with no_crc32(), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_files(root: Path, tmp: Path, step: int, rank: int, shared: Any, per_rank: Any) -> None:
    """Step 2's own files: shared.pt (rank 0) and rank-R.pt, each fsynced."""
    with full_disk_explained(root, tmp, step, rank):
        if rank == 0:
            _write(shared, tmp / SHARED)
        _write(per_rank, tmp / f"rank-{rank}.pt")


def load_checkpoint(ref: CheckpointRef, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared state, this rank's state), loaded without executing pickled code."""
    shared = torch.load(ref.path / SHARED, map_location="cpu", weights_only=True)
    mine = ref.path / f"rank-{rank}.pt"
    per_rank = torch.load(mine, map_location="cpu", weights_only=True) if mine.exists() else {}
    return shared, per_rank


def read_states(ref: CheckpointRef, rank: int, shared_keys: tuple[str, ...] = (),
                own_keys: tuple[str, ...] = (), own: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared state, this rank's state), read whole into memory and checked for the keys given before anything is
    applied (a partly applied checkpoint would leave a fresh start with its weights); raises CorruptCheckpoint. Unlike
    load_checkpoint, this rank's file must exist (save_checkpoint always writes one) unless `own` is False, when it
    is not read at all ({} instead)."""
    out = []
    for name, keys in ((SHARED, shared_keys), (f"rank-{rank}.pt", own_keys))[:2 if own else 1]:
        path = ref.path / name
        if not path.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for a torn or foreign file
            raise corrupt(name, e) from None
        missing = [k for k in keys if not isinstance(state, dict) or k not in state]
        if missing:
            raise CorruptCheckpoint(f"{name} lacks {', '.join(missing)}")
        out.append(state)
    return out[0], out[1] if own else {}
