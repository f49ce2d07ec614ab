"""What a rank asks of whatever started it: who it is (rank, world, local rank, job id, restart), when it must stop
(the scheduler's end time, what a SIGTERM meant) and how its job is requeued. The node side's counterpart of
hpcjobs/backends/: the protocol is trainers.jobenv.base.JobEnv, one module per environment implements it, and
`current()` chooses, here and nowhere else. No other module of the node side reads a scheduler's variables or runs
its commands (tests/test_jobenv.py reads the sources). Torch-free.

A launched rank chooses once, at its start (trainers.launch: the DistEnv's `job`, handed on as
trainers.preemption.STATE.job): asked again after the launcher exported RANK/WORLD_SIZE, `current()` takes a single
process for torchrun's rank (tests/test_jobenv_once.py). `current()` itself is the fallback outside a launch.

A new scheduler: a module here whose class overrides what its variables and commands say (`applies(env)` and the
class as ENVIRONMENT), and its name in hpcjobs.protocol.schedulers.JOB_ENVIRONMENTS (before torchrun's: a launcher
inside a job is still that scheduler's job).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from hpcjobs.protocol.schedulers import JOB_ENVIRONMENTS
from trainers.jobenv.base import JobEnv


def current(env: Mapping[str, str] | None = None) -> JobEnv:
    """The environment this rank runs in (`env`: os.environ, read when asked, never at import): the first of
    JOB_ENVIRONMENTS that applies."""
    env = os.environ if env is None else env
    for name in JOB_ENVIRONMENTS:
        module = importlib.import_module(f"trainers.jobenv.{name}")
        if module.applies(env):
            environment: JobEnv = module.ENVIRONMENT(env)
            return environment
    raise AssertionError(f"no job environment applies; the last of {JOB_ENVIRONMENTS} must apply always")
