"""Following submitted jobs: what the job's backend says (squeue, then sacct, for Slurm), then the run folder's
own markers, then the job store.

Sites without accounting are common (sacct exits 1), and submitit's own state stays UNKNOWN there, so nothing here
depends on sacct: the run folder (final.json, heartbeat.json, restarts.jsonl) always has the last word on how a
training run ended.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hpcjobs.backends import SCHEDULERS, Backend, backend_for
from hpcjobs.follow.refused import refusal
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.protocol.errors import RuntimeFailure, UsageError
from hpcjobs.protocol.faultpolicy.diagnosis import NODE, by_signal, diagnose
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import FinalState, JobState, StopReason


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    profile: str
    nodes: int
    gpus_per_node: int
    state: JobState
    state_source: str
    """Where the state came from: squeue, sacct, run folder, store, or none."""
    restarts: int
    last_step: int | None
    last_step_age_s: float | None
    final_reason: str | None
    run_dir: str
    logs: dict[str, Any]
    submitted: float
    nccl_traces: str | None = None
    """The folder of NCCL flight recorder dumps, when a collective timed out and some rank wrote one."""
    first_failure: str | None = None
    """The rank that failed first, its host and why (hpcjobs.protocol.faultpolicy.diagnosis), when one failed."""
    failure_log: str | None = None
    failure_tail: tuple[str, ...] = ()
    """The last lines of that rank's log."""
    node_faults: tuple[str, ...] = ()
    """Nodes of the job that failed, as the scheduler says (hpcjobs.protocol.faultpolicy.diagnosis.NodeFault), oldest
    first."""
    scheduler_restarts: int | None = None
    """The scheduler's own restart count (Slurm's `Restarts=`), where it knows the job."""
    recoveries: int = 0
    """How often the job recovered from a fault by itself (restarts.jsonl's `fault` stops)."""
    last_recovery: str | None = None
    """The newest recovery: its cause, how (in the allocation or by a requeue) and the nodes it left out."""

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": str(self.state)}


def folder_state(run: RunFolder, job_id: str) -> tuple[JobState | None, str | None]:
    """The run's own final word (final.json), if this job wrote it: a later job on the same folder (a resume, or a
    start that was refused) must not inherit an earlier job's ending, nor the earlier job the later one's."""
    final = run.final_of(job_id)
    if not isinstance(final, dict):
        return None, None
    state = FOLDER_STATES.get(str(final.get("state")), JobState.FAILED)
    began = [float(r.get("time", 0)) for r in run.read_restarts() if "stopped" not in r
             and str(r.get("job_id")) == job_id]
    if state == JobState.FAILED and began and max(began) > float(final.get("time") or 0):
        return None, None  # a start that failed, and the job started again since (a recovery, a requeue)
    return state, final.get("reason")


FOLDER_STATES: dict[str, JobState] = {FinalState.FINISHED: JobState.COMPLETED, FinalState.FAILED: JobState.FAILED}
"""final.json's state as a job state."""


def stopped_for_good(history: list[dict[str, Any]], job_id: str) -> bool:
    """Whether the job's last start stopped on a SIGTERM that was neither a preemption nor followed by another start
    of it: a `scancel` (inside the job, Slurm shows a cancelled job only as COMPLETING, so no rank can write it).
    Asked only once the scheduler has forgotten the job: a job requeued from outside is still in its queue.
    `history`: the run folder's restarts.jsonl."""
    starts = [i for i, r in enumerate(history) if "stopped" not in r and str(r.get("job_id")) == job_id]
    after = history[starts[-1] + 1:] if starts else []
    return bool(after) and after[-1].get("stopped") == StopReason.TERMINATED


def restart_count(run: RunFolder, job_id: str | None = None, scheduler: int | None = None,
                  waiting: bool = False) -> int:
    """The newest restart number of the job's starts (of the folder's, when none is the job's): a resume on the
    same run folder numbers on, and an earlier job keeps its own. `scheduler`: the scheduler's own count (Slurm's
    Restarts=), which knows a requeue before its start records it: while the job `waiting` (pending again after a
    requeue) its next start is counted. A restart number counts recoveries inside the allocation too, which the
    scheduler never saw: the larger count wins."""
    starts = [r for r in run.read_restarts() if "stopped" not in r]
    own = [r for r in starts if str(r.get("job_id")) == job_id]
    newest = max((r.get("restart", 0) for r in own or starts), default=0)
    if not scheduler:
        return newest
    return max(scheduler, newest + 1 if waiting and own else newest)


WAITING = frozenset({JobState.PENDING, JobState.REQUEUED, JobState.REQUEUE_HOLD, JobState.REQUEUE_FED})
"""States of a job that waits to start (again)."""


def recoveries(history: list[dict[str, Any]], job_id: str) -> tuple[int, str | None]:
    """How often the job recovered from a fault by itself, and the newest recovery in words: restarts.jsonl's
    `fault` stops (trainers/recover.py: cause, how, exclude), of this job by their job_id, else by the start they
    follow."""
    owner, found = None, []
    for r in history:
        if "stopped" not in r:
            owner = str(r.get("job_id"))
        elif r.get("stopped") == StopReason.FAULT and str(r.get("job_id", owner)) == job_id:
            found.append(r)
    if not found:
        return 0, None
    last = found[-1]
    how = {"allocation": "relaunched in the allocation", "requeue": "requeued",
            "rejoin": "lost ranks replaced, the others kept their processes"}.get(str(last.get("how")),
                                                                                  str(last.get("how") or "?"))
    left = [str(n) for n in last.get("exclude") or []]
    step = last.get("step")
    return len(found), (f"after restart {last.get('restart', '?')}: {last.get('cause') or 'cause unknown'}; {how}"
                        + (f", leaving out {', '.join(left)}" if left else "")
                        + (f", from step {step}" if isinstance(step, int) and step >= 0 else ", from the start"))


def status_of(rec: JobRecord, backend: Backend | None = None) -> JobStatus:
    run = RunFolder(rec.run_dir)
    fstate, reason = folder_state(run, rec.job_id)
    backend = backend or backend_for(rec.scheduler)
    answer = backend.state(rec)
    if (answer is None or answer[0] == JobState.UNKNOWN) and fstate is not None:
        answer = fstate, "run folder" + (f" ({answer[1]})" if answer else "")
    if answer is None and rec.cancelled:
        answer = JobState.CANCELLED, "store"
    history = run.read_restarts()
    if answer is None and stopped_for_good(history, rec.job_id):
        answer = JobState.CANCELLED, "run folder: stopped by SIGTERM (scancel) and never started again"
    state, source = answer or (JobState.UNKNOWN, "none")
    if fstate is None and state in (JobState.FAILED, JobState.UNKNOWN) \
            and (line := refusal(rec, run, backend)) is not None:
        state, source, reason = JobState.REFUSED, "exit code 2 and its ranks' refusal line", line
    if fstate is not None and state.finished and fstate != state and source != "run folder":
        source += f"; the run folder says {fstate}"  # e.g. the ranks finished but the job script failed after
    if state == JobState.UNKNOWN and not reason and not any(str(r.get("job_id")) == rec.job_id for r in history):
        reason = "no rank of this job ever started (cancelled while pending, or it never ran)"
    return with_faults(rec, run, backend, state, source, reason, fstate)


def with_faults(rec: JobRecord, run: RunFolder, backend: Backend, state: JobState, source: str, reason: str | None,
                fstate: JobState | None) -> JobStatus:
    """The status, with what failed: the first failure of the last start (the scheduler's failed node before any
    rank's record), the scheduler's restart count and the job's recoveries. A start's failure recorded while the
    scheduler says the job goes on (requeued, recovering) is not how the job ended: it shows as the first failure."""
    step, when = last_step(run)
    age = time.time() - when if when is not None else None
    traces = str(run.nccl_traces) if run.nccl_traces.is_dir() and any(run.nccl_traces.iterdir()) else None
    facts = backend.scheduler_facts(rec)
    going_on = fstate == JobState.FAILED and not state.finished
    if going_on:
        reason = None
    ended_badly = state.finished and state != JobState.COMPLETED
    found = diagnose(run, rec.job_id, backend.reported_failures(rec), facts.node_faults) \
        if ended_badly or going_on or facts.node_faults else None
    first = found.first if found else None
    if first and fstate == JobState.FAILED and first.source == "srun" and not by_signal(first):
        found = first = None  # the job's own last word says why it ended (the restart cap): srun saw only its exit
    faults = list(facts.node_faults)
    if first and first.source == NODE and len(faults[-1].nodes) > 1 and first.host in faults[-1].nodes:
        faults[-1] = replace(faults[-1], nodes=(first.host,))  # the node whose ranks recorded nothing
    count, last = recoveries(run.read_restarts(), rec.job_id)
    return JobStatus(rec.job_id, rec.name, rec.profile, rec.nodes, rec.gpus_per_node, state, source,
                     restart_count(run, rec.job_id, facts.restarts, state in WAITING), step, age, reason,
                     rec.run_dir, rec.logs, rec.submitted, traces, first.describe() if first else None,
                     first.log if first else None, found.tail if found else (),
                     tuple(f.describe() for f in faults), facts.restarts, count, last)


def last_step(run: RunFolder) -> tuple[int | None, float | None]:
    """The newest step the run reached and when: a stop's committed checkpoint or the final step, when either is
    newer than the last heartbeat (logged only every --log-every steps). A recovery's stop names the checkpoint the
    next start goes on from, not a step reached."""
    marks = [run.read("heartbeat") or {}, run.read("final") or {}]
    stops = [r for r in run.read_restarts() if "stopped" in r and r["stopped"] != StopReason.FAULT]
    marks += stops[-1:]  # also once the next start began: until it logs, the step must not go back to a heartbeat
    known = [m for m in marks if isinstance(m, dict) and isinstance(m.get("step"), int) and m["step"] >= 0]
    newest = max(known, key=lambda m: (m.get("time", 0), m["step"]), default=None)
    return (newest["step"], newest.get("time")) if newest else (None, None)


def find(job_id: str, store: JobStore) -> JobRecord:
    """The job store's record of `job_id`, else the scheduler's: any job hpcjobs submitted carries its run folder
    (Slurm: in its comment), so a job run from a rendered script, or one whose record was lost, is still found."""
    try:
        rec = store.get(job_id)
    except RuntimeFailure:
        rec = lookup(job_id)
        if rec is None:
            raise  # the store's own error says what is wrong with it
        return rec
    if rec is None and (rec := lookup(job_id)) is not None and store.path.exists():
        store.add(rec)  # remembered: once the scheduler forgets the job (MinJobAge), the record still finds it;
        # into a store that exists only: a question never makes one (the store may have been lost or moved)
    if rec is None:
        recent = ", ".join(r.job_id for r in store.recent(5)) or "none yet"
        raise UsageError(f"no job {job_id!r} was submitted with hpcjobs here (recent: {recent}), and the scheduler "
                         "knows no hpcjobs job of that id.",
                         "`hpcjobs list` shows the jobs hpcjobs knows; HPCJOBS_HOME selects another record; a job's "
                         "run folder stands for it too (`hpcjobs status RUN_FOLDER`).")
    return rec


def folder_record(path: str) -> JobRecord | None:
    """A run folder given where a job id goes (status, logs, cancel): the record of the newest job that started
    there, from what the folder holds (spec.json, written by `hpcjobs submit`; restarts.jsonl, by every rank,
    a rendered script's too). None when it is no run folder."""
    run = RunFolder(path)
    spec = run.read("spec")
    spec = spec if isinstance(spec, dict) else {}
    final = run.read("final")
    starts = [str(r["job_id"]) for r in run.read_restarts() if "stopped" not in r and r.get("job_id")]
    job_id = starts[-1] if starts else final.get("job_id") if isinstance(final, dict) else None
    if job_id is None or not (spec or run.restarts.exists()):
        return None
    scheduler = spec.get("scheduler") or ("local" if job_id.startswith("local-") else "slurm")
    return JobRecord(job_id, str(spec.get("name") or run.path.name), str(spec.get("profile") or "?"), scheduler,
                     int(spec.get("nodes") or 0), int(spec.get("gpus_per_node") or 0), str(run.path.resolve()), {},
                     spec, run.path.stat().st_mtime)


def _is_dir(path: str) -> bool:
    """Whether `path` is a folder; False for a name the filesystem cannot hold (over NAME_MAX: `ls` says the same),
    which is_dir raises for."""
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def _too_long(path: str) -> bool:
    try:
        Path(path).exists()
    except OSError:
        return True
    return False


def records_for(job_id: str, store: JobStore) -> list[JobRecord]:
    """The record of a job or of one array task (`ID_N`), or every task of an array's `ID`; or of the newest job
    of a run folder given instead (a path, or a folder here that holds a run)."""
    if os.sep in job_id or _is_dir(job_id):
        found = None if _too_long(job_id) else folder_record(job_id)
        if found is not None:
            return [found]
        if os.sep in job_id:
            raise UsageError(f"{job_id} is not a run folder: it holds neither spec.json nor restarts.jsonl with a "
                             "job's start.", "give a job id or a run folder (runs/NAME-...).")
    try:
        if store.get(job_id) is None and (tasks := store.tasks(job_id)):
            return tasks
    except RuntimeFailure:
        pass  # find() answers from the scheduler, or says what is wrong with the store
    return [find(job_id, store)]


def job_state(job_id: str, store: JobStore) -> tuple[JobState, str]:
    """A job's state and scheduler, for a job that waits for it (hpcjobs.request.after); an array's id is all its tasks:
    running while one is, COMPLETED once all are, else the first other end. UsageError for an unknown job."""
    states = [(status_of(r).state, r.scheduler) for r in records_for(job_id, store)]
    scheduler = states[0][1]
    pending = [s for s, _ in states if not s.finished]
    if pending:
        return pending[0], scheduler
    return next((s for s, _ in states if s is not JobState.COMPLETED), JobState.COMPLETED), scheduler


def lookup(job_id: str) -> JobRecord | None:
    for name in SCHEDULERS:
        found = backend_for(name).lookup(job_id)
        if found is not None:
            return found
    return None


def log_path(rec: JobRecord, rank: int = 0, restart: int | None = None) -> Path:
    return backend_for(rec.scheduler).logs(rec, rank, restart)


def follow(path: Path, out: Callable[[str], None], done: Callable[[], bool], poll_s: float = 0.5) -> None:
    """Print the file, then what is appended, until done() says the job ended."""
    with open(path, errors="replace") as f:
        while True:
            chunk = f.read()
            if chunk:
                out(chunk)
            elif done():
                out(f.read())
                return
            else:
                time.sleep(poll_s)


def cancel(rec: JobRecord, store: JobStore, backend: Backend | None = None) -> str:
    """Cancel through the job's backend (a no-op with a message when it already ended); record the cancel."""
    backend = backend or backend_for(rec.scheduler)
    st = status_of(rec, backend)
    if st.state.finished:
        return f"job {rec.job_id} already ended ({st.state}); nothing to cancel"
    known = backend.state(rec)
    if known is not None and known[0] == JobState.UNKNOWN:  # e.g. the id now names another job: never cancel that
        raise RuntimeFailure(f"job {rec.job_id} was not cancelled: {known[1]}.",
                             f"check `squeue -j {rec.job_id}`; scancel it yourself if it is the one.")
    said = backend.cancel(rec)
    if backend.queued:  # a queued job's cancel is final; a local job stops at a checkpoint and says so itself
        store.mark_cancelled(rec.job_id)
    return f"{said} (was {st.state})"
