"""A rank of a Slurm job: who it is (srun's task variables, unless a launcher inside the job set torch's), when it
must stop (SLURM_JOB_END_TIME, `scontrol show job -o`: EndTime, and why a SIGTERM came), how it requeues
(`scontrol requeue`), and what Slurm gave its node (GPUs, CPUs per task). The only module of the node side that
reads Slurm's variables or runs scontrol. Torch-free; every function that runs scontrol takes the command runner
(`subprocess.run` by default) so that tests can feed it recorded `scontrol` output.

The node side (trainers.preemption) asks scontrol from rank 0 after a stop was agreed, never from a signal handler.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcjobs.protocol.atomic import write_atomic
from hpcjobs.protocol.contract import REQUEUE_FILE_VAR
from trainers.jobenv import single, torchrun
from trainers.jobenv.base import JobEnv, JobEnvError, Layout, Runner, whole_number

SCONTROL_TIMEOUT_S = 60
"""A busy slurmctld answers slowly; a rank waiting on it only delays its own exit, never a collective."""


def job_id_of(job_id: str) -> str | None:
    """The id as scontrol wants it, or None when it is no Slurm job id (a local run's `local-…`, torchrun's)."""
    return job_id if job_id.isdigit() else None


def parse_show_job(text: str) -> dict[str, str]:
    """One `scontrol show job -o` line as a mapping (JobState, PreemptTime, EndTime, ...). Values with spaces
    (Command=, WorkDir= with a blank) come out cut at the first space; none of the fields read here has one."""
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def job_fields(job_id: str, runner: Runner = subprocess.run) -> dict[str, str]:
    """`scontrol show job -o ID` as a mapping; empty when Slurm cannot be asked (no scontrol, no answer)."""
    if job_id_of(job_id) is None:
        return {}
    try:
        out = runner(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                     timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_show_job(out.stdout or "")


ENDED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                          "TIMEOUT"})
"""A job's states once it ended for good (PREEMPTED is not among them: a requeue may follow)."""


def job_alive(job_id: str, runner: Runner = subprocess.run) -> bool | None:
    """Whether Slurm still has job `job_id` (`57` or an array task's `57_1`) in any state but an ended one; False
    too once Slurm forgot it ("Invalid job id": MinJobAge after its end); None where Slurm cannot be asked or the id
    is no Slurm job's (hpcjobs.protocol.tiersweep's stale tier folders)."""
    if not job_id.replace("_", "", 1).isdigit() or job_id.startswith("_") or job_id.endswith("_"):
        return None
    try:
        out = runner(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                     timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = parse_show_job(out.stdout or "").get("JobState")
    if state:
        return state not in ENDED_STATES
    return False if "invalid job id" in str(out.stderr or "").lower() else None


def end_time(fields: dict[str, str]) -> float | None:
    """`EndTime` of `scontrol show job` (local time) as epoch seconds; None when absent or not a time
    (`Unknown` for a pending job)."""
    try:
        return time.mktime(time.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def preempted_with_sigterm(job_id: str, runner: Runner = subprocess.run) -> bool:
    """A SIGTERM while the job is still RUNNING with a PreemptTime is a preemption's GraceTime warning (measured on
    22.05). Slurm requeues such a job only if it is still running when the grace ends: a job that saved and exited
    0 in time would end COMPLETED and never come back, so it must requeue itself. A `scancel` (CANCELLED), the
    time limit (TIMEOUT) or an outside `scontrol requeue` change the state before the signal is sent."""
    fields = job_fields(job_id, runner)
    return fields.get("JobState") == "RUNNING" and fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def requeue_job(job_id: str, runner: Runner = subprocess.run) -> str:
    """Ask Slurm to requeue this job (rank 0 only); returns Slurm's message, empty when it worked or when Slurm is
    already requeuing it (preemption, `scontrol requeue` from outside: the job is no longer RUNNING)."""
    if job_id_of(job_id) is None:
        return f"no Slurm job id ({job_id!r}) to requeue"
    try:
        out = runner(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if out.returncode == 0:
        return ""
    state = job_fields(job_id, runner).get("JobState", "")
    if state and state != "RUNNING":
        return ""
    return (out.stderr or out.stdout or "").strip() or f"scontrol requeue exited {out.returncode}"


BAD_NODE_STATES = ("down", "drain", "drng", "fail", "maint", "unk", "npc", "boot", "futr")
"""`sinfo -o %t`'s short states of a node that must not run a rank again (a trailing `*`: not responding)."""


def unhealthy_nodes(nodes: list[str], runner: Runner = subprocess.run) -> dict[str, str]:
    """Which of `nodes` Slurm says are down, draining, failed or not responding, with its reason (`sinfo -R`'s
    words, or the state); empty when Slurm cannot be asked (the recovery then trusts every node)."""
    if not nodes:
        return {}
    try:
        out = runner(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%t|%E"], capture_output=True, text=True,
                     timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    bad = {}
    for line in (out.stdout or "").splitlines():
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        if state.endswith("*") or state.rstrip("*~#!%$@^-").startswith(BAD_NODE_STATES):
            # sinfo's `*` (no answer from its slurmd) said in words: "mix*" meant nothing to a user in the log
            said, reason = "not responding" if state.endswith("*") else state, reason.strip()
            bad[node.strip()] = f"{said} ({reason})" if reason.lower() not in ("", "none", said) else said
    return bad


def stated_end_env(job_id: str, env: Mapping[str, str], fallback: float | None,
                   runner: Runner = subprocess.run) -> dict[str, str]:
    """SLURM_JOB_END_TIME for a step the recovery starts, where Slurm set none in `env` (22.05): `scontrol`'s
    EndTime, else `fallback`; {} where it is set or nothing is known (SlurmJobEnv.stated_end reads it in the
    ranks)."""
    if env.get("SLURM_JOB_END_TIME"):
        return {}
    end = end_time(job_fields(job_id, runner)) or fallback
    return {"SLURM_JOB_END_TIME": str(int(end))} if end else {}


def allocation(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """The job's id and its nodes, in the batch step (trainers/recover.py)."""
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    return env.get("SLURM_JOB_ID", ""), expand_nodelist(nodelist) if nodelist else []


def step_again(argv: list[str], nodes: set[str]) -> list[str]:
    """The ranks' `srun` command line for a step after a failed one, with `nodes` left out. `--overlap`: a step
    with ranks on a node that died stays RUNNING for slurmctld, holding its CPUs and memory on the nodes that live,
    and a new step there waits for ever ("Requested nodes are busy", seen on 22.05 with --no-kill); its processes
    are gone, so nothing really shares them."""
    if not argv or Path(argv[0]).name != "srun":
        return argv
    return [argv[0], "--overlap", *([f"--exclude={','.join(sorted(nodes))}"] if nodes else []), *argv[1:]]


def on_each_node(nodes: Sequence[str], command: list[str]) -> list[str]:
    """`command` once on each of `nodes`, as a step of the running job (`--overlap`: beside a step that still holds
    them, step_again says why)."""
    return ["srun", "--overlap", f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=0", *command]


def requeue_excluding(job_id: str, nodes: list[str], runner: Runner = subprocess.run) -> str:
    """Requeue the job with `nodes` left out of its next allocation (`scontrol update ExcNodeList`, then
    `scontrol requeue`); returns Slurm's complaint, empty when it worked."""
    if nodes:
        try:
            runner(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], capture_output=True,
                   text=True, timeout=SCONTROL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
    return requeue_job(job_id, runner)


GPU_ALLOCATION_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
"""What Slurm sets on a node when it gave the job GPUs there (the first that is set and not 0 says so)."""


CLIENT_SETTINGS = ("SLURM_CONF",)
"""Slurm variables that configure its commands, not a job: a local run on a host that sets them is no Slurm job
(the local backend keeps them too, hpcjobs.backends.start_env)."""


def applies(env: Mapping[str, str]) -> bool:
    """Any of a job's Slurm variables is set: a rank of a Slurm job, or a process inside an allocation (an `salloc`
    shell). Each fact below is read from its own variable, as it was before this seam: a variable alone (a test's
    SLURM_RESTART_COUNT) still counts, and only SLURM_JOB_ID makes the job Slurm's to requeue."""
    return any(name.startswith("SLURM_") and name not in CLIENT_SETTINGS for name in env)


def srun_task(env: Mapping[str, str]) -> bool:
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM_JOB_NODELIST's hosts in order (python-hostlist, a kept parser: padded and unpadded ranges). Imported
    here, not with the module: a rank that is not a Slurm task (the local profile, a bare GPU machine whose image
    lacks the package) never needs it."""
    import hostlist

    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise JobEnvError(f"cannot expand node list {nodelist!r}: {e}") from None
    if not hosts:
        raise JobEnvError(f"node list {nodelist!r} names no host")
    return hosts


class SlurmJobEnv(JobEnv):
    name = "slurm"
    scheduler = "Slurm"

    def _launcher(self) -> JobEnv:
        """What the process would be without Slurm: ranks a launcher inside the job started, or a single one."""
        return torchrun.Launched(self.env) if torchrun.applies(self.env) else single.Single(self.env)

    def _srun_layout(self) -> bool:
        """One task per rank under srun, and no launcher inside the job set torch's variables (theirs win)."""
        return srun_task(self.env) and not torchrun.applies(self.env)

    def layout(self) -> Layout:
        if not self._srun_layout():
            return self._launcher().layout()
        env = self.env
        rank, world = whole_number(env, "SLURM_PROCID"), whole_number(env, "SLURM_NTASKS")
        local_rank = whole_number(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        nnodes = whole_number(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
        return Layout(rank, local_rank, world, world // nnodes if nnodes else world, "slurm")

    def own_id(self) -> str:
        return self.env.get("SLURM_JOB_ID") or self._launcher().own_id()

    def job_id(self) -> str:
        """An array task's records name it as the login node knows it (the job store, `status 57_1`): its own
        number (SLURM_JOB_ID, 59) is known only here, and once Slurm forgot the job nothing could join the two."""
        array, task = self.env.get("SLURM_ARRAY_JOB_ID"), self.env.get("SLURM_ARRAY_TASK_ID")
        return f"{array}_{task}" if self.env.get("SLURM_JOB_ID") and array and task else self.own_id()

    def restart(self) -> int:
        """This start's number: HPCJOBS_RESTART, which the batch script sets before each step (trainers/recover.py:
        it counts requeues and recoveries in the allocation together), else Slurm's requeue count."""
        return int(self.env.get("HPCJOBS_RESTART") or self.env.get("SLURM_RESTART_COUNT") or 0)

    def requeues(self) -> int:
        return int(self.env.get("SLURM_RESTART_COUNT") or 0)

    def first_host(self) -> str | None:
        """The first host of SLURM_JOB_NODELIST, for ranks srun started (a launcher sets MASTER_ADDR itself)."""
        nodelist = self.env.get("SLURM_JOB_NODELIST")
        return expand_nodelist(nodelist)[0] if nodelist and self._srun_layout() else None

    def scheduler_job_id(self) -> str:
        return self.env.get("SLURM_JOB_ID", "")

    def stated_end(self) -> int | None:
        """SLURM_JOB_END_TIME, which newer Slurm sets (22.05 does not)."""
        end = self.env.get("SLURM_JOB_END_TIME", "")
        return int(end) if end.isdigit() else None

    def end_time_now(self, runner: Runner = subprocess.run) -> float | None:
        """EndTime of `scontrol show job`: a limit extended since the start (`scontrol update`) moved it."""
        return end_time(job_fields(self.scheduler_job_id(), runner))

    def preempted_with_sigterm(self, runner: Runner = subprocess.run) -> bool:
        return preempted_with_sigterm(self.scheduler_job_id(), runner)

    def requeue(self, runner: Runner = subprocess.run) -> str:
        """scontrol requeue; inside a container image (no Slurm client), the batch script outside it requeues once
        the ranks left: rank 0 only writes `requeue` into the file the script named."""
        handoff = self.env.get(REQUEUE_FILE_VAR)
        if handoff:
            try:
                write_atomic(Path(handoff), "requeue\n")
            except OSError as e:
                return f"cannot ask the batch script for a requeue through {handoff}: {e.strerror or e}"
            return ""
        return requeue_job(self.scheduler_job_id(), runner)

    def allocated_gpus(self) -> str | None:
        for name in GPU_ALLOCATION_VARS:
            value = self.env.get(name, "").strip()
            if value and value != "0":
                return f"{name}={value}"
        return None

    def cpus_per_task(self) -> int | None:
        """SLURM_CPUS_PER_TASK: srun binds each task to them, or, under task/none, they are its share."""
        per_task = self.env.get("SLURM_CPUS_PER_TASK")
        return int(per_task) if per_task and per_task.isdigit() else None


ENVIRONMENT = SlurmJobEnv
"""The class hpcjobs.protocol.schedulers.JOB_ENVIRONMENTS names this module for."""
