"""The side effects of submission, one function each: write a rendered script, submit a request through its
backend, record the job. Everything they need was decided by the pure spec and renderers before they are called."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from hpcjobs.backends import Script, SubmitRequest, Submitted, backend_for
from hpcjobs.backends.common import check_run_folder
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.protocol.access import restrict_made
from hpcjobs.protocol.atomic import write_atomic
from hpcjobs.protocol.errors import HpcjobsError, RuntimeFailure
from hpcjobs.protocol.paths import existing_ancestor, refuse_output
from hpcjobs.request.credentials import group_id
from hpcjobs.request.snapshot import PLAIN_FILE_MAX, materialize
from hpcjobs.request.spec import JobSpec


def write_script(script: Script, path: Path, force: bool = False) -> Path:
    """Write a rendered script (never over an existing file unless forced) and make the folders it needs."""
    try:
        refuse_output(path, force)  # first: `.` or `/` has no name to write aside
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, script.text, mode=0o755)  # nothing half-written stays behind, whatever fails
        for folder in script.folders:
            Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeFailure(f"cannot write {e.filename or path} ({e.strerror}); nothing was written.",
                             "pick a writable folder for -o (and runs_dir in the profile).") from None
    return path


def record(spec: JobSpec, sub: Submitted, store: JobStore | None = None) -> None:
    """One job, or one array task (each task is a record of its own: `ID_N`)."""
    (store or JobStore()).add(JobRecord(
        job_id=sub.job_id, name=spec.name, profile=spec.profile.name, scheduler=spec.profile.scheduler,
        nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, run_dir=sub.run_dir, logs=sub.logs,
        spec=spec.as_dict(sub.task), submitted=time.time()))


def snapshot_notes(spec: JobSpec) -> list[str]:
    """What the snapshot left out, said once the job has an id (a submission refused before says only why)."""
    snap, notes = spec.snapshot, []
    if snap is not None and snap.skipped:
        notes.append("hpcjobs: the code snapshot leaves out what commonly holds credentials: "
                     + ", ".join(snap.skipped))
    if snap is not None and snap.data:
        more = f" and {len(snap.data) - 5} more" if len(snap.data) > 5 else ""
        notes.append(f"hpcjobs: the code snapshot (outside git) leaves out data and weights (weights, or files over "
                     f"{PLAIN_FILE_MAX // 2**20} MiB): {', '.join(snap.data[:5])}{more}; a rank that opens one by a "
                     "relative path will not find it: give it by its absolute path, run from a git repository, or "
                     "pass --no-snapshot")
    return notes


def take_snapshot(spec: JobSpec) -> Path | None:
    """Copy the project's code where the spec says the ranks run it (nothing when it is there already). The run
    folder is checked first: the snapshot goes beside it, and a run folder that cannot be made is the error to give.
    Returns the outermost folder this call made (the snapshot's, or a runs folder that was not there), or None."""
    if spec.snapshot is None:
        return None
    check_run_folder(spec.run_dir)
    folder = Path(spec.snapshot.folder)
    there = existing_ancestor(folder)
    materialize(spec.snapshot)
    restrict_made(folder, there, group_id(spec.profile.group))
    if there == folder:
        return None  # an identical snapshot was there: another submission's too
    return there / folder.relative_to(there).parts[0]


def undo_snapshot(made: Path, snapshot: str) -> None:
    """Take away what take_snapshot made for a submission that was then refused (sbatch: no such account): the
    snapshot, then each folder it made on the way that is empty again. Another submission of the same tree in the
    same moment could be using the snapshot; it is taken away only when this submission made it."""
    shutil.rmtree(snapshot, ignore_errors=True)
    folder = Path(snapshot).parent
    while folder == made or made in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty: something else is there now
        folder = folder.parent


def submit(request: SubmitRequest) -> Submitted:
    """Submit through the spec's backend; the job is recorded as soon as it has an id (a local job before it
    runs, so status and list see it while it does). A submission refused before it had an id leaves nothing:
    the run folder (the backend's) and the code snapshot it made are taken away."""
    spec = request.spec
    store = JobStore()
    store.check()
    made = take_snapshot(spec)
    recorded: list[Submitted] = []

    def on_id(sub: Submitted) -> None:
        if not recorded:
            for note in snapshot_notes(spec):
                print(note, file=sys.stderr, flush=True)
        recorded.append(sub)
        record(spec, sub, store)

    try:
        return backend_for(spec.profile.scheduler).submit(request, on_id)
    except HpcjobsError:
        if made is not None and spec.snapshot is not None and not recorded:
            undo_snapshot(made, spec.snapshot.folder)
        raise
