"""What every job environment answers (see trainers.jobenv): who this rank is, when it must stop, how its job is
requeued. The answers here are those of a process no scheduler owns (a local run, a plain script); each module of
trainers/jobenv/ overrides what its launcher or scheduler says. Pure reads of an environment mapping, except where a
method takes the command runner (`subprocess.run` by default, a stand-in in tests). Torch-free.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.ports import port_for_job

Runner = Callable[..., Any]
"""`subprocess.run`, or a stand-in taking (argv, **kwargs) and returning an object with returncode/stdout/stderr."""
LOOPBACK = "127.0.0.1"
"""The rendezvous host where nothing names one: all ranks on this host."""


class JobEnvError(StartRefused, ValueError):
    """The environment describes an impossible rank layout."""


@dataclass(frozen=True)
class Layout:
    """Who this rank is among the job's ranks, and whose variables said so."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    source: str
    """`torchrun` (a launcher's RANK/WORLD_SIZE), `slurm` (srun's task variables) or `single`."""


SINGLE = Layout(0, 0, 1, 1, "single")


def whole_number(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key].split("(")[0])  # SLURM_TASKS_PER_NODE-style "8(x2)" never reaches here, but be safe
    except ValueError:
        raise JobEnvError(f"{key}={env[key]!r} is not a whole number") from None


class JobEnv:
    """The environment a rank was started in. `name`: the implementation (`slurm`, `torchrun`, `single`); the rank
    layout's own source may differ (torchrun's variables inside a Slurm job: `torchrun` ranks of a Slurm job)."""

    name = "single"
    scheduler = ""
    """The scheduler's name as messages give it (`Slurm`); empty where none owns the job."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    # --- who am I ------------------------------------------------------------------------------------------------

    def layout(self) -> Layout:
        """Rank, local rank, world size, ranks per node. Raises JobEnvError for a value that is no number."""
        return SINGLE

    def own_id(self) -> str:
        """This job's own id, which the rendezvous port is derived from: HPCJOBS_JOB_ID (the local backend's) or 0."""
        return self.env.get("HPCJOBS_JOB_ID") or "0"

    def job_id(self) -> str:
        """The job's id as its records and the login node name it (an array task as `57_1`)."""
        return self.own_id()

    def restart(self) -> int:
        """This start's number: for a local job the next after the run folder's earlier starts (HPCJOBS_RESTART,
        set by the local backend)."""
        return int(self.env.get("HPCJOBS_RESTART") or 0)

    def requeues(self) -> int:
        """How often the scheduler requeued this job: what the restart cap counts. A local job's resume is a new
        job, never a requeue."""
        return 0

    def first_host(self) -> str | None:
        """The rendezvous host this environment names when MASTER_ADDR does not (None: it names none)."""
        return None

    def rendezvous(self) -> tuple[str, int]:
        """Where rank 0 listens: MASTER_ADDR/MASTER_PORT when set (a launcher's, or the user's), else the host the
        environment names (loopback if none) and a port every rank derives alike from the job id, without talking."""
        addr = self.env.get("MASTER_ADDR") or self.first_host() or LOOPBACK
        if self.env.get("MASTER_PORT"):
            return addr, whole_number(self.env, "MASTER_PORT")
        digits = "".join(c for c in self.own_id() if c.isdigit())
        return addr, port_for_job(int(digits) if digits else 0)

    # --- when must I stop ----------------------------------------------------------------------------------------

    def scheduler_job_id(self) -> str:
        """The id a scheduler knows this job by, what its requeue and queries name; empty where no scheduler owns
        the job (a local run, torchrun alone): there a SIGTERM or the profile's signal just stops the run."""
        return ""

    def stated_end(self) -> int | None:
        """When the scheduler ends this start (epoch seconds) where the environment says so; None: the contract's
        start time plus time limit counts (hpcjobs.protocol.contract.LaunchContract.job_end)."""
        return None

    def signal_due(self, contract: LaunchContract) -> float | None:
        """When the profile's signal is due at the latest (`seconds_before` the end); None without a time limit."""
        return contract.signal_due(self.stated_end())

    def end_time_now(self, runner: Runner = subprocess.run) -> float | None:
        """The end the scheduler holds now (it may have been extended since the start); None where it cannot say."""
        return None

    def preempted_with_sigterm(self, runner: Runner = subprocess.run) -> bool:
        """Whether a SIGTERM that came is a preemption's warning (the job must requeue itself)."""
        return False

    # --- how do I requeue ----------------------------------------------------------------------------------------

    def requeue(self, runner: Runner = subprocess.run) -> str:
        """Ask the scheduler to requeue this job (rank 0 only); the scheduler's message, empty when it worked."""
        return f"no scheduler job id ({self.scheduler_job_id()!r}) to requeue under {self.name}"

    # --- what the node was given ---------------------------------------------------------------------------------

    def allocated_gpus(self) -> str | None:
        """`NAME=value` of the variable saying the scheduler gave the job GPUs on this node, or None."""
        return None

    def cpus_per_task(self) -> int | None:
        """The CPUs the scheduler gave each rank, where it says."""
        return None
