"""Jobs that wait for other jobs: `--after ID[:ok|any|notok]` on submit, render and sweeps, and chain files.

On Slurm a dependency is Slurm's own (`--dependency=afterok:ID`), with `--kill-on-invalid-dep=yes`: a dependent that
can never start (its upstream failed, or was cancelled) is cancelled by Slurm instead of waiting in the queue for
ever with the reason DependencyNeverSatisfied. A requeue is not an end: a job that requeues itself on a time limit or
a preemption goes back to PENDING with the same id, so its dependents keep waiting through every requeue and start
only once it ends for good. An array's id stands for all its tasks (Slurm's meaning); `ID_N` for one task.

The local profile runs jobs in the foreground, so a local dependent waits here until its upstream (a job running
in another terminal) ends, then starts or is refused by the same rule. Parsing is pure; `check_upstream` and
`wait_for_upstream` ask the job's backend for states (callers pass how).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.states import JobState

CONDITIONS = {"ok": "afterok", "any": "afterany", "notok": "afternotok"}
"""`--after`'s conditions and Slurm's dependency type for each: ended COMPLETED, ended in any way, ended badly."""
_AFTER = re.compile(r"(?P<id>\d+(?:_\d+)?|local-[0-9]+-[0-9]+(?:-[0-9]+)?)(?::(?P<cond>\w+))?")
AFTER_HINT = "e.g. --after 1234 (start once job 1234 completed), --after 1234:any, --after 1240_3:notok"


@dataclass(frozen=True)
class After:
    """One dependency: the upstream job's id and the condition on how it ended."""

    job_id: str
    condition: str = "ok"

    def __str__(self) -> str:
        return f"{self.job_id}:{self.condition}"

    def met_by(self, state: JobState) -> bool | None:
        """Whether an upstream in `state` lets the dependent start: True, False (never will), None (not ended)."""
        if not state.finished or state is JobState.UNKNOWN:
            return None
        completed = state is JobState.COMPLETED
        return {"ok": completed, "notok": not completed, "any": True}[self.condition]


def parse_after(text: str) -> After:
    """`ID`, `ID:ok`, `ID:any` or `ID:notok`; UsageError (one line) for anything else."""
    m = _AFTER.fullmatch(text.strip())
    if m is None or (m["cond"] is not None and m["cond"] not in CONDITIONS):
        cond = m["cond"] if m is not None else None
        what = f"the condition {cond!r}" if cond else "not a job id"
        raise UsageError(f"--after {text!r}: {what}; valid: --after ID[:{'|'.join(CONDITIONS)}] with ID a job id "
                         "(1234, an array task 1234_5, or a local job's id)", AFTER_HINT)
    return After(m["id"], m["cond"] or "ok")


def parse_all(texts: tuple[str, ...]) -> tuple[After, ...]:
    """Every --after, each job once (the same job twice with two conditions is refused: Slurm would wait for both)."""
    afters = tuple(parse_after(t) for t in texts)
    seen: dict[str, After] = {}
    for a in afters:
        if a.job_id in seen and seen[a.job_id] != a:
            raise UsageError(f"--after {seen[a.job_id]} and --after {a}: job {a.job_id} twice with two conditions; "
                             "valid: each job once", f"keep one, e.g. --after {a.job_id}:any")
        seen[a.job_id] = a
    return tuple(seen.values())


def dependency(afters: tuple[After, ...]) -> str | None:
    """Slurm's --dependency value: the jobs of each condition together, every condition required
    (`afterok:12:13,afterany:14`); None without dependencies."""
    groups: dict[str, list[str]] = {}
    for a in afters:
        groups.setdefault(CONDITIONS[a.condition], []).append(a.job_id)
    return ",".join(f"{kind}:{':'.join(ids)}" for kind, ids in groups.items()) or None


StateOf = Callable[[str], tuple[JobState, str]]
"""A job id → its state and the scheduler that runs it; raises UsageError for a job hpcjobs does not know."""


def check_upstream(afters: tuple[After, ...], runs_on: str, state_of: StateOf) -> None:
    """Refuse, before anything is queued, a dependency on a job hpcjobs does not know, on a job of another
    scheduler (Slurm cannot wait for a local job, nor a local job for Slurm's), or on a job that already ended in a
    way that means the dependent would never start."""
    for a in afters:
        try:
            state, where = state_of(a.job_id)
        except UsageError as e:
            raise UsageError(f"--after {a}: {e.message.rstrip('.')}", "name a job `hpcjobs list` shows") from None
        if where != runs_on:  # two schedulers' names compared, none singled out
            raise UsageError(f"--after {a}: job {a.job_id} runs on {where} and this job on {runs_on}; valid: a job "
                             f"of the same scheduler", "submit both with profiles of the same cluster")
        if a.met_by(state) is False:
            raise UsageError(f"--after {a}: job {a.job_id} already ended {state}, so this job would never start; "
                             f"valid: a job that is still queued or running, or one that ended "
                             f"{'COMPLETED' if a.condition == 'ok' else 'badly'}",
                             "drop --after, or use --after ID:any to start whatever happened")


def wait_for_upstream(afters: tuple[After, ...], state_of: StateOf, say: Callable[[str], None],
                      poll_s: float = 2.0) -> None:
    """Block until every upstream ended (the local profile's foreground jobs), then refuse to start when one
    ended in a way its condition does not allow: the same rule Slurm applies to a queued dependent."""
    for a in afters:
        state, _ = state_of(a.job_id)
        if a.met_by(state) is None:
            say(f"waiting for job {a.job_id} to end ({a.condition}: {state})")
        while (met := a.met_by(state)) is None:
            time.sleep(poll_s)
            state, _ = state_of(a.job_id)
        if not met:
            raise UsageError(f"--after {a}: job {a.job_id} ended {state}; this job was not started",
                             "look at the upstream job (`hpcjobs status ID`), or use --after ID:any")
