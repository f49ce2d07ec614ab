"""The scheduler backends: the only place in hpcjobs that knows which scheduler runs a job.

Each backend (`slurm`, `local`) implements `Backend`, in the spirit of torchx's Scheduler:
  check(spec)                       the scheduler's own limits on a request (raises UsageError; pure)
  check_site(spec)                  what only the scheduler can tell of it (a partition that exists), asked of it
  dry_run(spec) -> SubmitRequest    pure: the request's `text` is exactly what would be submitted
  script(spec) -> Script            a standalone script for the scheduler's own submit command (`hpcjobs render`)
  submit(request, on_id) -> Submitted   the one side effect; `on_id` is called as soon as the job id is known
  state(record) -> (JobState, source) | None   what the scheduler says of the job (None: it does not know)
  cancel(record) -> str             stop the job; returns what happened, in words
  logs(record, rank, restart) -> Path
Everything else in the package asks `backend_for(scheduler)`; nothing else compares scheduler names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpcjobs.protocol.errors import UsageError

if TYPE_CHECKING:
    from hpcjobs.jobs.store import JobRecord
    from hpcjobs.protocol.faultpolicy.diagnosis import Failure, NodeFault
    from hpcjobs.protocol.states import JobState
    from hpcjobs.request.checks import Check
    from hpcjobs.request.spec import JobSpec

from hpcjobs.protocol.schedulers import SCHEDULERS as SCHEDULERS  # re-exported: the profile's choices, the lookups


@dataclass(frozen=True)
class SubmitRequest:
    """What a backend would submit for a spec; made without side effects (`dry_run`)."""

    spec: JobSpec
    text: str
    """The request as a person reads it: the sbatch script, or the local ranks' command lines."""
    params: dict[str, Any] = field(default_factory=dict)
    """What the backend's `submit` needs beyond the spec (e.g. submitit's parameters)."""


@dataclass(frozen=True)
class Script:
    """A standalone job script (`hpcjobs render`), and the folders that must exist before it is submitted."""

    text: str
    folders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: str
    """The real run folder (any %j in the spec's pattern resolved)."""
    logs: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None
    """For backends that run the job in the foreground (local): its exit code; None when it was queued."""
    task: int | None = None
    """An array task's index (its point); None for a job that is not part of an array."""
    tasks: tuple[Submitted, ...] = ()
    """An array's tasks (the array itself has `job_id` the array's id and `run_dir` the pattern)."""

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "run_dir": self.run_dir, "logs": self.logs, "returncode": self.returncode,
                **({"tasks": [t.as_dict() for t in self.tasks]} if self.tasks else {}),
                **({"task": self.task} if self.task is not None else {})}


Times = tuple["float | None", "float | None", "float | None"]
"""Epoch seconds, None where not known."""


@dataclass(frozen=True)
class SchedulerFacts:
    """What the scheduler knows of a job's faults, beside its state (`hpcjobs status`)."""

    restarts: int | None = None
    """How often the scheduler started the job again (Slurm's `Restarts=`); None where it does not say."""
    node_faults: tuple[NodeFault, ...] = ()
    """Nodes of the job that failed, oldest first (hpcjobs.protocol.faultpolicy.diagnosis prefers them to any rank's
    record)."""


class Backend(Protocol):
    name: str
    multi_node: bool
    """Whether a job may span nodes."""
    queued: bool
    """Whether submit returns while the job waits or runs (Slurm), or only once it ended (local)."""
    requests_gpus: bool
    """Whether the scheduler allocates GPUs (so a rank counts as a GPU), or ranks are just processes."""
    runs_setup: bool
    """Whether the profile's `setup` lines run before the ranks (so the nodes' Python is the one found after them)."""

    def check(self, spec: JobSpec) -> None: ...
    def check_site(self, spec: JobSpec) -> None: ...
    """What only the scheduler itself can tell of a request (Slurm: that its partition exists), asked before
    anything is written; a scheduler that cannot be asked passes it (its submit command then says)."""
    def dry_run(self, spec: JobSpec) -> SubmitRequest: ...
    def script(self, spec: JobSpec) -> Script: ...
    def submit(self, request: SubmitRequest, on_id: Callable[[Submitted], None]) -> Submitted: ...
    def state(self, rec: JobRecord) -> tuple[JobState, str] | None: ...
    def cancel(self, rec: JobRecord) -> str: ...
    def logs(self, rec: JobRecord, rank: int = 0, restart: int | None = None) -> Path: ...
    def reported_failures(self, rec: JobRecord) -> list[Failure]: ...
    """What the scheduler said about ranks that ended badly (Slurm: srun's lines), for
    hpcjobs.protocol.faultpolicy.diagnosis."""
    def exit_code(self, rec: JobRecord) -> int | None: ...
    """The job's exit code where the backend recorded it (local: allocations.jsonl; Slurm: sacct, submitit's words);
    None: not known. Read to tell a start its ranks refused (2) from a failure (hpcjobs.follow.refused)."""
    def scheduler_facts(self, rec: JobRecord) -> SchedulerFacts: ...
    """Its restart count and the nodes of the job that failed (Slurm: scontrol, sacct; none for local jobs)."""
    def allocations(self, rec: JobRecord, run: Any = None) -> list[Times]: ...
    """(eligible, start, end) of each allocation the scheduler recorded for the job, a requeued job's earlier ones
    included (Slurm: its accounting); [] where it records none. `run`: the command runner (tests pass stand-ins)."""
    def lookup(self, job_id: str) -> JobRecord | None: ...
    """A job this scheduler knows as an hpcjobs job but the job store does not (plain sbatch, a lost store)."""
    def doctor(self, spec: JobSpec, probe_wait_s: float | None = None) -> list[Check]: ...
    """The request's checks against the scheduler; with `probe_wait_s`, also a probe job waited for that long."""


def backend_for(scheduler: str) -> Backend:
    """The backend of a profile's `scheduler` (or a job record's)."""
    if scheduler not in SCHEDULERS:
        raise UsageError(f"scheduler {scheduler!r} is not known; valid: {', '.join(SCHEDULERS)}.",
                         "set `scheduler:` in the profile to one of those.")
    backend: Backend = importlib.import_module(f"hpcjobs.backends.{scheduler}.{scheduler}").BACKEND
    return backend
