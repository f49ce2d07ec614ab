"""The side effects of submission, one function each: write a rendered script, submit a request through its
backend, record the job. Everything they need was decided by the pure spec and renderers before they are called."""

from __future__ import annotations

import time
from pathlib import Path

from hpcjobs.backends import Script, SubmitRequest, Submitted, backend_for
from hpcjobs.backends.common import check_run_folder
from hpcjobs.protocol.atomic import write_atomic
from hpcjobs.protocol.errors import RuntimeFailure
from hpcjobs.protocol.paths import refuse_output
from hpcjobs.snapshot import materialize
from hpcjobs.spec import JobSpec
from hpcjobs.store import JobRecord, JobStore


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


def take_snapshot(spec: JobSpec) -> None:
    """Copy the project's code where the spec says the ranks run it (nothing when it is there already). The run
    folder is checked first: the snapshot goes beside it, and a run folder that cannot be made is the error to give.
    A snapshot stays when the submission is then refused: another submission of the same tree may be using it."""
    if spec.snapshot is not None:
        check_run_folder(spec.run_dir)
        materialize(spec.snapshot)


def submit(request: SubmitRequest) -> Submitted:
    """Submit through the spec's backend; the job is recorded as soon as it has an id (a local job before it
    runs, so status and list see it while it does)."""
    spec = request.spec
    store = JobStore()
    store.check()
    take_snapshot(spec)
    return backend_for(spec.profile.scheduler).submit(request, lambda sub: record(spec, sub, store))
