"""Whether a job recovers by itself from the failure that ended one of its starts, and the record each recovery
leaves: the part of the recovery that needs no scheduler, shared by the Slurm batch step's (trainers/recover.py, which
adds the nodes' health) and the local backend's (hpcjobs/backends/local/local.py, which starts its ranks again).

Bounded: a job that finishes no new checkpoint across `max_recoveries` recoveries in a row ends failed, with one
line naming the cause that repeats; a job that checkpoints between faults goes on. A task's own exception is never
recovered (hpcjobs.protocol.faultpolicy.kinds): it would fail the same way again. Torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hpcjobs.protocol.contract import Recovery
from hpcjobs.protocol.faultpolicy.diagnosis import Failure, diagnose
from hpcjobs.protocol.faultpolicy.kinds import FaultKind, kind_of, waited_for_another
from hpcjobs.protocol.runfolder import RunFolder, read_jsonl
from hpcjobs.protocol.states import StopReason

REFUSED_EXIT = 2
"""Exit code of a refused start (trainers.launch returns it): a contract or environment that cannot be read, a run
folder another job holds, a trainer or task flag that cannot be used, a resume under other settings. A usage error,
like argparse's, not a failure: never recovered."""


@dataclass(frozen=True)
class Decision:
    action: str
    """`end` (the job ends with the step's exit code), `fail` (it ends failed: `why`), `relaunch` (its ranks start
    again where they ran) or `requeue` (the scheduler starts it again, leaving out `exclude`)."""
    why: str = ""
    exclude: tuple[str, ...] = ()
    step: int = -1
    """The newest finished checkpoint's step, which the next start resumes from (-1: none)."""
    silent: tuple[str, ...] = ()
    """Nodes none of whose ranks said anything while their peers lost them or timed out: perhaps dead before
    Slurm can tell (it waits SlurmdTimeout); left out where a spare node can stand in."""


def faults_in_a_row(run: RunFolder, job_id: str, step: int) -> list[dict[str, object]]:
    """This job's recoveries since its newest finished checkpoint was made (those that left it at `step`)."""
    lines = [r for r in run.read_restarts() if str(r.get("job_id")) == job_id]
    row: list[dict[str, object]] = []
    for r in reversed(lines):
        if r.get("stopped") != str(StopReason.FAULT):
            continue
        if r.get("step") != step:
            break
        row.append(r)
    return row


def stopped_on_purpose(run: RunFolder, restart: int) -> bool:
    """The start stopped by the protocol (preemption, time limit, cancel, Ctrl-C): the scheduler decides, not us."""
    return any(r.get("restart") == restart and "stopped" in r and r["stopped"] != str(StopReason.FAULT)
               for r in run.read_restarts())


def judge(run: RunFolder, recovery: Recovery, job_id: str, restart: int, rc: int,
          said: Sequence[Failure] = ()) -> Decision:
    """What the failure that ended start `restart` (exit code `rc`) calls for, nodes aside: `end`, `fail`, or
    `relaunch` with the cause. `said`: the scheduler's words about the ranks it saw end (srun's)."""
    if rc == 0 or rc == REFUSED_EXIT or recovery.max_recoveries == 0 or stopped_on_purpose(run, restart):
        return Decision("end")
    silent: tuple[str, ...] = ()
    found = diagnose(run, job_id, list(said))
    started = any(r.get("restart") == restart and "stopped" not in r for r in run.read_restarts())
    if found is not None and found.first is not None and started:
        first = found.first
        if kind_of(first.error, first.source not in ("rank", "timeouts")) is FaultKind.TASK:
            return Decision("end")
        why = first.describe()
        silent = silent_nodes(run, job_id, restart, found.silent)
    else:
        why = f"the ranks ended with exit code {rc} and none recorded why" if started else \
            f"the ranks of restart {restart} did not start (exit code {rc})"
    step = run.newest_checkpoint()
    step = -1 if step is None else step
    row = faults_in_a_row(run, job_id, step)
    if len(row) >= recovery.max_recoveries:
        causes = "; ".join(dict.fromkeys(str(r.get("cause")) for r in reversed(row)))
        return Decision("fail", f"no new checkpoint across {len(row)} recoveries in a row (max_recoveries "
                                f"{recovery.max_recoveries}); each time: {causes}; now: {why}", step=step)
    return Decision("relaunch", why, step=step, silent=silent)


def ranks_by_host(run: RunFolder, job_id: str, restart: int) -> dict[str, set[int]]:
    """Where each rank of start `restart` ran, as startup.jsonl says (a rank writes its line after its first step)."""
    where: dict[str, set[int]] = {}
    for r in read_jsonl(run.startup, {"restart": (int,), "rank": (int,)}):
        if str(r.get("job_id")) == job_id and r["restart"] == restart and isinstance(r.get("host"), str):
            where.setdefault(r["host"], set()).add(r["rank"])
    return where


def silent_nodes(run: RunFolder, job_id: str, restart: int, silent_ranks: Sequence[int]) -> tuple[str, ...]:
    """The hosts of start `restart` all of whose ranks are among `silent_ranks`."""
    where = ranks_by_host(run, job_id, restart)
    return tuple(sorted(h for h, ranks in where.items() if ranks <= set(silent_ranks)))


def all_said(run: RunFolder, job_id: str, restart: int) -> bool:
    """Whether every rank of start `restart` that can still speak has recorded its failure: at least one has, and on
    each host either all ranks have or none has (a host none of whose ranks speaks may be dead: nothing more will
    come from it). Then the step has nothing left to say, and the recovery need not wait for srun to give up on a
    dead node's tasks; or every record says its rank timed out waiting (the silent ones are those it waited for: a
    SIGSTOPped rank's step went on 8.6 s past its peers' timeouts on the test cluster). False while any host is
    part-way, or where startup.jsonl does not say where ranks ran."""
    records = [f for f in run.read_failures() if str(f.get("job_id")) == job_id and f.get("restart") == restart]
    said = {f["rank"] for f in records}
    where = ranks_by_host(run, job_id, restart)
    if not said or not where or not said <= set().union(*where.values()):
        return False
    if all(waited_for_another(str(f.get("error", ""))) for f in records):
        return True  # they all timed out waiting: the ranks that said nothing are those they waited for (hung)
    return all(ranks <= said or not ranks & said for ranks in where.values())


WHERE = {"allocation": "in the allocation", "requeue": "by a requeue", "local": "on this machine",
         "rejoin": "in place (only the lost ranks are new processes; the others keep theirs)"}
"""restarts.jsonl's `how` of a recovery, as the job's log says it."""


def record(run: RunFolder, job_id: str, restart: int, d: Decision, how: str = "allocation") -> int:
    """The recovery's line in restarts.jsonl and the job's log; returns its number. `how`: see WHERE."""
    number = 1 + sum(1 for r in run.read_restarts()
                     if r.get("stopped") == str(StopReason.FAULT) and str(r.get("job_id")) == job_id)
    how = "requeue" if d.action == "requeue" else how
    run.record_stop(str(StopReason.FAULT), d.step, restart, job_id=job_id, recovery=number, cause=d.why,
                    how=how, exclude=list(d.exclude))
    where = WHERE[how]
    left_out = f", leaving out {', '.join(d.exclude)}" if d.exclude else ""
    start = f"step {d.step}" if d.step >= 0 else "the beginning (no finished checkpoint yet)"
    print(f"hpcjobs: recovery {number} of job {job_id}: {d.why}; the ranks start again {where} from {start}"
          f"{left_out}", file=sys.stderr, flush=True)
    return number
