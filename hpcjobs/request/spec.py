"""A validated request (profile + flags) becomes one frozen JobSpec. Pure: no I/O beyond looking an entry up.

What the profile allows (nodes, GPUs, time, the nodes' Python) is hpcjobs.request.limits; the run folder's name and
its checks are hpcjobs.request.rundir.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.profiles.container import Image, resolve
from hpcjobs.profiles.slurmtime import format_time
from hpcjobs.protocol.access import GROUP, UMASK_VAR
from hpcjobs.protocol.contract import Recovery
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.points import Point, as_args
from hpcjobs.request.after import After, parse_all
from hpcjobs.request.commandkey import command_key
from hpcjobs.request.credentials import bare_names
from hpcjobs.request.entry import Entry, resolve_entry
from hpcjobs.request.gpu_fit import check_fits
from hpcjobs.request.limits import AFTER_SETUP, Capabilities, gpus_per_node, most_nodes, node_python, time_seconds
from hpcjobs.request.rank_settings import check_env_names, job_env
from hpcjobs.request.rundir import check_one_line, run_dir_for, snapshot_root
from hpcjobs.request.snapshot import Snapshot, plan
from hpcjobs.request.sweep import as_mapping, build_points, tasks_args
from hpcjobs.request.taskcheck import check_task_flags, check_trainer_args

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A job name, matched whole (fullmatch): `$` lets a final newline through, which would end the #SBATCH header."""


@dataclass(frozen=True)
class Request:
    """What the user typed, before validation against a profile."""

    entry: str
    args: tuple[str, ...] = ()
    module: bool = False
    nodes: int = 1
    gpus: int | None = None
    time: str | None = None
    name: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    run_dir: str | None = None
    env: tuple[str, ...] = ()
    sweep: tuple[str, ...] = ()
    """`--sweep KEY=V1,V2,...` flags (a grid)."""
    sweep_file: str | None = None
    max_parallel: int | None = None
    snapshot: bool = True
    """Run from a code snapshot (hpcjobs.request.snapshot) instead of the working tree."""
    after: tuple[str, ...] = ()
    """`--after ID[:ok|any|notok]` flags: the jobs this one waits for (hpcjobs.request.after)."""
    container: str | None = None
    """`--container IMAGE`: the image instead of the profile's container.image."""
    max_recoveries: int | None = None
    """`--max-recoveries N`: instead of the profile's recovery.max_recoveries."""
    spare_nodes: int | None = None
    """`--spare-nodes K`: instead of the profile's recovery.spare_nodes."""
    allow_secret_values: bool = False
    """`--allow-secret-values`: a credential-looking --env or env: value is written as given
    (hpcjobs.request.credentials)."""


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to render and submit one job. `run_dir` may hold `%j`, replaced by the Slurm job id."""

    name: str
    profile: ClusterProfile
    nodes: int
    gpus_per_node: int
    time_seconds: int
    entry: Entry
    run_dir: str
    workdir: str
    python: str
    partition: str | None
    account: str | None
    qos: str | None
    env: dict[str, str] = field(default_factory=dict)
    python_fallback: str | None = None
    """The Python tried on the node when `python` (found after the setup) cannot start the ranks: the one hpcjobs
    ran from, when the profile names none."""
    points: tuple[Point, ...] = ()
    """A sweep's points (hpcjobs.request.sweep): more than one makes the job an array, one task per point, each choosing
    its point on the node; a single point's flags are in `entry.args` already."""
    max_parallel: int | None = None
    """The most array tasks running at once (None: as many as the scheduler starts)."""
    snapshot: Snapshot | None = None
    """The code snapshot the ranks run from (`workdir` is inside it); None: the working tree."""
    time_from: str = "--time"
    """Where the time limit came from, for an error about it: --time, or the profile's default_time."""
    gpu_ranks: bool = True
    """Whether a rank is a GPU the scheduler allocates (the backend requests GPUs and the profile does not turn
    that off), or just a process: `world()` names them so."""
    after: tuple[After, ...] = ()
    """The jobs this one waits for, and on what (hpcjobs.request.after): Slurm's --dependency."""
    container: Image | None = None
    """The image every rank runs in (hpcjobs.profiles.container); None: the node's own system."""
    recovery: Recovery = field(default_factory=Recovery)
    """The profile's recovery settings with the job's flags (--max-recoveries, --spare-nodes): see
    trainers/recover.py."""
    secrets: tuple[str, ...] = ()
    """Variables every rank takes from the submitting shell's environment: only their names are ever written."""
    command: str = ""
    """The key of `hpcjobs submit`'s command (hpcjobs.request.commandkey), recorded to find its runs again; ""."""

    @property
    def array(self) -> bool:
        return len(self.points) > 1

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def time(self) -> str:
        return format_time(self.time_seconds)

    def world(self) -> str:
        unit = "GPU" if self.gpu_ranks else "rank"
        return (f"{self.nodes} node{'s' * (self.nodes != 1)} × {self.gpus_per_node} {unit}"
                f"{'s' * (self.gpus_per_node != 1)} = {self.ranks} rank{'s' * (self.ranks != 1)}")

    def as_dict(self, task: int | None = None) -> dict[str, object]:
        """The spec as recorded (spec.json, the job store); `task`: an array task's own copy, with its point."""
        point = self.points[task if task is not None else 0] if self.points else None
        return {
            "name": self.name, "profile": self.profile.name, "profile_source": self.profile.source,
            "scheduler": self.profile.scheduler, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
            "ranks": self.ranks, "time": self.time, "entry": {"kind": self.entry.kind, "target": self.entry.target,
                                                              "args": list(self.entry.args)},
            "run_dir": self.run_dir, "workdir": self.workdir, "python": self.python,
            "python_fallback": self.python_fallback, "partition": self.partition,
            "account": self.account, "qos": self.qos, "env": dict(self.env),
            "preemption": {"signal": self.profile.preemption.signal,
                           "seconds_before": self.profile.preemption.seconds_before,
                           "max_restarts": self.profile.preemption.max_restarts},
            "point": as_mapping(point) if point is not None and (task is not None or not self.array) else None,
            "array_task": task, "array_size": len(self.points) if self.array else None,
            "max_parallel": self.max_parallel,
            "snapshot": self.snapshot.as_dict() if self.snapshot else None,
            **({"after": [str(a) for a in self.after]} if self.after else {}),  # only then: spec.json as it was
            "container": self.container.as_dict() if self.container else None,
            **({"recovery": asdict(self.recovery)} if self.recovery != Recovery() else {}),
            **({"secrets": list(self.secrets)} if self.secrets else {}),  # names only, never a value
            **({"command": self.command} if self.command else {}),
        }


def _check_max_parallel(max_parallel: int | None, points: int) -> None:
    if max_parallel is None:
        return
    if max_parallel < 1:
        raise UsageError(f"--max-parallel {max_parallel}: valid: 1 or more.", "e.g. --max-parallel 2")
    if points < 2:
        raise UsageError(f"--max-parallel {max_parallel} without a sweep of two or more points; valid: with --sweep "
                         "or --sweep-file.", "e.g. --sweep lr=1e-3,3e-4 --max-parallel 1")


def default_name(entry: Entry) -> str:
    base = entry.target.split(":")[0]
    base = Path(base).stem if entry.kind == "script" else base.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]", "-", base)[:64] or "job"


def _entry_and_points(profile: ClusterProfile, req: Request, caps: Capabilities, workdir: Path,
                      gpus: int) -> tuple[Entry, tuple[Point, ...]]:
    """The entry and the sweep's points; a task's arguments at each point checked as the node would check them."""
    entry = resolve_entry(req.entry, req.args, req.module, workdir)
    points = tuple(build_points(req.sweep, req.sweep_file, entry.args))
    _check_max_parallel(req.max_parallel, len(points))
    if len(points) == 1:  # a sweep of one point is an ordinary job with the point's flags
        entry = replace(entry, args=(*entry.args, *as_args(points[0])))
    if entry.kind == "task":
        for args in tasks_args(entry.args, points):
            check_trainer_args(args, req.nodes * gpus, entry.target)
            check_task_flags(entry.target, args, node_python(profile, caps))
            check_fits(profile, entry.target, args, req.nodes, gpus, most_nodes(profile, caps))
    return entry, points


def _job_name(req: Request, entry: Entry) -> str:
    name = req.name or default_name(entry)
    if not _NAME.fullmatch(name):
        raise UsageError(f"--name {name!r}: valid: 1-64 letters, digits, '_', '.', '-', starting with a letter "
                         "or digit.", "e.g. --name gpt-small")
    return name


def _recovery(profile: ClusterProfile, req: Request, nodes_allowed: int | None) -> Recovery:
    """The profile's recovery settings with the job's flags, each checked against the key's range."""
    given = {"max_recoveries": req.max_recoveries, "spare_nodes": req.spare_nodes}
    for name, value in given.items():
        f = next(f for f in fields(Recovery) if f.name == name)
        flag = "--" + name.replace("_", "-")
        if value is not None and not f.metadata["min"] <= value <= f.metadata["max"]:
            raise UsageError(f"{flag} {value}: valid: {f.metadata['min']} to {f.metadata['max']}.",
                             f"e.g. {flag} {max(f.metadata['min'], 1)}")
    recovery = replace(profile.recovery, **{k: v for k, v in given.items() if v is not None})
    if recovery.spare_nodes and nodes_allowed is not None and req.nodes + recovery.spare_nodes > nodes_allowed:
        raise UsageError(f"--nodes {req.nodes} with {recovery.spare_nodes} spare node(s) asks for "
                         f"{req.nodes + recovery.spare_nodes} nodes; valid: at most {nodes_allowed} in all.",
                         "ask for fewer spare nodes, or fewer nodes.")
    return recovery


def build_spec(profile: ClusterProfile, req: Request, caps: Capabilities, *, workdir: Path | None = None,
               stamp: str | None = None, job_id_in_run_dir: bool = False,
               same_command: Callable[[str, str], str | None] | None = None) -> JobSpec:
    """Validate the request against the profile and freeze it. `caps`: the profile's backend, whose own `check`
    the caller runs on the spec. `stamp` makes the run folder unique. `same_command` (submit's): given the command's
    key and the entry's kind, the run folder to continue (hpcjobs.follow.samecommand), asked when no --run-dir is
    given; with it a job that is not a sweep records its key."""
    workdir = workdir or Path.cwd()
    gpus = gpus_per_node(profile, req, caps)
    time_s = time_seconds(profile, req)
    entry, points = _entry_and_points(profile, req, caps, workdir, gpus)
    name = _job_name(req, entry)
    env = job_env(profile.env, profile.nccl, req.env, req.allow_secret_values)
    secrets = secret_names(profile, req)
    env = {**env, UMASK_VAR: f"{GROUP:03o}"} if profile.group else env  # each rank's umask (protocol.access)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid() % 10000:04d}"
    command = command_key(profile, entry, req.nodes, gpus, workdir, req.env, req.container) \
        if same_command and not (req.sweep or req.sweep_file) else ""
    if command and same_command and not req.run_dir and (found := same_command(command, entry.kind)):
        req = replace(req, run_dir=found)
    run_dir = run_dir_for(profile, req, workdir, name, stamp, len(points), job_id_in_run_dir)
    snapshot = plan(workdir, snapshot_root(run_dir)) if req.snapshot else None
    if snapshot is not None and entry.kind == "script":
        entry = replace(entry, target=snapshot.where(entry.target))
    for flag, value, example in (("--partition", req.partition, "gpu"), ("--account", req.account, "my-project"),
                                 ("--qos", req.qos, "normal")):
        check_one_line(flag, value, f"e.g. {flag} {example}")
    python = node_python(profile, caps)
    where = snapshot.where(str(workdir)) if snapshot else str(workdir)
    image = resolve(profile.container, req.container, gpus, [str(snapshot_root(run_dir)), where], where)
    return JobSpec(
        name=name, profile=profile, nodes=req.nodes, gpus_per_node=gpus, time_seconds=time_s, entry=entry,
        time_from="--time" if req.time is not None else f"the default_time of profile {profile.name}",
        run_dir=run_dir, workdir=where, python=python, container=image,
        python_fallback=sys.executable if python == AFTER_SETUP and not profile.python and not image else None,
        partition=req.partition or profile.partition, account=req.account or profile.account,
        qos=req.qos or profile.qos, env=env, points=points, max_parallel=req.max_parallel, snapshot=snapshot,
        gpu_ranks=caps.requests_gpus and profile.gpu_request != "none", after=parse_all(req.after),
        recovery=_recovery(profile, req, most_nodes(profile, caps)), secrets=secrets, command=command,
    )


def secret_names(profile: ClusterProfile, req: Request) -> tuple[str, ...]:
    """The profile's secrets and the --env NAME flags, once each, in order; checked as any rank's variable."""
    names = tuple(dict.fromkeys((*profile.secrets, *bare_names(req.env))))
    check_env_names(dict.fromkeys(names, ""), "--env or secrets:")
    return names
