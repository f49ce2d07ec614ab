"""What a running rank asks of Slurm: `scontrol show job -o` (why a SIGTERM came, when the job ends) and
`scontrol requeue`. Torch-free; every function takes the command runner (`subprocess.run` by default) so that tests
can feed it recorded `scontrol` output.

The node side (trainers.preemption) calls these from rank 0 after a stop was agreed, never from a signal handler.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

Runner = Callable[..., Any]
"""`subprocess.run`, or a stand-in taking (argv, **kwargs) and returning an object with returncode/stdout/stderr."""
SCONTROL_TIMEOUT_S = 60
"""A busy slurmctld answers slowly; a rank waiting on it only delays its own exit, never a collective."""


def job_id_of(job_id: str) -> str | None:
    """The id as scontrol wants it, or None when it is no Slurm job id (a local run's `local-…`, torchrun's)."""
    return job_id if job_id.isdigit() else None


def parse_show_job(text: str) -> dict[str, str]:
    """One `scontrol show job -o` line as a mapping (JobState, PreemptTime, EndTime, ...). Values with spaces
    (Command=, WorkDir= with a blank) come out cut at the first space; none of the fields read here has one."""
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def job_fields(job_id: str, runner: Runner = subprocess.run) -> dict[str, str]:
    """`scontrol show job -o ID` as a mapping; empty when Slurm cannot be asked (no scontrol, no answer)."""
    if job_id_of(job_id) is None:
        return {}
    try:
        out = runner(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                     timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_show_job(out.stdout or "")


def end_time(fields: dict[str, str]) -> float | None:
    """`EndTime` of `scontrol show job` (local time) as epoch seconds; None when absent or not a time
    (`Unknown` for a pending job)."""
    try:
        return time.mktime(time.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def preempted_with_sigterm(job_id: str, runner: Runner = subprocess.run) -> bool:
    """A SIGTERM while the job is still RUNNING with a PreemptTime is a preemption's GraceTime warning (measured on
    22.05). Slurm requeues such a job only if it is still running when the grace ends: a job that saved and exited
    0 in time would end COMPLETED and never come back, so it must requeue itself. A `scancel` (CANCELLED), the
    time limit (TIMEOUT) or an outside `scontrol requeue` change the state before the signal is sent."""
    fields = job_fields(job_id, runner)
    return fields.get("JobState") == "RUNNING" and fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def requeue_job(job_id: str, runner: Runner = subprocess.run) -> str:
    """Ask Slurm to requeue this job (rank 0 only); returns Slurm's message, empty when it worked or when Slurm is
    already requeuing it (preemption, `scontrol requeue` from outside: the job is no longer RUNNING)."""
    if job_id_of(job_id) is None:
        return f"no Slurm job id ({job_id!r}) to requeue"
    try:
        out = runner(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if out.returncode == 0:
        return ""
    state = job_fields(job_id, runner).get("JobState", "")
    if state and state != "RUNNING":
        return ""
    return (out.stderr or out.stdout or "").strip() or f"scontrol requeue exited {out.returncode}"
