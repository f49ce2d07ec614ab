"""Which rank failed first, and why: from every rank's own record (RUN/failures.jsonl), what the scheduler said
about its tasks (Slurm: srun's `srun: error: node2: task 3: Killed`, parsed behind the backend seam) and which ranks
said nothing.

A rank that dies by a signal (SIGKILL, the OOM killer, a segfault) writes nothing; its peers then fail on a closed
connection and write that. So the scheduler's word about a killed task comes before the peers' records; and when
some ranks timed out, the rank they waited for hung. A rank's own exception (anything but a lost peer or a timeout)
comes before a kill: srun kills the rest of the step (`--kill-on-bad-exit`) once a task exited badly, and its lines
about those kills may come before its line about that exit (seen on the test cluster: rank 3 raised, and srun's
`node1: task 0: Killed` was the first line of the two).

A node that failed (the scheduler's word, `NodeFault`: Slurm's NODE_FAIL, the node's own reason) comes before every
rank's record: its ranks recorded nothing, and the healthy ranks' "Connection reset by peer" is only what they saw of
it (measured on the test cluster: a killed node with its link up).

A rank's hang watchdog (trainers/watchdog.py) records `hung: ...` (hpcjobs.protocol.faultpolicy.kinds.HUNG) on every
rank whose step progress stopped: the healthy ranks that waited in a collective for the hung one too. The hung rank
itself records nothing (SIGSTOPped, then killed) or records last: only Slurm's SIGCONT, when it ends the step, wakes it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpcjobs.protocol.faultpolicy.kinds import DID_NOT_RUN, HUNG, PEER_LOST, TIMEOUT, waited_for_another
from hpcjobs.protocol.runfolder import RunFolder

TAIL_LINES = 5
NODE = "node"
"""A Failure's source when a node failed: `host` is the node, `error` why (the scheduler's words)."""


@dataclass(frozen=True)
class Failure:
    rank: int
    host: str
    error: str
    source: str
    """"rank": the rank's own record; "timeouts": the others' records (they timed out waiting for this one); else
    the scheduler's tool that said it (e.g. "srun")."""
    log: str | None = None
    time: float = 0.0
    """When the rank recorded it (0: the scheduler's words carry no time)."""

    def describe(self) -> str:
        if self.source == NODE:
            return f"node {self.host} failed: {self.error}"
        said = "" if self.source in ("rank", "timeouts") else f" (said by {self.source}; the rank wrote nothing)"
        return f"rank {self.rank} on {self.host}: {self.error}{said}"


@dataclass(frozen=True)
class NodeFault:
    """The scheduler's word that a node of the job failed (Slurm: the job's NODE_FAIL, FailedNode=, a node DOWN
    with its Reason=), handed to `diagnose` as srun's lines are (hpcjobs.backends.slurm.failed_nodes)."""

    nodes: tuple[str, ...]
    """The node that failed, or the nodes it was one of (Slurm's accounting names the allocation's, not which)."""
    why: str
    """The node's own reason (`Not responding [slurm@2026-11-25T10:04:12]`), else the job's."""
    said: str
    """Where the scheduler said it: `job state NODE_FAIL, FailedNode=node2`, `sacct: allocation ended NODE_FAIL`."""
    time: float = 0.0
    """When the job's allocation ended on it (0: not known, taken as the newest start's)."""
    requeued: bool = False
    """Whether the scheduler requeued the job for it (the job starts again by itself)."""

    def describe(self) -> str:
        nodes = self.nodes[0] if len(self.nodes) == 1 else f"one of {', '.join(self.nodes) or 'its nodes'}"
        again = "; Slurm requeued the job" if self.requeued else ""
        return f"{nodes}: {self.why} ({self.said}{again})"


@dataclass(frozen=True)
class Diagnosis:
    first: Failure | None
    silent: tuple[int, ...]
    """Ranks of the last start that neither recorded a failure nor were named by the scheduler."""
    tail: tuple[str, ...]
    """The last lines of the first failed rank's log."""


def by_signal(f: Failure) -> bool:
    return not f.error.startswith("Exited with exit code")


def waited(f: Failure) -> bool:
    """A record of a rank that waited for another: its hang watchdog's, or a collective's timeout."""
    return waited_for_another(f.error)


def diagnose(run: RunFolder, job_id: str, said: list[Failure], nodes: Sequence[NodeFault] = ()) -> Diagnosis | None:
    """The last start of `job_id` in `run`, diagnosed; None when no rank of it failed and the scheduler named none.
    `said`: the scheduler's words about tasks that ended badly, in the order it saw them; `nodes`: its words about
    nodes of the job that failed (one that ended an allocation before the last start began is an earlier start's)."""
    starts = [r for r in run.read_restarts() if "stopped" not in r and str(r.get("job_id")) == job_id]
    restart = max((int(r.get("restart", 0)) for r in starts), default=0)
    world = next((int(r["world_size"]) for r in reversed(starts) if "world_size" in r), 0)
    began = max((float(r.get("time", 0)) for r in starts if r.get("restart", 0) == restart), default=0.0)
    recorded = recorded_failures(run, job_id, restart)
    lost = [n for n in nodes if not n.time or n.time + 1 >= began]  # sacct's times are whole seconds
    earlier = [n for n in nodes if n not in lost]
    if not recorded and not lost and earlier:  # the last start failed in nothing: a node ended an earlier one
        return earlier_node_failure(run, job_id, starts, world, said, earlier[-1])
    if not recorded and not said and not lost:
        return None
    named = {f.rank for f in recorded} | {f.rank for f in said}
    silent = tuple(r for r in range(world) if r not in named)
    first = (node_failure(run, restart, world, recorded, lost[-1]) if lost
             else first_failure(run, restart, world, recorded, said))
    log = first.log or str(run.rank_log(restart, first.rank))
    return Diagnosis(replace(first, log=log), silent,
                     tuple(read_text(Path(log)).splitlines()[-TAIL_LINES:]))


def recorded_failures(run: RunFolder, job_id: str, restart: int) -> list[Failure]:
    """The ranks' own records of start `restart`, oldest first."""
    records = sorted((r for r in run.read_failures() if str(r.get("job_id")) == job_id
                      and r.get("restart", 0) == restart), key=lambda r: r.get("time", 0))
    return [Failure(int(r["rank"]), str(r.get("host")), str(r.get("error")), "rank", r.get("log"),
                    float(r.get("time", 0))) for r in records]


def earlier_node_failure(run: RunFolder, job_id: str, starts: list[dict[str, Any]], world: int,
                         said: list[Failure], fault: NodeFault) -> Diagnosis:
    """The node that ended the start it came in (a requeued job that went on): diagnosed against that start's
    records, and srun's words, which name the tasks it could still reach (Slurm killed the healthy node's ranks when
    it ended the allocation: they record nothing either; the dead node's, srun cannot name)."""
    restart = max((int(r.get("restart", 0)) for r in starts if float(r.get("time", 0)) <= fault.time), default=0)
    first = node_failure(run, restart, world, recorded_failures(run, job_id, restart), fault, heard=said)
    return Diagnosis(first, (), tuple(read_text(Path(first.log or "")).splitlines()[-TAIL_LINES:]))


def first_failure(run: RunFolder, restart: int, world: int, recorded: list[Failure],
                  said: list[Failure]) -> Failure:
    """The first failure when no node failed: a hung rank, else a rank's own exception, else a killed one."""
    ranks_recorded = {f.rank for f in recorded}
    killed = [f for f in said if by_signal(f) and f.rank not in ranks_recorded]
    hung = hung_rank(run, restart, world, recorded, said)
    if hung is not None:
        return hung
    if own := [f for f in recorded if not PEER_LOST.search(f.error) and not waited(f)]:
        return own[0]
    if killed:
        return killed[0]
    return recorded[0] if recorded else said[0]


def hung_rank(run: RunFolder, restart: int, world: int, recorded: list[Failure],
              said: list[Failure]) -> Failure | None:
    """The rank the others waited for (timed out in a collective, or their hang watchdogs fired): the one whose own
    watchdog says its process did not run (DID_NOT_RUN: stopped, suspended or starved, while the others waited);
    else one that recorded nothing (stuck, then killed), or only after they did (Slurm's SIGCONT + SIGTERM, when it
    ends the step, woke it to fail on the closed connections). A rank that failed on a closed connection before any
    wait was recorded lost a peer that waited. When every rank recorded a wait, the hung rank's came last, well after
    the others' (they timed out or fired together; measured on the test cluster: a SIGSTOPped rank 3 recorded a
    timeout once woken, and rank 0's, the first, was taken for the cause in 1 run of 4); records close together name
    no one (every rank stalled: a filesystem, say)."""
    waits = [f for f in recorded if waited(f)]
    if not waits:
        return None
    stopped = [f for f in waits if DID_NOT_RUN in f.error]
    if stopped and len({f.rank for f in stopped}) < max(world, 2):
        return replace(stopped[0], error=f"{stopped[0].error}; the other ranks waited for it", source="timeouts")
    woke_late = {f.rank for f in recorded if f.time > waits[0].time}
    ranks_recorded = {f.rank for f in recorded}
    quiet = [r for r in range(world) if r not in {f.rank for f in waits}
             and (r not in ranks_recorded or r in woke_late)]
    if quiet:
        why = "timed out" if TIMEOUT.search(waits[0].error) and not waits[0].error.startswith(HUNG) else \
            "stopped (their hang watchdogs fired)"
        rank = quiet[0]
        host = next((f.host for f in [*recorded, *said] if f.rank == rank), None) or host_of(run, restart, rank)
        return Failure(rank, host, f"hung: the other ranks {why} waiting for it ({waits[0].error})", "timeouts")
    hangs = [f for f in waits if f.error.startswith(HUNG)]
    if len(hangs) == 1 == world:
        return hangs[0]
    return came_last(waits, world)


def came_last(waits: list[Failure], world: int) -> Failure | None:
    """Every rank recorded a wait: the one whose record came last, well after every other rank's (they waited
    together; only Slurm's SIGCONT woke it), else None."""
    if len({f.rank for f in waits}) < max(world, 1) or len(waits) < 2:
        return None
    last, others = waits[-1], [f for f in waits if f.rank != waits[-1].rank]
    if not others or last.time - others[-1].time <= max(1.0, others[-1].time - others[0].time):
        return None
    whose = "its watchdog's record" if last.error.startswith(HUNG) else "its record"
    return replace(last, error=f"{last.error} ({whose} came last, after every other rank's: only Slurm's SIGCONT "
                               "woke it)", source="timeouts")


def node_failure(run: RunFolder, restart: int, world: int, recorded: list[Failure], fault: NodeFault,
                 heard: Sequence[Failure] = ()) -> Failure:
    """A failed node as the first failure: of the nodes the scheduler names, the one whose ranks recorded nothing
    (a dead node's ranks write nothing) and of whose tasks the scheduler said nothing (`heard`), with those ranks
    named."""
    hosts = {f.rank: f.host for f in [*recorded, *heard]}
    on = {n: [r for r in range(world) if short(hosts.get(r) or host_of(run, restart, r)) == short(n)]
          for n in fault.nodes}
    wrote = {f.rank for f in recorded} | {f.rank for f in heard}
    node = next((n for n in fault.nodes if on[n] and not set(on[n]) & wrote), None)
    if node is None and len(fault.nodes) == 1:
        node = fault.nodes[0]
    ranks = on.get(node, []) if node else []
    said = f"{fault.why} ({fault.said}{'; Slurm requeued the job' if fault.requeued else ''})"
    if ranks:
        said += f"; {'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} on it recorded nothing"
    host = node or f"one of {', '.join(fault.nodes) or 'its nodes'}"
    rank = ranks[0] if ranks else min((r for r in range(world) if r not in wrote), default=0)
    return Failure(rank, host, said, NODE, str(run.rank_log(restart, rank)))


def short(host: str) -> str:
    """A host's short name: Slurm's NodeName may be the short one of the ranks' FQDN."""
    return host.split(".")[0]


def host_of(run: RunFolder, restart: int, rank: int) -> str:
    """The host a rank ran on, from its log's first line (the launcher's `rank R/W ... on HOST,`)."""
    m = re.search(r" on (\S+), job ", read_text(run.rank_log(restart, rank)))
    return m.group(1) if m else "an unknown host"


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
