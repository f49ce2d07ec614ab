"""Paths a user gave (an entry script, --run-dir, -o), looked up so that what the system cannot resolve is one
UsageError line, never an OSError or RuntimeError from deep inside a later check."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from hpcjobs.protocol.errors import UsageError, shown
from hpcjobs.protocol.runfolder import fixed_part

NAME_MAX = 255
"""The longest name of one file or folder that Linux filesystems take (bytes); PATH_MAX bounds a whole path."""
PATH_MAX = 4096
RUN_DIR_HINT = "pick another --run-dir (or runs_dir in the profile); nothing was submitted."
_LOOKED_UP = (errno.ENOENT, errno.ENOTDIR, errno.EACCES)
"""What a lookup may say of a path that later checks then name better: missing, under a file, not searchable."""


def resolved(path: Path, what: str, hint: str) -> Path:
    """path.resolve(), refusing a symlink loop and a path the system will not look up (a name longer than the file
    system allows); `what` names the path in the error ("script", "run folder")."""
    try:
        full = path.resolve()
        full.stat()
    except RuntimeError:  # Path.resolve's word for a symlink loop until Python 3.13 (then an OSError, ELOOP)
        raise _refused(path, what, "is a symlink loop", hint) from None
    except OSError as e:
        if e.errno not in _LOOKED_UP:
            why = "is a symlink loop" if e.errno == errno.ELOOP else f"cannot be looked up ({e.strerror})"
            raise _refused(path, what, why, hint) from None
    return path.resolve()


def _refused(path: Path, what: str, why: str, hint: str) -> UsageError:
    return UsageError(f"{what} {shown(str(path))} {why}; valid: a path the file system can look up (no symlink "
                      f"loop, names of at most {NAME_MAX} bytes).", hint)


_VARIABLE = re.compile(r"\$(\w+|\{([^}]*)\})")


def expanded_path(text: str, what: str) -> Path:
    """A configured path with `~` and `$VAR`/`${VAR}` expanded; a variable that is not set is refused by name (it
    stayed in the path as typed: `render` made a folder named `$USER`)."""
    full = os.path.expandvars(os.path.expanduser(text))
    unset = _VARIABLE.search(full)
    if unset is not None:
        name = unset.group(2) if unset.group(2) is not None else unset.group(1)
        raise UsageError(f"{what}: ${name} is not set in this environment, so the path would hold {unset.group(0)} "
                         "as typed; valid: a path whose variables are set.",
                         f"set {name} (e.g. `export {name}=...`), or write the path without it.")
    return Path(full)


def existing_ancestor(path: Path) -> Path:
    """The path itself if it exists, else its nearest parent that does: what must be a folder for it to be made."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def run_folder_place(run_dir: str) -> Path:
    """Where the run folder (for a pattern, its fixed part) is or will be made: its nearest existing part, refused
    unless it is a folder (a file on the way can never hold it, on any node)."""
    probe = existing_ancestor(fixed_part(run_dir))
    if not probe.is_dir():
        raise UsageError(f"run folder {run_dir}: {probe} is a file, not a folder.", RUN_DIR_HINT)
    return probe


def refuse_output(path: Path, force: bool, flag: str = "-o", example: str = "train.sbatch") -> None:
    """A file is never written over an existing one unless forced (a symlink, even one that leads nowhere,
    included), nor over a folder, nor where a file stands on the way to its folder. Raises UsageError."""
    hint = f"give {flag} a file name, e.g. {flag} {example}."
    try:
        if path.is_dir():
            raise UsageError(f"{path} is a folder; nothing was written.", hint)
        if os.path.lexists(path) and not force:
            raise UsageError(f"{path} already exists; nothing was written.", f"pass --force to overwrite, or {flag} "
                             "NEW_FILE.")
        place = existing_ancestor(path.parent)
        if not place.is_dir():
            raise UsageError(f"{path}: {place} is a file, not a folder; nothing was written.", hint)
    except OSError as e:  # a name too long, a symlink loop, a folder on the way that may not be searched
        raise UsageError(f"{shown(str(path))} cannot be looked up ({e.strerror}); nothing was written.", hint) \
            from None
