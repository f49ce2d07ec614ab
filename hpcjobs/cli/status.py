"""The commands about jobs hpcjobs submitted: `status`, `list`, `logs` and `cancel`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from hpcjobs.cli import present
from hpcjobs.cli.parser import Parser, command_parser, job_state, limit
from hpcjobs.protocol.errors import UsageError

if TYPE_CHECKING:
    from hpcjobs.cli.parser import Subparsers
    from hpcjobs.jobs.store import JobRecord, JobStore
    from hpcjobs.protocol.states import JobState
    from hpcjobs.request.after import After


def add_status(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "status", "A job's state (squeue, then sacct, then its run folder), restarts and last "
                       "step.")
    p.add_argument("job", nargs="?", help="job id (default: the newest job)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_status)


def run_status(ns: argparse.Namespace) -> int:
    from hpcjobs.follow.status import records_for, status_of
    from hpcjobs.goodput.report import job_goodput
    from hpcjobs.jobs.store import JobStore
    from hpcjobs.protocol.runfolder import split_task_id

    store = JobStore()
    if ns.job is None:
        recent = store.recent(1)
        if not recent:
            raise UsageError("no job was submitted with hpcjobs here yet.", "hpcjobs submit --help")
        newest = recent[0]  # a sweep's newest task stands for its array
        ns.job = split_task_id(newest.job_id)[0] if newest.spec.get("array_task") is not None else newest.job_id
    records = records_for(ns.job, store)
    if len(records) > 1:
        present.array_status(ns.job, [status_of(r) for r in records], [r.spec.get("point") for r in records],
                             ns.json)
        return 0
    st = status_of(records[0])
    goodput = job_goodput(records[0], st.state, store)
    after = upstream_states(records[0], store)
    if ns.json:
        present.print_json({**st.as_dict(), "goodput": goodput.as_dict() if goodput else None,
                            "after": [{"job_id": a.job_id, "condition": a.condition, "state": str(state)}
                                      for a, state in after]})
    else:
        present.status(st, goodput, after)
    return 0


def upstream_states(rec: JobRecord, store: JobStore) -> list[tuple[After, JobState]]:
    """The jobs `rec` waits for (--after, recorded in its spec), each with its state now (UNKNOWN: not found)."""
    from hpcjobs.follow.status import job_state
    from hpcjobs.protocol.states import JobState
    from hpcjobs.request.after import parse_after

    found = []
    for text in rec.spec.get("after") or []:
        a = parse_after(str(text))
        try:
            state, _ = job_state(a.job_id, store)
        except UsageError:
            state = JobState.UNKNOWN
        found.append((a, state))
    return found


def add_list(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "list", "Recent jobs submitted with hpcjobs.")
    p.add_argument("--state", type=job_state, help="only jobs in this state (e.g. RUNNING, COMPLETED)")
    p.add_argument("--profile", help="only jobs of this profile")
    p.add_argument("--limit", type=limit, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_list)


def run_list(ns: argparse.Namespace) -> int:
    from hpcjobs.follow.status import status_of
    from hpcjobs.jobs.store import JobStore

    statuses = [status_of(r) for r in JobStore().recent(ns.limit, ns.profile)]
    if ns.state:
        statuses = [s for s in statuses if s.state == ns.state]
    if ns.json:
        present.print_json([s.as_dict() for s in statuses])
    else:
        present.jobs(statuses)
    return 0


def add_logs(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "logs", "Print a rank's log of a restart (rank 0 of the latest restart by default).")
    p.add_argument("job")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--restart", type=int, default=None)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(run=run_logs)


def run_logs(ns: argparse.Namespace) -> int:
    from hpcjobs.follow.status import follow, log_path, status_of

    rec = one_record(ns.job, "logs")
    path = log_path(rec, ns.rank, ns.restart)
    if not ns.follow:
        sys.stdout.write(path.read_text(errors="replace"))
        return 0

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    follow(path, out, lambda: status_of(rec).state.finished)
    return 0


def one_record(job_id: str, command: str) -> JobRecord:
    """The record of a job or one array task; an array's id is refused, naming its tasks."""
    from hpcjobs.follow.status import records_for
    from hpcjobs.jobs.store import JobStore

    records = records_for(job_id, JobStore())
    if len(records) > 1:
        raise UsageError(f"job {job_id} is a sweep's array of {len(records)} tasks; valid: one task, "
                         f"{records[0].job_id} to {records[-1].job_id}.", f"e.g. hpcjobs {command} {records[0].job_id}")
    return records[0]


def add_cancel(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "cancel", "Cancel jobs (scancel) and record it.")
    p.add_argument("jobs", nargs="+")
    p.set_defaults(run=run_cancel)


def run_cancel(ns: argparse.Namespace) -> int:
    from hpcjobs.follow.status import cancel, records_for
    from hpcjobs.jobs.store import JobStore

    store = JobStore()
    records = [r for j in ns.jobs for r in records_for(j, store)]  # every id checked before anything is cancelled
    for rec in records:
        print(cancel(rec, store))
    return 0
