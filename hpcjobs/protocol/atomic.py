"""Files replaced whole: written aside, renamed over the old one, so a reader or a kill at any instant sees the old
file or the new one, never half of either. One helper for every such write on both sides (records, scripts, plots,
exported models, metrics.jsonl cut back at a resume, best.json).

`durable=True` also fsyncs the file before the rename and the folder after it, for what must survive a node's crash
(checkpoint records, metrics rewritten at a resume); the job's small status records do without (they are rewritten
often and lose nothing but a moment of history).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (a directory opened read-only can be fsynced on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: Path, durable: bool = False, mode: int | None = None) -> Iterator[Path]:
    """Yield a path beside `path` to write; when the block ends without an error, rename it over `path` (after
    chmod to `mode`, if given); on an error it is removed and `path` is untouched. The name holds the pid, so two
    processes replacing the same file never write into one another's."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(path.parent)


def write_atomic(path: Path, data: str | bytes, durable: bool = False, mode: int | None = None) -> None:
    with replacing(path, durable=durable, mode=mode) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
