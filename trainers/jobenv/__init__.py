"""What a rank asks of whatever started it: who it is (rank, world, local rank, job id, restart), when it must stop
(the scheduler's end time, what a SIGTERM meant) and how its job is requeued. The node side's counterpart of
hpcjobs/backends/: the protocol is trainers.jobenv.base.JobEnv, one module per environment implements it, and
`current()` chooses, here and nowhere else. No other module of the node side reads a scheduler's variables or runs
its commands (tests/test_jobenv.py reads the sources). Torch-free.

A new scheduler: a module here whose class overrides what its variables and commands say, and its line in
`current()` (before torchrun's: a launcher inside a job is still that scheduler's job).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from trainers.jobenv import single, slurm, torchrun
from trainers.jobenv.base import JobEnv


def current(env: Mapping[str, str] | None = None) -> JobEnv:
    """The environment this rank runs in (`env`: os.environ, read when asked, never at import)."""
    env = os.environ if env is None else env
    if slurm.applies(env):
        return slurm.SlurmJob(env)
    if torchrun.applies(env):
        return torchrun.Launched(env)
    return single.Single(env)
