"""What Slurm knows of a job's faults, for `hpcjobs status`: its restart count and the nodes of it that failed.

Measured and read from Slurm 22.05 (tests/golden/testcluster-scontrol-*.txt, /work/shared/docs): a node that dies
under a requeueable batch job ends the allocation NODE_FAIL (accounting keeps it: `sacct -D` lists every allocation
of a requeued job, the NODE_FAIL one included), counts `Restarts=` up at once, and shows `JobState=COMPLETING ...
FailedNode=node2` until the nodes are cleaned up; then the job is PENDING (Reason=BeginTime, for the credential's
lifetime) and `FailedNode=` is gone. A job that is not requeued stays `JobState=NODE_FAIL Reason=NodeDown
FailedNode=node2`. The node itself says why in its own `Reason=` (`scontrol show node`: `Not responding
[slurm@2026-11-25T10:04:12]`) while it is down, and forgets it once it is back (ReturnToService=2).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import hostlist

from hpcjobs.backends import SchedulerFacts
from hpcjobs.backends.common import Runner
from hpcjobs.backends.slurm.fields import sacct_time, scontrol_fields
from hpcjobs.protocol.faultpolicy.diagnosis import NodeFault

NODE_FAIL = "NODE_FAIL"
SICK = re.compile(r"DOWN|FAIL|DRAIN|NOT_RESPONDING|\*")
"""A node state (`DOWN*`, `IDLE+DRAIN`, `MIXED+FAIL`; `*`: not responding) that says the node is not well."""
NODE_LINE = re.compile(r"NodeName=(?P<name>\S+).*?\bState=(?P<state>\S+)")
REASON = re.compile(r"\bReason=(?P<reason>.*?)(?= Comment=| Extra=|$)")
"""A node's Reason= in `scontrol show node -o`: its last field (before the optional Comment=/Extra=); it holds
spaces."""


@dataclass(frozen=True)
class SacctLine:
    """One line of `sacct -D`: an allocation of the job (a requeued job has one per start)."""

    state: str
    nodes: tuple[str, ...]
    end: float | None


def expand(nodes: str) -> tuple[str, ...]:
    """A Slurm host list (`node[1-2]`) as names; () for none (`None assigned`) or one that is not a host list."""
    try:
        return tuple(hostlist.expand_hostlist(nodes)) if nodes and " " not in nodes else ()
    except hostlist.BadHostlist:
        return ()


def sacct_allocations(job_id: str, run: Runner) -> list[SacctLine]:
    """Every allocation of the job, oldest first (`-D`: a requeued job's earlier ones too); [] without accounting."""
    out = run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State,NodeList,End"])
    if out.returncode != 0:
        return []
    found = []
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 3:
            found.append(SacctLine(parts[0].strip().split(" ")[0], expand(parts[1].strip()), sacct_time(parts[2])))
    return found


def node_states(nodes: Sequence[str], run: Runner) -> dict[str, tuple[str, str]]:
    """Each node's (State, Reason) as `scontrol show node -o` says it now; {} when it cannot."""
    if not nodes:
        return {}
    out = run(["scontrol", "show", "node", "-o", ",".join(nodes)])
    if out.returncode != 0:
        return {}
    found = {}
    for line in out.stdout.splitlines():
        if m := NODE_LINE.search(line.strip()):
            why = REASON.search(line.strip())
            found[m["name"]] = (m["state"], why["reason"].strip() if why else "")
    return found


def slurm_facts(job_id: str, run: Runner) -> SchedulerFacts:
    """Slurm's restart count for the job (scontrol's `Restarts=`, else sacct's allocations less one) and the nodes
    of it that failed: scontrol's word for the newest allocation, sacct's for every one it kept. Accounting is asked
    only where a fault may be (a restart, a NODE_FAIL, a job scontrol has forgotten): `list` asks for many jobs."""
    fields = scontrol_fields(job_id, run)
    state, restarts = fields.get("JobState", ""), fields.get("Restarts", "")
    suspect = not fields or restarts not in ("", "0") or state == NODE_FAIL or "FailedNode" in fields
    allocs = sacct_allocations(job_id, run) if suspect else []
    count = int(restarts) if restarts.isdigit() else (len(allocs) - 1 if allocs else None)
    alive = bool(fields) and state != NODE_FAIL  # scontrol still holds a job that is not NODE_FAIL: requeued
    faults = [(a.nodes, f"sacct: the job's allocation ended {NODE_FAIL}", a.end or 0.0,
               i < len(allocs) - 1 or alive) for i, a in enumerate(allocs) if a.state == NODE_FAIL]
    if "FailedNode" in fields or state == NODE_FAIL:
        failed = fields.get("FailedNode")
        end = sacct_time(fields.get("EndTime", "")) or 0.0
        faults = [f for f in faults if not end or abs(f[2] - end) > 2]  # the same fault, in scontrol's words
        said = f"scontrol: JobState={state} Reason={fields.get('Reason', '?')}" + (
            f" FailedNode={failed}" if failed else "")
        faults.append(((failed,) if failed else expand(fields.get("NodeList", "")), said, end, state != NODE_FAIL))
    states = node_states(sorted({n for nodes, *_ in faults for n in nodes}), run)
    return SchedulerFacts(count, tuple(node_fault(nodes, said, end, again, states)
                                       for nodes, said, end, again in faults))


def node_fault(nodes: tuple[str, ...], said: str, end: float, requeued: bool,
               states: dict[str, tuple[str, str]]) -> NodeFault:
    """One failure: of its nodes, those Slurm still holds not well, with the first one's own reason."""
    sick = tuple(n for n in nodes if SICK.search(states.get(n, ("", ""))[0]))
    reason = next((states[n][1] for n in sick if states[n][1]), "")
    if sick:
        why = reason or f"State={states[sick[0]][0]}"
    else:
        why = "its reason is gone: the node is up again" if states else "its reason unknown"
    return NodeFault(sick or nodes, why, said, end, requeued)
