"""Environment mapping → who this rank is and where the rendezvous is. No torch, and no I/O but one: where NCCL's
interface is named and gloo's is not, the node's interfaces are read to resolve gloo's (hpcjobs.protocol.ifnames).

The environment is read by trainers.jobenv (`current()` picks Slurm, torchrun-style or a single process; a
launcher's RANK/WORLD_SIZE win over srun's task variables); here the layout is checked and joined with the
rendezvous, the NCCL settings and gloo's interface into the one `DistEnv` the rank and its records use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcjobs.protocol.ifnames import InterfaceError, gloo_interface
from trainers import jobenv
from trainers.jobenv.base import JobEnv, JobEnvError

NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_")

CONTROL_TIMEOUT_MIN_S = 1800.0
"""The least the control group (checkpoint barriers, the stop agreement) waits: rank 0 alone writes the shared
checkpoint while the others wait at its barrier, which for a large model on a network filesystem takes minutes."""


def setting_seconds(setting: tuple[str, float], environ: Mapping[str, str]) -> float:
    """The setting's value from the environment (a positive number of seconds), else its default."""
    name, default = setting
    text = environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        raise DistEnvError(f"{name}={text!r} is not a number of seconds; valid: a number > 0. HINT: e.g. "
                           f"{name}={default:g}") from None
    if not value > 0:
        raise DistEnvError(f"{name}={text!r}; valid: a number of seconds > 0. HINT: e.g. {name}={default:g}")
    return value


DistEnvError = JobEnvError
"""The environment describes an impossible rank layout (raised by trainers.jobenv, which reads it)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    job_id: str
    restart: int
    """This start's number in the run folder's logs and records: the scheduler's requeue count, or for a local job
    the next after the folder's earlier starts (HPCJOBS_RESTART, set by the local backend)."""
    source: str
    """Where the layout came from: `torchrun`, `slurm` or `single`."""
    nccl: dict[str, str] = field(default_factory=dict)
    requeues: int = 0
    """How often the scheduler requeued this job (trainers.jobenv's `requeues`): what the restart cap counts. A
    local job's resume is a new job, never a requeue."""
    gloo: dict[str, str] = field(default_factory=dict)
    """GLOO_SOCKET_IFNAME resolved on this node from NCCL_SOCKET_IFNAME's prefixes, where only NCCL's was set."""
    job: JobEnv | None = field(default=None, compare=False, repr=False)
    """The job environment this DistEnv was read from, chosen once at the start (from_environ): the launcher hands
    it on (preemption, standby, the process group), since after it exports RANK/WORLD_SIZE a second
    `jobenv.current()` would take a single process for torchrun's rank."""

    def as_env(self) -> dict[str, str]:
        """The variables torch.distributed (env://) and user scripts expect."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), "HPCJOBS_JOB_ID": self.job_id,
                "HPCJOBS_RESTART": str(self.restart), **self.nccl, **self.gloo}


def from_environ(env: Mapping[str, str], job: JobEnv | None = None) -> DistEnv:
    """This rank's layout and rendezvous, from the environment it runs in: `job` where the start chose it, else
    trainers.jobenv.current(env). Raises DistEnvError."""
    job = job or jobenv.current(env)
    job_id, restart = job.job_id(), job.restart()
    layout = job.layout()
    rank, world, local_rank, local_world = layout.rank, layout.world_size, layout.local_rank, layout.local_world_size
    if not 0 <= rank < world:
        raise DistEnvError(f"rank {rank} is outside a world of {world} ({layout.source})")
    if not 0 <= local_rank < max(local_world, 1):
        raise DistEnvError(f"local rank {local_rank} is outside {local_world} ranks per node ({layout.source})")
    addr, port = job.rendezvous()
    nccl = {k: v for k, v in env.items() if k.startswith(NCCL_PREFIXES)}
    try:
        gloo = gloo_interface(env)
    except InterfaceError as e:
        raise DistEnvError(str(e)) from None
    return DistEnv(rank, local_rank, world, local_world, addr, port, job_id, restart, layout.source, nccl,
                   job.requeues(), gloo, job)


def job_of(env: DistEnv, environ: Mapping[str, str] | None = None) -> JobEnv:
    """The job environment `env` was read from; for a DistEnv made by hand (tests), the one that applies now."""
    return env.job if env.job is not None else jobenv.current(environ)
