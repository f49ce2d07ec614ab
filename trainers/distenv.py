"""Environment mapping → who this rank is and where the rendezvous is. Pure: no I/O, no torch.

Sources, first match wins: explicit RANK/WORLD_SIZE (torchrun, the local launcher), then Slurm's SLURM_PROCID /
SLURM_NTASKS (one task per GPU under srun), else a single process. MASTER_ADDR/MASTER_PORT set in the environment
win; otherwise the first host of SLURM_JOB_NODELIST (expanded by python-hostlist, a kept parser) and a port derived
from the job id, which every rank computes alike without talking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import hostlist

from hpcjobs.protocol.ports import port_for_job

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


class DistEnvError(ValueError):
    """The environment describes an impossible rank layout."""


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
    """This start's number in the run folder's logs and records: Slurm's requeue count, or for a local job the
    next after the folder's earlier starts (HPCJOBS_RESTART, set by the local backend)."""
    source: str
    """Where the layout came from: `torchrun`, `slurm` or `single`."""
    nccl: dict[str, str] = field(default_factory=dict)
    requeues: int = 0
    """How often Slurm requeued this job (SLURM_RESTART_COUNT): what the restart cap counts. A local job's
    resume is a new job, never a requeue."""

    def as_env(self) -> dict[str, str]:
        """The variables torch.distributed (env://) and user scripts expect."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), "HPCJOBS_JOB_ID": self.job_id,
                "HPCJOBS_RESTART": str(self.restart), **self.nccl}


def expand_nodelist(nodelist: str) -> list[str]:
    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise DistEnvError(f"cannot expand node list {nodelist!r}: {e}") from None
    if not hosts:
        raise DistEnvError(f"node list {nodelist!r} names no host")
    return hosts


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key].split("(")[0])  # SLURM_TASKS_PER_NODE-style "8(x2)" never reaches here, but be safe
    except ValueError:
        raise DistEnvError(f"{key}={env[key]!r} is not a whole number") from None


def from_environ(env: Mapping[str, str]) -> DistEnv:
    own = env.get("SLURM_JOB_ID") or env.get("HPCJOBS_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "0"
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    # An array task's records name it as the login node knows it (the job store, `status 57_1`): its own number
    # (SLURM_JOB_ID, 59) is known only here, and once Slurm forgot the job nothing could join the two.
    job_id = f"{array}_{task}" if env.get("SLURM_JOB_ID") and array and task else own
    restart = int(env.get("SLURM_RESTART_COUNT") or env.get("HPCJOBS_RESTART") or 0)
    if "RANK" in env and "WORLD_SIZE" in env:
        source = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        nnodes = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
        local_world = world // nnodes if nnodes else world
    else:
        source, rank, world, local_rank, local_world = "single", 0, 1, 0, 1
    if not 0 <= rank < world:
        raise DistEnvError(f"rank {rank} is outside a world of {world} ({source})")
    if not 0 <= local_rank < max(local_world, 1):
        raise DistEnvError(f"local rank {local_rank} is outside {local_world} ranks per node ({source})")
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif source == "slurm" and env.get("SLURM_JOB_NODELIST"):
        addr = expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
    else:
        addr = "127.0.0.1"
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    else:
        digits = "".join(c for c in own if c.isdigit())
        port = port_for_job(int(digits) if digits else 0)
    nccl = {k: v for k, v in env.items() if k.startswith(NCCL_PREFIXES)}
    requeues = int(env.get("SLURM_RESTART_COUNT") or 0)
    return DistEnv(rank, local_rank, world, local_world, addr, port, job_id, restart, source, nccl, requeues)
