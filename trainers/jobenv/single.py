"""A single process nothing launched as a rank (a local run of one, a plain script): rank 0 of 1, no scheduler: what
`trainers.jobenv.current()` gives when no launcher and no scheduler set their variables.
Everything it answers is the base's (trainers.jobenv.base.JobEnv)."""

from __future__ import annotations

from collections.abc import Mapping

from trainers.jobenv.base import JobEnv


class Single(JobEnv):
    name = "single"


def applies(env: Mapping[str, str]) -> bool:
    """Always: a process no scheduler or launcher owns (the last environment asked)."""
    return True


ENVIRONMENT = Single
"""The class hpcjobs.protocol.schedulers.JOB_ENVIRONMENTS names this module for."""
