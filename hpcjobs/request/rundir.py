"""Where a job's run folder goes and whether a filesystem and an #SBATCH line can hold its name: one line, each name
at most NAME_MAX bytes and the path under PATH_MAX (a longer one failed stat with ENAMETOOLONG), an array's folder
named by its task index; and where a run folder's code snapshots go (snapshot_root). Split from spec.py (391 lines,
at the size cap's edge).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.protocol.errors import UsageError, shown
from hpcjobs.protocol.paths import NAME_MAX, PATH_MAX, RUN_DIR_HINT, resolved, run_folder_place
from hpcjobs.protocol.runfolder import ARRAY_TASK_DIR, JOB_ID, TASK_INDEX, fixed_part


class RunDirAsked(Protocol):
    """The request's field run_dir_for reads (hpcjobs.request.spec.Request has it): --run-dir, or None."""

    @property
    def run_dir(self) -> str | None: ...


def check_one_line(flag: str, value: str | None, hint: str) -> None:
    """What goes on an #SBATCH line, as the profile's strings do: a newline would end the header there and run the
    rest of the value as a shell line."""
    if value is not None and ("\n" in value or "\r" in value):
        raise UsageError(f"{flag} {value!r}: valid: a single-line value.", hint)


def _bytes(path: str) -> int:
    """A path's length as the filesystem counts it (a byte an argument could not decode counts as one)."""
    return len(path.encode("utf-8", "replace"))


def check_run_dir(run_dir: str) -> None:
    """A run folder is named on an #SBATCH line (submitit's --output) and made here or on the node: one line, and a
    path a filesystem can hold (a longer one failed stat with ENAMETOOLONG: a traceback here, a failed job there)."""
    hint = RUN_DIR_HINT
    check_one_line("run folder", run_dir, hint)
    too_long = next((part for part in run_dir.split("/") if _bytes(part) > NAME_MAX), None)
    if too_long is not None:
        raise UsageError(f"run folder {shown(run_dir)}: the name {shown(too_long)} is longer than {NAME_MAX} bytes; "
                         f"valid: names of at most {NAME_MAX} bytes.", hint)
    if _bytes(run_dir) >= PATH_MAX:
        raise UsageError(f"run folder {shown(run_dir)} is longer than {PATH_MAX - 1} bytes; valid: a path of at "
                         f"most {PATH_MAX - 1} bytes.", hint)
    run_folder_place(run_dir)  # a file on the way: refused by --dry-run and render too, not only by a real submit


def check_array_run_dir(run_dir: str, points: int) -> None:
    """Each task of an array needs its own run folder, named by its index; %j (a task's own job id) is known only
    on the node, so the login node could not find the folders."""
    if TASK_INDEX not in run_dir or JOB_ID in run_dir:
        raise UsageError(f"--run-dir {shown(run_dir)} for a sweep of {points} points: valid: a pattern with %a (the "
                         "task's index) and without %j.", f"e.g. --run-dir runs/sweep-{ARRAY_TASK_DIR}, or leave "
                         "--run-dir out.")


def snapshot_root(run_dir: str) -> Path:
    """Where a run folder's code snapshots go: the folder that holds it (its first part without a pattern)."""
    fixed = fixed_part(run_dir)
    return fixed if str(fixed) != run_dir else fixed.parent


def run_dir_for(profile: ClusterProfile, req: RunDirAsked, workdir: Path, name: str, stamp: str, points: int,
             job_id_in_run_dir: bool) -> str:
    """The run folder: --run-dir, or one named by the job under the profile's runs folder; checked."""
    array = points > 1
    if req.run_dir:  # absolute, so status and logs find it from anywhere; a pattern (%j) is resolved later
        run_dir = str(resolved(workdir / os.path.expanduser(req.run_dir), "run folder", RUN_DIR_HINT))
    else:
        root = profile.runs_path()
        root = root if root.is_absolute() else workdir / root
        suffix = f"-{ARRAY_TASK_DIR}" if array else f"-{JOB_ID}" if job_id_in_run_dir else ""
        run_dir = str(root / f"{name}-{stamp}{suffix}")
    check_run_dir(run_dir)
    if array:
        check_array_run_dir(run_dir, points)
    return run_dir
