"""Process group set-up and tear-down: NCCL + CUDA when GPUs are visible, gloo on the CPU otherwise."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcjobs.protocol.runfolder import IMPORTED, JOINED, RunFolder
from hpcjobs.protocol.timeouts import COLLECTIVE_TIMEOUT, INIT_TIMEOUT
from trainers import allocator, rejoin, startup, versions
from trainers.distenv import CONTROL_TIMEOUT_MIN_S, DistEnv, from_environ, job_of, setting_seconds


class RendezvousError(RuntimeError):
    pass


@dataclass
class DistContext:
    env: DistEnv
    device: torch.device
    backend: str
    control_group: Any = None
    """A gloo group of its own for the tiny CPU collectives (the stop flag, checkpoint barriers), which keep the
    start-up timeout; None with one rank."""
    checkpoint_group: Any = None
    """Another gloo group, for Distributed Checkpoint's planning collectives: an asynchronous save runs them in a
    background thread while training uses the other groups. None when there is no process group."""

    timeout_s: float | None = None
    """What the training's collectives wait now: the start-up timeout until the first step has finished, then the
    collective timeout (None without a process group)."""
    groups: list[Any] = field(default_factory=list)
    """The training's process groups beside the default one (FSDP's mesh groups, `adopt`): each waits as long as
    the default group does."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier(group=self.control_group)

    def adopt(self, groups: list[Any]) -> None:
        """Give the training's own process groups (torch makes a device mesh's with its default timeout: 10 minutes
        on NCCL) the timeout the default group has now, and the collective timeout once the first step is done."""
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        for group in groups:
            if group is None or any(group is known for known in self.groups):
                continue
            self.groups.append(group)
            if set_timeout is not None and self.timeout_s is not None:
                set_timeout(datetime.timedelta(seconds=self.timeout_s), group)

    def training_timeout(self) -> float | None:
        """Once the first step has finished: the training's collectives (the default group and every group it
        adopted) get the (shorter) collective timeout, as torchtitan does. Returns it (None with one rank, or where
        this torch cannot change it)."""
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if not dist.is_initialized() or self.world_size == 1 or set_timeout is None:
            return None
        seconds = setting_seconds(COLLECTIVE_TIMEOUT, os.environ)
        self.timeout_s = seconds
        for group in [None, *self.groups]:
            set_timeout(datetime.timedelta(seconds=seconds), group)
        return seconds


FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
"""NCCL's flight recorder: the last 2000 collectives of each rank, dumped when a collective times out, so the dump
says which rank stopped where. The profile's nccl: section may set these otherwise."""

FR_SIZE_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""The buffer size's name since torch 2.11, and before: 2.11 reads both and warns at the old one, twice a rank and
start (seen on an H200 with 2.11.0+cu130); older versions know only the old one."""


def flight_recorder_env(trace_prefix: Path, version: str = torch.__version__,
                        environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables (read when the NCCL group is made) that dump to `trace_prefix`RANK, the buffer size under the
    name this torch reads; none for the size when the environment (the user, the profile) already sets either."""
    env = {**FLIGHT_RECORDER, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(trace_prefix)}
    size = env.pop(FR_SIZE_NAMES[0])
    if not any(name in environ for name in FR_SIZE_NAMES):
        env[FR_SIZE_NAMES[0] if versions.parse(version) >= (2, 11) else FR_SIZE_NAMES[1]] = size
    return env


def cuda_missing_reason() -> str:
    try:
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - torch says why in several types (AssertionError, RuntimeError)
        return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return "torch.cuda.is_available() is False"


def pick_backend(env: DistEnv, environ: Mapping[str, str] = os.environ) -> tuple[str, torch.device]:
    """NCCL on this rank's GPU when CUDA works; gloo on the CPU when there is none to use, or HPCJOBS_BACKEND=gloo
    says so. A rank without CUDA on a node where the scheduler allocated GPUs is an error: falling back to gloo there
    would leave the other ranks (on NCCL) waiting for it until the rendezvous times out, with a message about the
    wrong thing."""
    forced = environ.get("HPCJOBS_BACKEND")
    if forced == "gloo":
        return "gloo", torch.device("cpu")
    if not torch.cuda.is_available():
        job = job_of(env, environ)
        allocated = job.allocated_gpus()
        if forced is None and allocated is None:
            return "gloo", torch.device("cpu")
        why = f"HPCJOBS_BACKEND={forced}" if forced is not None else f"{job.scheduler} allocated GPUs ({allocated})"
        raise RendezvousError(
            f"rank {env.rank} (local {env.local_rank}) on {os.uname().nodename}: {why} but CUDA is unavailable "
            f"to torch {torch.__version__} ({cuda_missing_reason()}); valid: a node where torch sees its GPUs. "
            "HINT: check nvidia-smi and the driver on that node against torch's CUDA build "
            f"({torch.version.cuda or 'none: a CPU-only torch'}); HPCJOBS_BACKEND=gloo runs on the CPU on purpose")
    return "nccl", torch.device("cuda", rank_gpu(env, torch.cuda.device_count()))


def rank_gpu(env: DistEnv, visible: int) -> int:
    """This rank's GPU among the `visible` ones: its local rank when every rank of the node sees every GPU, 0 when
    each rank sees only its own (Slurm's --gpus-per-task binding). Anything in between would put two ranks on one
    GPU, which NCCL refuses much later with a confusing error: say so now."""
    if visible == 1:
        return 0
    if visible >= env.local_world_size:
        return env.local_rank
    raise RendezvousError(
        f"rank {env.rank} (local {env.local_rank} of {env.local_world_size} on {os.uname().nodename}) sees "
        f"{visible} GPUs: valid: 1 per rank, or at least {env.local_world_size} (one per rank of the node). "
        "HINT: ask for as many GPUs per node as ranks per node (--gpus), or check CUDA_VISIBLE_DEVICES.")


def cpu_threads(env: DistEnv, usable: int | None = None) -> int:
    """Threads per rank, never more than the CPUs this process may run on (`usable`: its affinity mask): the
    scheduler's CPUs per task when it says (Slurm's: srun binds each task to them, or, under task/none, they are
    its share), else the mask shared among this node's ranks. More threads than CPUs only makes them take turns."""
    if usable is None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_task = job_of(env).cpus_per_task()
    if per_task is not None:
        return max(1, min(per_task, usable))
    return max(1, usable // max(1, env.local_world_size))  # a mask the node's ranks share (salloc -c, a cpuset)


@contextlib.contextmanager
def distributed(timeout_s: float | None = None, trace_prefix: Path | None = None,
                group_of_one: bool = False, cpu_collectives: bool = False,
                env: DistEnv | None = None, again: tuple[RunFolder, int] | None = None) -> Iterator[DistContext]:
    """Join the job's process group (if more than one rank, or `group_of_one`: FSDP2 needs one even alone) and
    always leave it, whatever happens inside. `trace_prefix`: where NCCL's flight recorder dumps
    (RUN/nccl-trace/rank-) unless the environment says. `cpu_collectives`: the default group also reduces CPU
    tensors (gloo beside NCCL), as FSDP2's CPU offload needs for the gradient norm of host-held shards. `env`: the
    launcher's (its job environment chosen at the start); read from os.environ where none is given. `again`: the
    run folder and generation of a group formed again after a rank's replacement (trainers.rejoin), whose store is
    that generation's own."""
    startup.mark(IMPORTED)  # torch, the trainer and the task are loaded: what is left is the rendezvous
    env = env or from_environ(os.environ)
    backend, device = pick_backend(env)
    if device.type == "cuda":
        allocator.configure()  # before set_device makes the allocator
        torch.cuda.set_device(device)
    torch.set_num_threads(cpu_threads(env))
    timeout_s = timeout_s or setting_seconds(INIT_TIMEOUT, os.environ)
    if backend == "nccl" and trace_prefix is not None:
        trace_prefix.parent.mkdir(parents=True, exist_ok=True)
        for name, value in flight_recorder_env(trace_prefix).items():
            os.environ.setdefault(name, value)
    ctx = DistContext(env, device, backend, timeout_s=timeout_s)
    if cpu_collectives and backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    if env.world_size > 1:
        try:
            where = {"store": rejoin.store(again[0], env, again[1], timeout_s)} if again and again[1] else \
                {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
            dist.init_process_group(backend, **where, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except Exception as e:  # noqa: BLE001 - torch raises several types (DistStoreError, RuntimeError, TimeoutError)
            raise RendezvousError(
                f"rank {env.rank}/{env.world_size} could not join the rendezvous at {env.master_addr}:"
                f"{env.master_port} within {timeout_s:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
                "HINT: check that every rank started, that MASTER_ADDR resolves from this node and the port is "
                f"free; {INIT_TIMEOUT[0]} sets the wait.") from None
        control_s = max(timeout_s, CONTROL_TIMEOUT_MIN_S)
        ctx.control_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_s))
        ctx.checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_s))
        if again:
            rejoin.joined(again[0], env, again[1])
    elif group_of_one:  # an in-process store: no port, no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        # Never the default group: on NCCL, a save thread's collectives would share the training's communicator.
        ctx.checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    startup.mark(JOINED)
    try:
        yield ctx
    except rejoin.PeerLost:
        rejoin.abort()  # NCCL's communicators wait on the dead peer: aborted, not destroyed
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def release_groups() -> None:
    """For a script whose model outlives `distributed()`: collect what still holds the process groups (FSDP's
    modules keep them in reference cycles) while the interpreter is whole. Left to the interpreter's shutdown, a gloo
    worker thread that drops the last reference to a finished collective's tensors can no longer take the GIL and
    aborts the process ('terminate called without an active exception', SIGABRT; about 1 exit in 4 on 2 cores). The
    launcher needs none of this: the trainer's model is a local of train(), and the collector is frozen at exit."""
    gc.collect()
