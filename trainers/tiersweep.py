"""The node's side of the node-local tier's sweep (hpcjobs.protocol.tiersweep): when a job's first rank on a node
(local rank 0) starts, this user's tier folders of jobs that ended without removing them (a job scancelled or
SIGKILLed as a whole, a local job whose hpcjobs process was killed) are removed from the node's memory before the new
job's ranks need it. Which jobs still live is asked where each id belongs: Slurm's (`57`, `57_1`) through the scheduler
seam (trainers.jobenv.slurm.job_alive: one `scontrol show job` per folder found, none when there is none), a local
job's through its launching process (hpcjobs.protocol.tiersweep.local_alive). Torch-free: it runs before the entry.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

from hpcjobs.protocol.tierfiles import tier_base
from hpcjobs.protocol.tiersweep import Swept, is_local, local_alive, sweep
from trainers import ranklog
from trainers.distenv import DistEnv
from trainers.jobenv.base import Runner
from trainers.jobenv.slurm import job_alive


def alive(job_id: str, runner: Runner = subprocess.run) -> bool | None:
    """Whether the job that owns a tier folder still runs or waits: a local job's launcher, else Slurm's answer."""
    if is_local(job_id):
        return local_alive(job_id)
    return job_alive(job_id, runner)


def at_start(env: DistEnv, environ: Mapping[str, str] = os.environ, runner: Runner = subprocess.run,
             ) -> Swept | None:
    """The sweep, from the job's first rank on this node only (the other ranks return None at once). Never fails a
    start: a folder that cannot be read or removed is left."""
    if env.local_rank != 0:
        return None
    try:
        return sweep(tier_base(environ), {env.job_id}, lambda job_id: alive(job_id, runner),
                     say=lambda line: ranklog.warn(line, every_rank=True))
    except OSError as e:
        ranklog.warn(f"hpcjobs: node-local tier: the sweep of stale folders stopped ({e})", every_rank=True)
        return None
