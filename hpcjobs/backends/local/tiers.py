"""The local backend's side of the node-local tier's sweep (hpcjobs.protocol.tiersweep): before a local job's ranks
start, this user's tier folders on this machine whose local jobs are over go. A local job removes its folder when
its ranks end for good (queue.remove_tier), but one whose hpcjobs process was SIGKILLed (or whose machine lost power
mid-run, for a tier folder on disk) never reaches that line, and its /dev/shm/hpcjobs-local-…/ holds up to 4 copies of
every rank's state until a reboot. A local job lives while its launching process does (the pid in its id, as
`hpcjobs status` asks it); the job's own record (the job store, its run folder's local_process.json) says when it ran
on another host, where a tier folder in a shared HPCJOBS_LOCAL_CKPT_DIR is not this machine's to judge. A Slurm job's
folder (a compute node's) is not judged here: its state is the node side's to ask (trainers.tiersweep).
`hpcjobs doctor` with a local profile reports what a sweep would remove, and its size, and removes nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Mapping

from hpcjobs.jobs.store import JobStore
from hpcjobs.protocol.errors import RuntimeFailure
from hpcjobs.protocol.planning.host_plan import gib
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.tierfiles import tier_base
from hpcjobs.protocol.tiersweep import Swept, is_local, judge, local_alive, sweep
from hpcjobs.request.checks import Check, Result


def ran_elsewhere(job_id: str) -> bool:
    """The job's record says it ran on another host (no record, or one that does not say: not known to be)."""
    try:
        rec = JobStore().get(job_id)
    except RuntimeFailure:
        return False
    proc = RunFolder(rec.run_dir).read("local_process") if rec is not None else None
    return isinstance(proc, dict) and proc.get("job_id") == job_id and proc.get("host") != socket.gethostname()


def alive(job_id: str) -> bool | None:
    """A local job's state for the sweep; None for one run elsewhere."""
    state = local_alive(job_id)
    return None if state is None or (not state and ran_elsewhere(job_id)) else state


def sweep_here(current: Collection[str], environ: Mapping[str, str] = os.environ) -> Swept:
    """The sweep of this machine's tier folder (`environ`: the ranks' environment, which names it), before the jobs
    `current` start; its lines go to stderr."""
    return sweep(tier_base(environ), current, alive, ours=is_local)


def doctor_check(environ: Mapping[str, str] = os.environ) -> Check:
    """`hpcjobs doctor`'s row: this user's tier folders here whose local jobs are over (a sweep would remove them)."""
    base = tier_base(environ)
    found = judge(base, (), alive, ours=is_local)
    if not found.removed and not found.left:
        return Check("node-local tier", Result.PASS, f"no folders of ended jobs in {base}")
    parts = []
    if found.removed:
        held, names = gib(sum(f.size for f in found.removed)), ", ".join(str(f.path) for f in found.removed)
        parts.append(f"{len(found.removed)} folder(s) of ended local jobs hold {held} of this machine's memory "
                     f"({names}): the next local job's start removes them")
    if found.left:
        parts.append(f"{len(found.left)} whose job's state is not known here, left "
                     f"({', '.join(f.text() for f in found.left)})")
    return Check("node-local tier", Result.PASS, "; ".join(parts))
