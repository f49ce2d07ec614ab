"""Ranks whose launcher set torch's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR and
MASTER_PORT are read by the base for every environment): torchrun, hpcjobs's local launcher, and hpcjobs's own
launcher for a user's script. No scheduler: nothing requeues such a job, a signal just stops it."""

from __future__ import annotations

from collections.abc import Mapping

from trainers.jobenv.base import JobEnv, Layout, whole_number


def applies(env: Mapping[str, str]) -> bool:
    return "RANK" in env and "WORLD_SIZE" in env


def layout_of(env: Mapping[str, str]) -> Layout:
    """The launcher's layout; also what a Slurm job's ranks are when a launcher inside it set these variables
    (they win over srun's)."""
    rank, world = whole_number(env, "RANK"), whole_number(env, "WORLD_SIZE")
    local_rank = whole_number(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    local_world = whole_number(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    return Layout(rank, local_rank, world, local_world, "torchrun")


class Launched(JobEnv):
    name = "torchrun"

    def layout(self) -> Layout:
        return layout_of(self.env)

    def own_id(self) -> str:
        """HPCJOBS_JOB_ID (the local launcher's), else torchrun's run id."""
        return self.env.get("HPCJOBS_JOB_ID") or self.env.get("TORCHELASTIC_RUN_ID") or "0"


ENVIRONMENT = Launched
"""The class hpcjobs.protocol.schedulers.JOB_ENVIRONMENTS names this module for."""
