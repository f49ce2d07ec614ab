"""Who may read what hpcjobs makes (docs/how-to/secrets.md): run folders, code snapshots and the job store are their
owner's alone whatever the umask, or also a group's that the profile names (`group:`), for teams that share runs.

Both sides: the submit side tightens its umask before it makes anything (the local ranks inherit it; sbatch passes it
to the job as SLURM_UMASK), and every rank tightens its own (a rendered script run by plain sbatch starts with the
shell's). A group's umask reaches the ranks as UMASK_VAR in their environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

UMASK_VAR = "HPCJOBS_UMASK"
PRIVATE = 0o077
"""Owner only: folders 0700, files 0600."""
GROUP = 0o027
"""Owner and group: folders 0750 (with the group's id, set-group-id so what is made inside keeps it), files 0640."""


def umask_for(group: str | None) -> int:
    return GROUP if group else PRIVATE


def node_umask(environ: Mapping[str, str]) -> int:
    """A rank's umask: the group's when the submit side said so, else the owner's alone."""
    return GROUP if environ.get(UMASK_VAR) == f"{GROUP:03o}" else PRIVATE


def tighten(mask: int) -> None:
    """Add `mask`'s bits to this process's umask (a stricter one, the user's, stays)."""
    os.umask(os.umask(mask) | mask)


def restrict(path: Path, gid: int | None = None) -> None:
    """Make a folder (or file) this user owns the owner's alone, or the owner's and group `gid`'s."""
    if path.is_symlink() or path.stat().st_uid != os.getuid():
        return
    folder = path.is_dir()
    if gid is None:
        os.chmod(path, 0o700 if folder else 0o600)
        return
    os.chown(path, -1, gid)
    os.chmod(path, 0o2750 if folder else 0o640)


def restrict_made(path: Path, there: Path, gid: int | None) -> None:
    """`restrict` `path` (when it is new or a group is named) and each folder made on the way below `there`."""
    if path == there and gid is None:
        return
    for folder in [path, *(p for p in path.parents if there in p.parents)]:
        restrict(folder, gid)


def world_readable(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & 0o004)
    except OSError:
        return False
