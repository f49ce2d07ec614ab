"""The Slurm backend: submission through submitit, state from squeue then sacct, cancel through scancel.

Its pure half is hpcjobs/backends/slurm/sbatch.py (the flags, the sbatch text, submitit's parameters); what the ranks
ask Slurm themselves (requeue, EndTime, PreemptTime) is in trainers/jobenv/slurm.py.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcjobs.backends import SchedulerFacts, Script, SubmitRequest, Submitted, Times
from hpcjobs.backends.common import (
    CONTROLLER_HINT,
    RunFolderLogs,
    Runner,
    check_run_folder,
    last_words,
    prepare_run_folder,
    run_command,
)
from hpcjobs.backends.slurm.exitcode import job_exit_code
from hpcjobs.backends.slurm.failed_nodes import slurm_facts
from hpcjobs.backends.slurm.fields import sacct_time, scontrol_fields
from hpcjobs.backends.slurm.sbatch import (
    ranks_step,
    recovering,
    render_sbatch,
    run_dir_of_comment,
    slurm_log_dir,
    submitit_parameters,
    submitit_python,
)
from hpcjobs.backends.start_env import cleaned_os_environ
from hpcjobs.jobs.store import JobRecord
from hpcjobs.profiles.slurmtime import format_time
from hpcjobs.protocol.errors import RuntimeFailure, UsageError
from hpcjobs.protocol.faultpolicy.diagnosis import Failure, read_text
from hpcjobs.protocol.faultpolicy.srunwords import srun_failures
from hpcjobs.protocol.runfolder import (
    TASK_INDEX,
    RunDirPatternError,
    RunFolder,
    array_ids,
    has_pattern,
    resolve_run_dir,
    split_task_id,
)
from hpcjobs.protocol.states import JobState
from hpcjobs.request.checks import Check
from hpcjobs.request.spec import JobSpec


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says of a job id: its state, and the run folder its comment names (None: not an hpcjobs job, or
    a comment sacct did not keep)."""

    state: JobState
    run_dir: str | None

    @classmethod
    def parse(cls, line: str) -> SlurmJob:
        """One `STATE|COMMENT` line of squeue or sacct."""
        state, _, comment = line.partition("|")
        return cls(JobState.parse(state), run_dir_of_comment(comment.strip()))


FORGOTTEN = "Invalid job id specified"
"""squeue's answer for an id Slurm does not know: never given, or forgotten after MinJobAge."""


NOT_CONFIGURED = "Could not establish a configuration source"
"""squeue's last words on a machine with Slurm's client tools but no slurm.conf (nor a configless DNS record): no
Slurm here, as when there is no squeue at all, so a local-only user's `status ID` is not told about Slurm."""


SLURM_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?", re.ASCII)
"""A job's id as Slurm gives it: a number, or an array task's ARRAY_INDEX."""


class SlurmUnreachable(RuntimeFailure):
    """squeue ran and could not answer (the controller down or unreachable): not the same as "no such job"."""


def parse_sacct(text: str) -> list[Times]:
    """`sacct -n -P -X -D -o Eligible,Start,End`: (eligible, start, end) per allocation, a requeued job's earlier
    ones included; those that never started are left out."""
    out = [tuple(sacct_time(f) for f in line.split("|")[:3]) for line in text.splitlines() if line.count("|") >= 2]
    return [t for t in out if t[1] is not None]  # type: ignore[misc]


def squeue_job(job_id: str, run: Runner) -> SlurmJob | None:
    """squeue's word for the job, finished ones included (`-t all`), while Slurm still remembers it; None when it
    knows no such job, or there is no squeue here. Raises SlurmUnreachable when squeue could not answer."""
    out = run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%k"])
    if out.returncode not in (0, 127) and FORGOTTEN not in out.stderr and NOT_CONFIGURED not in out.stderr:
        raise SlurmUnreachable(f"squeue could not answer for job {job_id}: {last_words(out)}", f"{CONTROLLER_HINT}; "
                               "the run folder still answers for a job hpcjobs recorded here")
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return SlurmJob.parse(lines[0]) if lines else None


def sacct_job(job_id: str, run: Runner) -> SlurmJob | None:
    """sacct's word for the job's allocation (the last line: the newest start); None without accounting. Its
    comment only where the site keeps comments (AccountingStoreFlags=job_comment)."""
    out = run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Comment"])
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return SlurmJob.parse(lines[-1]) if lines else None


def record_of(job_id: str, run_dir: str, spec: dict[str, Any], fields: dict[str, str]) -> JobRecord:
    """A job record for a job found by its comment: the run folder's spec.json (hpcjobs submit wrote it), else what
    Slurm still says of it (a rendered script run with sbatch)."""
    nodes = int(spec.get("nodes") or fields.get("NumNodes", "0").split("-")[0] or 0)
    tasks = int(fields.get("NumTasks", "0") or 0)
    gpus = int(spec.get("gpus_per_node") or (tasks // nodes if nodes else 0))
    submitted = fields.get("SubmitTime", "")
    when = datetime.datetime.fromisoformat(submitted).timestamp() if submitted[:1].isdigit() else 0.0
    logs = {"slurm": fields["StdOut"]} if fields.get("StdOut") else {}
    return JobRecord(job_id, str(spec.get("name") or fields.get("JobName") or "?"),
                     str(spec.get("profile") or "?"), "slurm", nodes, gpus, run_dir, logs, spec, when)


def sbatch_refusal(error: BaseException) -> str:
    """The lines of sbatch's complaint that say why (submitit wraps them in its own words), as one: the first
    names what was wrong (`invalid partition specified: nosuch`), the last that nothing was queued."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    said = [ln for ln in lines if "sbatch" in ln.lower()] or lines
    return "; ".join(dict.fromkeys(said)) if said else type(error).__name__


class SlurmBackend(RunFolderLogs):
    name = "slurm"
    multi_node = True
    queued = True
    requests_gpus = True
    runs_setup = True

    def __init__(self, runner: Runner = run_command) -> None:
        self.run = runner

    def check(self, spec: JobSpec) -> None:
        warn = spec.profile.preemption.seconds_before
        if spec.time_seconds <= warn:
            raise UsageError(f"{spec.time_from} {format_time(spec.time_seconds)} is not longer than the preemption "
                             f"warning ({warn} s) of profile {spec.profile.name}; valid: more than {warn} s.",
                             "ask for more time with --time" if spec.time_from == "--time" else
                             f"pass --time, or raise default_time in {spec.profile.source}.")

    def check_site(self, spec: JobSpec) -> None:
        """A partition the cluster does not have, refused before anything is written (sbatch refused it only after
        the run folder and the code snapshot were made). Where scontrol is not here or does not answer (a login
        node without Slurm's configuration, `render` on a laptop), nothing is said: sbatch says it there."""
        from hpcjobs.backends.slurm.preflight import records

        if not spec.partition or shutil.which("scontrol") is None:
            return
        out = self.run(["scontrol", "--all", "show", "partition", "-o"])  # hidden ones, and others' too
        known = records(out.stdout, "PartitionName") if out.returncode == 0 else {}
        unknown = [name for name in spec.partition.split(",") if name not in known]
        if known and unknown:
            given = (f"--partition {spec.partition}" if spec.partition != spec.profile.partition else
                     f"partition {spec.partition} of profile {spec.profile.name}")
            raise UsageError(f"{given}: the cluster has no partition {unknown[0]!r}; valid: {', '.join(known)}; "
                             "nothing was written.", "`sinfo -s` lists them: pick one with --partition NAME (or "
                             f"partition: in {spec.profile.source}).")

    def script(self, spec: JobSpec) -> Script:
        return Script(render_sbatch(spec), (slurm_log_dir(spec),))

    def dry_run(self, spec: JobSpec) -> SubmitRequest:
        return SubmitRequest(spec, render_sbatch(spec), {"submitit": submitit_parameters(spec)})

    def submit(self, request: SubmitRequest, on_id: Callable[[Submitted], None]) -> Submitted:
        """Queue the job through submitit's executor; returns once Slurm gave a job id. The run folder is made
        when its name is known: at once for a plain path, after sbatch answered for a pattern (`%j`)."""
        import submitit
        from submitit.core.utils import FailedJobError

        from hpcjobs.protocol.nodecall import NodeEntry, SupervisedStep

        spec = request.spec
        missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]  # submitit needs both, asks for srun
        if missing:
            raise RuntimeFailure(f"{' and '.join(missing)} not found on this machine's PATH: Slurm's client tools are "
                                 "not here, so nothing was queued.", "submit from the cluster's login node, or write "
                                 "the job with `hpcjobs render -o job.sbatch ...` and run `sbatch job.sbatch` there.")
        check_run_folder(spec.run_dir)
        created = False if has_pattern(spec.run_dir) else prepare_run_folder(spec, spec.run_dir)
        executor = submitit.SlurmExecutor(folder=submitit_folder(spec), python=submitit_python(spec),
                                          max_num_timeout=10**6)  # the restart cap is hpcjobs' (the contract)
        executor.update_parameters(**request.params["submitit"])
        # Recovered in the allocation: one call in the batch script that runs srun (SupervisedStep); else one for
        # every task, each picking its point on the node
        entry = SupervisedStep(ranks_step(spec)) if recovering(spec) else NodeEntry(launcher_args(spec))
        try:
            # sbatch would hand this shell's job identity to the new job. submitit prints a refusing sbatch's
            # stderr before it raises: the one line below says it, once.
            with cleaned_os_environ(), contextlib.redirect_stderr(io.StringIO()):
                jobs = executor.submit_array([entry] * len(spec.points)) if spec.array else [executor.submit(entry)]
        except (FailedJobError, subprocess.CalledProcessError, OSError) as e:
            if created:
                shutil.rmtree(spec.run_dir, ignore_errors=True)
            raise RuntimeFailure(f"sbatch refused the job: {sbatch_refusal(e)}",
                                 "check the profile's partition/account/qos against `sinfo -s` and "
                                 "`sacctmgr show assoc`.") from None
        subs = [self._submitted(spec, str(job.job_id), str(job.paths.stdout), i if spec.array else None, on_id)
                for i, job in enumerate(jobs)]
        if not spec.array:
            return subs[0]
        array_id, _ = split_task_id(subs[0].job_id)
        return Submitted(array_id, spec.run_dir, {"slurm": subs[0].logs["slurm"]}, tasks=tuple(subs))

    @staticmethod
    def _submitted(spec: JobSpec, job_id: str, stdout: str, task: int | None,
                   on_id: Callable[[Submitted], None]) -> Submitted:
        """One queued job (or array task) with its run folder made and recorded."""
        run_dir = resolve_run_dir(spec.run_dir, array_ids(job_id))
        sub = Submitted(job_id, run_dir, {"slurm": stdout.replace("%t", "0"), "ranks": str(RunFolder(run_dir).logs)},
                        task=task)
        if has_pattern(spec.run_dir):
            prepare_run_folder(spec, run_dir, task)
        on_id(sub)
        return sub

    def state(self, rec: JobRecord) -> tuple[JobState, str] | None:
        """squeue's, then sacct's state, when the job they know by this id is the record's: job ids start again at
        1 on a rebuilt cluster, so a job whose comment names another run folder (or, in squeue, none) is another
        job: UNKNOWN, saying so, and the run folder answers."""
        unreachable: SlurmUnreachable | None = None
        for source, ask in (("squeue", squeue_job), ("sacct", sacct_job)):
            try:
                job = ask(rec.job_id, self.run)
            except SlurmUnreachable as e:  # sacct may still answer: it asks the accounting daemon
                unreachable, job = e, None
            if job is None:
                continue
            said = f"{source} ({unreachable.message})" if unreachable else source
            if job.run_dir is None and source == "sacct":
                return job.state, said  # a site that keeps no comments: nothing to compare
            if job.run_dir is None or resolve_run_dir(job.run_dir, array_ids(rec.job_id)) != rec.run_dir:
                return JobState.UNKNOWN, (f"{source}'s job {rec.job_id} is another job (run folder "
                                          f"{job.run_dir or 'none named'}), not this record's")
            return job.state, said
        return (JobState.UNKNOWN, unreachable.message) if unreachable else None

    def lookup(self, job_id: str) -> JobRecord | None:
        """A job hpcjobs did not record here (submitted with plain sbatch from a rendered script, or from another
        login node, or the job store was lost): found by the run folder its comment names, read from its spec.
        Raises SlurmUnreachable when neither squeue nor sacct could say (not knowing is not "no such job")."""
        if not SLURM_JOB_ID.fullmatch(job_id):
            return None  # a local job's id, or a typo: nothing Slurm could know
        try:
            job = squeue_job(job_id, self.run)
        except SlurmUnreachable:
            job = sacct_job(job_id, self.run)
            if job is None:
                raise
        job = job or sacct_job(job_id, self.run)
        if job is None or job.run_dir is None:
            return None
        try:
            run_dir = resolve_run_dir(job.run_dir, array_ids(job_id))
        except RunDirPatternError:  # an array's own id: its tasks are the jobs
            return None
        spec = RunFolder(run_dir).read("spec")
        return record_of(job_id, run_dir, spec if isinstance(spec, dict) else {}, scontrol_fields(job_id, self.run))

    def reported_failures(self, rec: JobRecord) -> list[Failure]:
        """srun's lines about tasks that ended badly, from the batch script's output: one file for rendered scripts
        (--output), or submitit's pair (its stderr holds `srun: error: node2: task 3: Killed`)."""
        out = rec.logs.get("slurm")
        if not out:
            return []
        path = Path(out)
        paths = [path, path.with_suffix(".err")] if path.suffix == ".out" else [path]
        return [f for p in paths for f in srun_failures(read_text(p))]

    def exit_code(self, rec: JobRecord) -> int | None:
        """sacct's ExitCode, else the ranks' code in submitit's words (hpcjobs.backends.slurm.exitcode)."""
        return job_exit_code(rec, self.run)

    def scheduler_facts(self, rec: JobRecord) -> SchedulerFacts:
        """Slurm's restart count and the job's failed nodes (hpcjobs.backends.slurm.failed_nodes)."""
        return slurm_facts(rec.job_id, self.run)

    def allocations(self, rec: JobRecord, run: Runner | None = None) -> list[Times]:
        try:
            out = (run or self.run)(["sacct", "-n", "-P", "-X", "-D", "-j", rec.job_id, "-o", "Eligible,Start,End"])
        except OSError:
            return []
        return parse_sacct(out.stdout) if getattr(out, "returncode", 1) == 0 else []

    def cancel(self, rec: JobRecord) -> str:
        out = self.run(["scancel", rec.job_id])
        if out.returncode != 0:
            raise RuntimeFailure(f"scancel {rec.job_id} failed: {(out.stderr or out.stdout).strip()}",
                                 "check that the job is yours and Slurm answers (`squeue --me`).")
        return f"job {rec.job_id} cancelled"

    def doctor(self, spec: JobSpec, probe_wait_s: float | None = None) -> list[Check]:
        from hpcjobs.backends.slurm.preflight import doctor
        from hpcjobs.backends.slurm.probe import run_probe

        checks = doctor(spec, render_sbatch(spec), self.run)
        return checks + run_probe(spec, probe_wait_s) if probe_wait_s else checks


ARRAY_FOLDER = "array"
"""What stands for a task's index in the folder of an array's own files (submitit's batch script and logs)."""


def submitit_folder(spec: JobSpec) -> Path:
    """submitit's files: in the run folder, or for an array in one folder of its own beside the tasks' (submitit
    writes the array's script before it has a task index, so its folder cannot hold %a)."""
    return Path(spec.run_dir.replace(TASK_INDEX, ARRAY_FOLDER) if spec.array else spec.run_dir) / "submitit"


def launcher_args(spec: JobSpec) -> list[str]:
    """The launcher's own arguments (what follows `-m trainers.launch`): submitit runs the launcher in-process."""
    from hpcjobs.protocol.nodecall import LAUNCHER_MODULE
    from hpcjobs.request.render import launcher_argv

    argv = launcher_argv(spec)
    return argv[argv.index(LAUNCHER_MODULE) + 1:]


BACKEND = SlurmBackend()
