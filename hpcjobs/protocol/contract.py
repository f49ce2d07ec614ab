"""The launch contract: the one typed object the submit side hands every rank, and the only place its defaults live.

The renderers write it once (`--contract JSON` on the launcher's command line, the same on every path: rendered
sbatch, submitit, local). The launcher reads it once, resolves the run folder from the job's ids, stamps its start
time and exports it as $HPCJOBS_CONTRACT, where everything else on the node (the preemption protocol, `StopGuard`
in a user's own script) reads it when it needs it, never at import time. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.points import Point, point_of
from hpcjobs.protocol.runfolder import resolve_run_dir

DEFAULT_SIGNAL = "USR2"
SIGNALS = ("USR1", DEFAULT_SIGNAL, "TERM", "INT", "HUP", "URG")
"""Signals a profile may ask Slurm to send before it stops a job (`--signal`)."""
EARLY_SIGNAL_S = 75
"""How long before it is due the profile's signal may come and still mean the time limit: Slurm checks limits on
its event resolution (up to a minute; 30 s measured on 22.05), so the signal comes early rather than late."""
ENV_VAR = "HPCJOBS_CONTRACT"
"""Where the launcher leaves the resolved contract for the rest of the rank (and its child processes)."""
REQUEUE_FILE_VAR = "HPCJOBS_REQUEUE_FILE"
"""Set by a batch script whose ranks run inside a container image (no Slurm client there): the file rank 0 writes
`requeue` into instead of running scontrol; the script, outside the image, requeues once srun returned
(hpcjobs/backends/slurm/runtimes.py)."""
RUN_DIR_VAR = "HPCJOBS_RUN_DIR"
"""The rank's run folder, resolved (%j and the like filled in), for a user's script to read: a place for its own
outputs that a requeue finds again. Written beside the contract, never read by hpcjobs (the contract holds it)."""


class ContractError(StartRefused, ValueError):
    """A contract that cannot be read: the submit and node sides disagree (e.g. different hpcjobs versions)."""


@dataclass(frozen=True)
class Preemption:
    """What happens when Slurm is about to stop the job (preemption or the time limit). The field metadata are the
    profile's constraints on the `preemption:` keys (see hpcjobs.profiles.cluster_profile)."""

    signal: str = field(default=DEFAULT_SIGNAL, metadata={"choices": SIGNALS})
    """The signal Slurm sends before stopping the job (`--signal`); the trainer also always handles SIGTERM."""
    seconds_before: int = field(default=90, metadata={"min": 10, "max": 3600})
    """How many seconds before the end (time limit) Slurm sends `signal`; must leave time to save a checkpoint."""
    max_restarts: int = field(default=10, metadata={"min": 0, "max": 10_000})
    """How many requeues in a row (preemption, time limit) may bring no newer checkpoint before the job ends failed
    (one line naming the cause that repeats). A job that commits a newer checkpoint between stops goes on however
    often it is requeued (a long run in time-limit chunks); a script that saves only on its own shows no progress to
    hpcjobs, so each of its requeues counts."""


@dataclass(frozen=True)
class Recovery:
    """What the job does by itself when a rank or node fails and it is nobody's bug
    (hpcjobs.protocol.faultpolicy.kinds): its ranks start again, as a new step of the same allocation, from the newest
    finished checkpoint (trainers/recover.py). The field metadata are the profile's constraints on the `recovery:`
    keys."""

    max_recoveries: int = field(default=3, metadata={"min": 0, "max": 1000})
    """How many recoveries in a row, with no new checkpoint between them, a job may have before it ends failed (one
    line naming the cause that repeats); 0 turns recovery off. A job that checkpoints between faults goes on."""
    spare_nodes: int = field(default=0, metadata={"min": 0, "max": 64})
    """Extra nodes the job holds to stand in for one that fails (`--spare-nodes`); they run no rank until then."""
    hang_min_s: int = field(default=10, metadata={"min": 5, "max": 86_400})
    """The least time without step progress that counts as a hang, once three step times are measured; the bound
    grows with the measured step time (20 × the median) and with a checkpoint in flight (trainers/hangbound.py).
    10 s: a hang is found in seconds, far below the collective timeout (it was 300 s, issue 40)."""


@dataclass(frozen=True)
class LaunchContract:
    """What every rank must know about its job that Slurm's environment does not say."""

    run_dir: str
    """The run folder; before `started()` it may hold `%j`, `%A`, `%a` (see
    hpcjobs.protocol.runfolder.resolve_run_dir)."""
    preemption: Preemption = field(default_factory=Preemption)
    """Signal, warning seconds and restart cap, from the profile."""
    recovery: Recovery = field(default_factory=Recovery)
    """The recovery cap, spare nodes and the hang bound's floor, from the profile and the job's flags."""
    time_limit_s: int = 0
    """The job's time limit in seconds (0: none known, e.g. a local run or a plain torchrun)."""
    start_time: float = 0.0
    """When this start of the job began on the rank (epoch seconds; set by the launcher)."""
    points: tuple[Point, ...] = ()
    """A sweep's points, one per array task (hpcjobs.request.sweep); each task adds its own to the entry's arguments."""
    submit_dir: str = ""
    """The folder a user's script or module was submitted from, when its code runs from a snapshot (empty
    otherwise): the script runs there, so a relative path it is given (an --output_dir, its data) means what it
    meant at the submit, while its code stays the snapshot's (trainers.launch.run_entry)."""

    def to_json(self) -> str:
        data = asdict(self)
        if not data["points"]:  # not a sweep: the contract reads as it did before sweeps
            del data["points"]
        if not data["submit_dir"]:  # no snapshot, or the shared trainer: as before
            del data["submit_dir"]
        if self.recovery == Recovery():  # the defaults: the nodes know them
            del data["recovery"]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LaunchContract:
        try:
            data = json.loads(text)
            pre = Preemption(**data.pop("preemption", {}))
            recovery = Recovery(**data.pop("recovery", {}))
            points = tuple(tuple((str(k), str(v)) for k, v in point) for point in data.pop("points", ()))
            contract = cls(preemption=pre, recovery=recovery, points=points, **data)
        except (ValueError, TypeError) as e:
            raise ContractError(f"the launch contract {text[:200]!r} cannot be read ({e}); the nodes may run "
                                "another hpcjobs version than the one that submitted the job") from None
        if not isinstance(contract.run_dir, str) or not contract.run_dir:
            raise ContractError(f"the launch contract names no run folder: {text[:200]!r}")
        return contract

    def point(self, env: Mapping[str, str]) -> Point | None:
        """This array task's point (None outside a sweep). Raises ContractError."""
        try:
            return point_of(self.points, env)
        except ValueError as e:
            raise ContractError(str(e)) from None

    def started(self, env: Mapping[str, str], now: float) -> LaunchContract:
        """This rank's copy: the run folder resolved from the job's ids, the start time stamped."""
        return replace(self, run_dir=resolve_run_dir(self.run_dir, env), start_time=now)

    def export(self, environ: Any = None) -> None:
        environ = os.environ if environ is None else environ
        environ[ENV_VAR] = self.to_json()
        environ[RUN_DIR_VAR] = self.run_dir

    @classmethod
    def current(cls, environ: Mapping[str, str] | None = None) -> LaunchContract | None:
        """The contract the launcher exported for this rank; None outside a launched rank (a plain script)."""
        text = (os.environ if environ is None else environ).get(ENV_VAR)
        return cls.from_json(text) if text else None

    def job_end(self, stated_end: int | None) -> int | None:
        """When the scheduler ends this start of the job (epoch seconds): `stated_end` where the rank's environment
        says it (trainers.jobenv: SLURM_JOB_END_TIME on newer Slurm), else the start time plus the time limit (late
        by the job script's own work before it launched this rank's process: the start time is that process's, see
        trainers.startup.launched_at)."""
        if stated_end is not None:
            return stated_end
        if self.start_time and self.time_limit_s > 0:  # local runs too: their --time is enforced as Slurm does
            return int(self.start_time) + self.time_limit_s
        return None

    def signal_due(self, stated_end: int | None) -> float | None:
        """When the profile's signal is due at the latest (`seconds_before` the end); None without a time limit.
        `stated_end`: as for `job_end` (a rank asks trainers.jobenv's `signal_due`, which passes it)."""
        end = self.job_end(stated_end)
        return None if end is None else float(end - self.preemption.seconds_before)
