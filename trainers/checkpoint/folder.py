"""The checkpoint folder's layout and its three-step protocol (`begin`, files, `commit`): RUN/checkpoints/step-N/,
only finished ones count; retention, the best checkpoint, and moving an unreadable one aside. See
trainers/checkpoint/__init__.py for the protocol."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcjobs.protocol.atomic import fsync_path, write_atomic
from hpcjobs.protocol.runfolder import CHECKPOINT_DIR
from trainers import ddp_buckets
from trainers.checkpoint.errors import CheckpointSpaceError, CorruptCheckpoint, corrupt, full_disk
from trainers.faults import maybe_die

FINISHED = "FINISHED"
SHARED = "shared.pt"
BEST = "best.json"
CORRUPT = "corrupt"


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / "meta.json").read_text())


def finished(root: Path) -> list[CheckpointRef]:
    """Finished checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    refs = []
    for p in root.iterdir():
        m = CHECKPOINT_DIR.match(p.name)
        if m and (p / FINISHED).is_file():
            refs.append(CheckpointRef(int(m.group(1)), p))
    return sorted(refs, key=lambda r: r.step)


def latest(root: Path) -> CheckpointRef | None:
    refs = finished(root)
    return refs[-1] if refs else None


def begin(root: Path, step: int, rank: int, barrier: Callable[[], None], keep: int) -> Path:
    """Step 1 of a save, on every rank: rank 0 clears a stale `.step-N.tmp` and makes it anew; all wait for it."""
    if keep < 2:
        raise ValueError("keep must be at least 2: the newest finished checkpoint is never the only copy")
    tmp = root / f".step-{step}.tmp"
    if rank == 0:
        ddp_buckets.record()  # the layout a resume from this save needs (trainers/ddp_buckets.py)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    return tmp


def commit(root: Path, tmp: Path, step: int, meta: dict[str, Any], keep: int) -> None:
    """Step 3, rank 0, once every rank's files are written: meta.json and FINISHED, the rename, the pruning."""
    info = {"step": step, **meta}
    with full_disk_explained(root, tmp, step, 0):
        (tmp / "meta.json").write_text(json.dumps(info, sort_keys=True, default=str))
        fsync_path(tmp / "meta.json")
        (tmp / FINISHED).write_text(f"{step}\n")
        fsync_path(tmp / FINISHED)
        fsync_path(tmp)
    maybe_die("save-marked", step)
    final = root / f"step-{step}"
    if final.exists():  # the same step saved again (a stop request right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    maybe_die("save-renamed", step)
    prune(root, keep)


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
    write_atomic(root / BEST, json.dumps({"step": step, "metric": metric, "value": value}), durable=True)


def read_meta(ref: CheckpointRef) -> dict[str, Any]:
    """meta.json of a finished checkpoint; raises CorruptCheckpoint."""
    try:
        meta = ref.meta()
    except (OSError, ValueError) as e:
        raise corrupt("meta.json", e) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CorruptCheckpoint(f"meta.json holds no step: {str(meta)[:100]!r}")
    return meta


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
    fsync_path(root)
    fsync_path(aside)
    return target
