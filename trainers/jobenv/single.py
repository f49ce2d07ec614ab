"""A single process nothing launched as a rank (a local run of one, a plain script): rank 0 of 1, no scheduler: what
`trainers.jobenv.current()` gives when no launcher and no scheduler set their variables.
Everything it answers is the base's (trainers.jobenv.base.JobEnv)."""

from __future__ import annotations

from trainers.jobenv.base import JobEnv


class Single(JobEnv):
    name = "single"
