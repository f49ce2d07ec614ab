"""Atomic checkpoints: RUN/checkpoints/step-N/, only finished ones count. `save_checkpoint` (one shared.pt, for
users' own scripts) is below; the shared trainer writes a sharded layout (trainers.checkpointer) through the same
three steps (`begin`, `write_files`, `commit`).

Saving (every rank takes part, in this order):
  1. rank 0 clears a stale `.step-N.tmp` left by a killed save, creates it; barrier
  2. rank 0 writes shared.pt (model, optimizer, scheduler, scaler, progress, config); every rank writes
     rank-R.pt (its RNG states); each file is fsynced; barrier
  3. rank 0 writes meta.json and the FINISHED marker (fsynced), fsyncs the folder, renames it to step-N, fsyncs
     the parent, then prunes older checkpoints beyond `keep` (never the newest finished one, never the one
     best.json names); barrier
A process killed at any instant leaves either the previous finished checkpoints untouched or a `.tmp` folder that
the loader ignores and the next save clears. Loading uses torch.load(weights_only=True): no arbitrary pickle.

A finished checkpoint can still be unreadable later (a disk or filesystem fault, a file truncated by hand): the
trainer then moves it aside to RUN/checkpoints/corrupt/step-N (`move_aside`, never deleted: it is the user's to look
at) and resumes from the next newest one (trainers.resume).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.faults import maybe_die

FINISHED = "FINISHED"
SHARED = "shared.pt"
BEST = "best.json"
CORRUPT = "corrupt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / "meta.json").read_text())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)  # a directory opened read-only can be fsynced on Linux


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


def finished(root: Path) -> list[CheckpointRef]:
    """Finished checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    refs = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / FINISHED).is_file():
            refs.append(CheckpointRef(int(m.group(1)), p))
    return sorted(refs, key=lambda r: r.step)


def latest(root: Path) -> CheckpointRef | None:
    refs = finished(root)
    return refs[-1] if refs else None


def save_checkpoint(root: Path, step: int, shared: dict[str, Any] | None, per_rank: dict[str, Any], *,
                    rank: int = 0, world_size: int = 1, barrier: Callable[[], None] = lambda: None,
                    keep: int = 2, meta: dict[str, Any] | None = None) -> Path:
    """Save atomically; call on every rank with the same step. `shared` is only read on rank 0."""
    tmp = begin(root, step, rank, barrier, keep)
    write_files(root, tmp, step, rank, shared, per_rank)
    maybe_die("save-written", step)
    barrier()
    if rank == 0:
        commit(root, tmp, step, {"world_size": world_size, **(meta or {})}, keep)
    barrier()
    return root / f"step-{step}"


def begin(root: Path, step: int, rank: int, barrier: Callable[[], None], keep: int) -> Path:
    """Step 1 of a save, on every rank: rank 0 clears a stale `.step-N.tmp` and makes it anew; all wait for it."""
    if keep < 2:
        raise ValueError("keep must be at least 2: the newest finished checkpoint is never the only copy")
    tmp = root / f".step-{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    return tmp


def write_files(root: Path, tmp: Path, step: int, rank: int, shared: Any, per_rank: Any) -> None:
    """Step 2's own files: shared.pt (rank 0) and rank-R.pt, each fsynced."""
    with full_disk_explained(root, tmp, step, rank):
        if rank == 0:
            _write(shared, tmp / SHARED)
        _write(per_rank, tmp / f"rank-{rank}.pt")


def commit(root: Path, tmp: Path, step: int, meta: dict[str, Any], keep: int) -> None:
    """Step 3, rank 0, once every rank's files are written: meta.json and FINISHED, the rename, the pruning."""
    info = {"step": step, **meta}
    with full_disk_explained(root, tmp, step, 0):
        (tmp / "meta.json").write_text(json.dumps(info, sort_keys=True, default=str))
        _fsync_file(tmp / "meta.json")
        (tmp / FINISHED).write_text(f"{step}\n")
        _fsync_file(tmp / FINISHED)
        _fsync_dir(tmp)
    maybe_die("save-marked", step)
    final = root / f"step-{step}"
    if final.exists():  # the same step saved again (a stop request right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    maybe_die("save-renamed", step)
    prune(root, keep)


class CheckpointSpaceError(RuntimeError):
    """A checkpoint did not fit: the disk or the quota is full."""


@contextlib.contextmanager
def full_disk_explained(root: Path, tmp: Path, step: int, rank: int) -> Iterator[None]:
    """Writes of a checkpoint: a full disk or quota inside becomes a CheckpointSpaceError; anything else passes."""
    try:
        yield
    except BaseException as e:  # OSError; RuntimeError from torch.save; DCP's CheckpointException (a BaseException)
        full = space_error(e, root, tmp, step, rank) if isinstance(e, Exception) or hasattr(e, "failures") else None
        if full is None:
            raise
        raise full from None


def full_disk(e: BaseException) -> OSError | None:
    """The full disk or quota error inside `e` (torch.save turns it into a RuntimeError whose __context__ it is, DCP
    gathers each rank's into a CheckpointException), None when `e` is something else."""
    cause: BaseException | None = e
    while cause is not None and getattr(cause, "errno", None) not in (errno.ENOSPC, errno.EDQUOT):
        inner = dcp_failures(cause)
        cause = inner[0][1] if inner else cause.__cause__ or cause.__context__
    return cause if isinstance(cause, OSError) else None


def dcp_failures(e: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, what it raised) for each rank that failed inside DCP, whose CheckpointException gathers them as
    {rank: (exception, traceback)}; [] for any other exception."""
    wrapped = getattr(e, "failures", None)
    if not isinstance(wrapped, dict):
        return []
    inner = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(wrapped.items())]
    return [(rank, x) for rank, x in inner if isinstance(x, BaseException)]


def space_error(e: BaseException, root: Path, tmp: Path, step: int, rank: int) -> CheckpointSpaceError | None:
    """The error to raise when `e` (or what it wraps) is a full disk or quota, None otherwise. The unfinished folder
    is removed at once."""
    cause = full_disk(e)
    if cause is None:
        return None
    # Every rank (whichever removes it first): the space is what the user needs back, and what the ranks need to
    # record their failure in the run folder; nothing in it was ever going to be loaded.
    shutil.rmtree(tmp, ignore_errors=True)
    previous = latest(root)
    size = sum(p.stat().st_size for p in previous.path.iterdir()) if previous else None
    free = shutil.disk_usage(root).free
    return CheckpointSpaceError(
        f"checkpoint step-{step} does not fit in {root}: {os.strerror(getattr(cause, 'errno', 0))} ({free:,} bytes "
        "free; "
        + (f"a checkpoint of this run takes {size:,} bytes, {previous.path.name} is intact and the run resumes from "
           "it" if previous and size else "no finished checkpoint yet") +
        "). HINT: free space there (or lower --keep), then submit the same run again")


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` finished checkpoints, and the best one (best.json) if any."""
    best = read_best(root)
    for ref in finished(root)[:-keep]:
        if best is None or ref.step != best["step"]:
            shutil.rmtree(ref.path, ignore_errors=True)


def read_best(root: Path) -> dict[str, Any] | None:
    """{"step": N, "metric": name, "value": x} of the best finished checkpoint, or None."""
    try:
        return json.loads((root / BEST).read_text())
    except (OSError, ValueError):
        return None


def mark_best(root: Path, step: int, metric: str, value: float) -> None:
    """Name step-N as the best (rank 0, after it is committed): written aside, fsynced, renamed over best.json, so
    a kill leaves the old or the new record, and the checkpoint it names is always a finished one."""
    tmp = root / f".{BEST}.tmp"
    tmp.write_text(json.dumps({"step": step, "metric": metric, "value": value}))
    _fsync_file(tmp)
    os.replace(tmp, root / BEST)
    _fsync_dir(root)


def load_checkpoint(ref: CheckpointRef, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared state, this rank's state), loaded without executing pickled code."""
    shared = torch.load(ref.path / SHARED, map_location="cpu", weights_only=True)
    mine = ref.path / f"rank-{rank}.pt"
    per_rank = torch.load(mine, map_location="cpu", weights_only=True) if mine.exists() else {}
    return shared, per_rank


class CorruptCheckpoint(Exception):
    """A finished checkpoint that cannot be read; the message says which file and why, on one line."""


def why_unreadable(name: str, e: BaseException) -> CorruptCheckpoint:
    """`name` (a file of the checkpoint) and the first sentence of what reading it raised, on one line."""
    text = " ".join(str(e).split())
    text = text.split(". ")[0][:200]  # torch's first sentence says it; the rest is advice about other causes
    return CorruptCheckpoint(f"{name}: {type(e).__name__}: {text}" if text else f"{name}: {type(e).__name__}")


def read_meta(ref: CheckpointRef) -> dict[str, Any]:
    """meta.json of a finished checkpoint; raises CorruptCheckpoint."""
    try:
        meta = ref.meta()
    except (OSError, ValueError) as e:
        raise why_unreadable("meta.json", e) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CorruptCheckpoint(f"meta.json holds no step: {str(meta)[:100]!r}")
    return meta


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
            raise why_unreadable(name, e) from None
        missing = [k for k in keys if not isinstance(state, dict) or k not in state]
        if missing:
            raise CorruptCheckpoint(f"{name} lacks {', '.join(missing)}")
        out.append(state)
    return out[0], out[1] if own else {}


def move_aside(root: Path, ref: CheckpointRef) -> Path:
    """Rank 0: rename an unreadable checkpoint to root/corrupt/step-N (step-N.1, ... if that is taken), atomically:
    `finished()` no longer sees it, and nothing is deleted."""
    aside = root / CORRUPT
    aside.mkdir(exist_ok=True)
    target, n = aside / ref.path.name, 0
    while target.exists():
        n += 1
        target = aside / f"{ref.path.name}.{n}"
    os.rename(ref.path, target)
    _fsync_dir(root)
    _fsync_dir(aside)
    return target
