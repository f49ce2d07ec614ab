"""Which rank failed first, and why: from every rank's own record (RUN/failures.jsonl), what the scheduler said
about its tasks (Slurm: srun's `srun: error: node2: task 3: Killed`, parsed behind the backend seam) and which ranks
said nothing.

A rank that dies by a signal (SIGKILL, the OOM killer, a segfault) writes nothing; its peers then fail on a closed
connection and write that. So the scheduler's word about a killed task comes before the peers' records; and when
some ranks timed out, the rank they waited for hung. A rank's own exception (anything but a lost peer or a timeout)
comes before a kill: srun kills the rest of the step (`--kill-on-bad-exit`) once a task exited badly, and its lines
about those kills may come before its line about that exit (seen on the test cluster: rank 3 raised, and srun's
`node1: task 0: Killed` was the first line of the two).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from hpcjobs.protocol.faults import PEER_LOST, TIMEOUT
from hpcjobs.protocol.runfolder import RunFolder

TAIL_LINES = 5


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
        said = "" if self.source in ("rank", "timeouts") else f" (said by {self.source}; the rank wrote nothing)"
        return f"rank {self.rank} on {self.host}: {self.error}{said}"


@dataclass(frozen=True)
class Diagnosis:
    first: Failure | None
    silent: tuple[int, ...]
    """Ranks of the last start that neither recorded a failure nor were named by the scheduler."""
    tail: tuple[str, ...]
    """The last lines of the first failed rank's log."""


def by_signal(f: Failure) -> bool:
    return not f.error.startswith("Exited with exit code")


def diagnose(run: RunFolder, job_id: str, said: list[Failure]) -> Diagnosis | None:
    """The last start of `job_id` in `run`, diagnosed; None when no rank of it failed and the scheduler named none.
    `said`: the scheduler's words about tasks that ended badly, in the order it saw them."""
    starts = [r for r in run.read_restarts() if "stopped" not in r and str(r.get("job_id")) == job_id]
    restart = max((int(r.get("restart", 0)) for r in starts), default=0)
    world = next((int(r["world_size"]) for r in reversed(starts) if "world_size" in r), 0)
    records = sorted((r for r in run.read_failures() if str(r.get("job_id")) == job_id
                      and r.get("restart", 0) == restart), key=lambda r: r.get("time", 0))
    recorded = [Failure(int(r["rank"]), str(r.get("host")), str(r.get("error")), "rank", r.get("log"),
                        float(r.get("time", 0))) for r in records]
    if not recorded and not said:
        return None
    ranks_recorded = {f.rank for f in recorded}
    killed = [f for f in said if by_signal(f) and f.rank not in ranks_recorded]
    named = ranks_recorded | {f.rank for f in said}
    silent = tuple(r for r in range(world) if r not in named)
    timeouts = [f for f in recorded if TIMEOUT.search(f.error)]
    # The rank the others timed out waiting for hung: it recorded nothing (stuck, then killed), or only after they
    # timed out (Slurm's SIGCONT + SIGTERM, when it ends the step, woke it to fail on the closed connections). A
    # rank that failed on a closed connection before any timeout was recorded lost a peer that timed out.
    woke_late = {f.rank for f in recorded if timeouts and f.time > timeouts[0].time}
    hung = [r for r in range(world) if r not in {f.rank for f in timeouts}
            and (r not in ranks_recorded or r in woke_late)]
    if timeouts and hung:
        rank = hung[0]
        host = next((f.host for f in [*recorded, *said] if f.rank == rank), None) or host_of(run, restart, rank)
        first = Failure(rank, host, f"hung: the other ranks timed out waiting for it ({timeouts[0].error})",
                        "timeouts")
    elif own := [f for f in recorded if not PEER_LOST.search(f.error) and not TIMEOUT.search(f.error)]:
        first = own[0]
    elif killed:
        first = killed[0]
    else:
        first = recorded[0] if recorded else said[0]
    log = first.log or str(run.rank_log(restart, first.rank))
    return Diagnosis(replace(first, log=log), silent,
                     tuple(read_text(Path(log)).splitlines()[-TAIL_LINES:]))


def host_of(run: RunFolder, restart: int, rank: int) -> str:
    """The host a rank ran on, from its log's first line (the launcher's `rank R/W ... on HOST,`)."""
    m = re.search(r" on (\S+), job ", read_text(run.rank_log(restart, rank)))
    return m.group(1) if m else "an unknown host"


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
