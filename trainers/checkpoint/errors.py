"""What goes wrong with a checkpoint, said in one line: a disk or quota that is full (found inside torch's and DCP's
wrappers) and a finished checkpoint that cannot be read."""

from __future__ import annotations

import errno


class CheckpointSpaceError(RuntimeError):
    """A checkpoint did not fit: the disk or the quota is full."""


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


class CorruptCheckpoint(Exception):
    """A finished checkpoint that cannot be read; the message says which file and why, on one line."""


def corrupt(name: str, e: BaseException) -> CorruptCheckpoint:
    """`name` (a file of the checkpoint) and the first sentence of what reading it raised, on one line."""
    text = " ".join(str(e).split())
    text = text.split(". ")[0][:200]  # torch's first sentence says it; the rest is advice about other causes
    return CorruptCheckpoint(f"{name}: {type(e).__name__}: {text}" if text else f"{name}: {type(e).__name__}")
