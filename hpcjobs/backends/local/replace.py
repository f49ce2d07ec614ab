"""A local job's lost rank replaced while the others keep their processes (hpcjobs.protocol.rejoin says why): when
ranks of the shared trainer were killed by a signal (SIGKILL, SIGSEGV, an OOM kill: not a stop someone asked for)
and every other rank still runs, the launcher records the fault as any recovery (restarts.jsonl, the job's log; the
same bound on recoveries without a new checkpoint), calls a new generation and starts only the lost ranks again.
Anything else (a rank that exited with an error, a hang, a rank lost while a generation is still forming, a user's
own script, HPCJOBS_REJOIN=0) takes the usual path: every rank ends and starts again."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

from hpcjobs.backends import Submitted
from hpcjobs.backends.local.ranks import killed
from hpcjobs.protocol import rejoin
from hpcjobs.protocol.faultpolicy.recoverable import judge, record
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.request.spec import JobSpec

ASKED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Signals that mean someone asked the rank to stop: never replaced."""


def replaceable(spec: JobSpec, env: dict[str, str]) -> bool:
    """Whether this job's ranks may outlive a peer: the shared trainer (a user's script does not rejoin), unless the
    user said HPCJOBS_REJOIN=0."""
    return spec.entry.kind == "task" and spec.ranks > 1 and {**env, **spec.env}.get(rejoin.ON_ENV, "1") != "0"


def lost_ranks(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """The ranks a signal killed while every other rank still runs; [] when that is not the case."""
    codes = [p.poll() for p in procs]
    dead = [r for r, c in enumerate(codes) if c is not None]
    if not dead or len(dead) == len(procs):
        return []
    if any(codes[r] >= 0 or -codes[r] in ASKED for r in dead):  # type: ignore[operator]
        return []
    return dead


def replace_lost(spec: JobSpec, sub: Submitted, procs: list[subprocess.Popen[bytes]], restart: int,
                 start: Callable[[int, int, int], subprocess.Popen[bytes]]) -> int | None:
    """Replace the ranks lost from start `restart` (lost_ranks), each by `start(rank, new_restart, gen)`; returns
    the new start's number, or None to take the usual path."""
    dead = lost_ranks(procs)
    run = RunFolder(sub.run_dir)
    if not dead or rejoin.forming(run):
        return None
    d = judge(run, spec.recovery, sub.job_id, restart, procs[dead[0]].returncode, killed(procs))
    if d.action != "relaunch":
        return None
    record(run, sub.job_id, restart, d, how="rejoin")
    new, gen = run.next_restart(), rejoin.last_gen(run) + 1
    rejoin.call(run, gen, new, dead)
    for r in dead:
        procs[r] = start(r, new, gen)
    return new
