"""The Slurm backend: submission through submitit, state from squeue then sacct, cancel through scancel.

Its pure half is hpcjobs/backends/slurm_render.py (the flags, the sbatch text, submitit's parameters); what the ranks
ask Slurm themselves (requeue, EndTime, PreemptTime) is in hpcjobs/backends/slurm_control.py.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from hpcjobs.backends import Script, SubmitRequest, Submitted
from hpcjobs.backends.common import RunFolderLogs, Runner, check_run_folder, prepare_run_folder, run_command
from hpcjobs.backends.environment import cleaned_os_environ
from hpcjobs.backends.slurm_render import render_sbatch, slurm_log_dir, submitit_parameters, submitit_python
from hpcjobs.doctor import Check
from hpcjobs.errors import RuntimeFailure, UsageError
from hpcjobs.runfolder import RunFolder, has_pattern, resolve_run_dir
from hpcjobs.slurmtime import format_time
from hpcjobs.spec import JobSpec
from hpcjobs.states import JobState
from hpcjobs.store import JobRecord


def squeue_state(job_id: str, run: Runner) -> JobState | None:
    """squeue's word for the job, finished ones included (`-t all`), while Slurm still remembers it."""
    out = run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return JobState.parse(lines[0]) if lines else None


def sacct_state(job_id: str, run: Runner) -> JobState | None:
    """sacct's word for the job's allocation (the last line: the newest start); None without accounting."""
    out = run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return JobState.parse(lines[-1]) if lines else None


def sbatch_refusal(error: BaseException) -> str:
    """The line of sbatch's complaint that says why (submitit wraps it in its own words)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    said = [ln for ln in lines if "sbatch" in ln.lower()] or lines
    return said[-1] if said else type(error).__name__


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
            raise UsageError(f"--time {format_time(spec.time_seconds)} is not longer than the preemption warning "
                             f"({warn} s) of profile {spec.profile.name}.", "ask for more time.")

    def script(self, spec: JobSpec) -> Script:
        return Script(render_sbatch(spec), (slurm_log_dir(spec),))

    def dry_run(self, spec: JobSpec) -> SubmitRequest:
        return SubmitRequest(spec, render_sbatch(spec), {"submitit": submitit_parameters(spec)})

    def submit(self, request: SubmitRequest, on_id: Callable[[Submitted], None]) -> Submitted:
        """Queue the job through submitit's executor; returns once Slurm gave a job id. The run folder is made
        when its name is known: at once for a plain path, after sbatch answered for a pattern (`%j`)."""
        import submitit
        from submitit.core.utils import FailedJobError

        from trainers.launch import SubmititEntry

        spec = request.spec
        check_run_folder(spec.run_dir)
        created = False if has_pattern(spec.run_dir) else prepare_run_folder(spec, spec.run_dir)
        executor = submitit.SlurmExecutor(folder=Path(spec.run_dir) / "submitit", python=submitit_python(spec),
                                          max_num_timeout=10**6)  # the restart cap is hpcjobs' (the contract)
        executor.update_parameters(**request.params["submitit"])
        try:
            with cleaned_os_environ():  # sbatch would hand this shell's job identity to the new job
                job = executor.submit(SubmititEntry(launcher_args(spec)))
        except (FailedJobError, subprocess.CalledProcessError, OSError) as e:
            if created:
                shutil.rmtree(spec.run_dir, ignore_errors=True)
            raise RuntimeFailure(f"sbatch refused the job: {sbatch_refusal(e)}",
                                 "check the profile's partition/account/qos against `sinfo -s` and "
                                 "`sacctmgr show assoc`.") from None
        job_id = str(job.job_id)
        run_dir = resolve_run_dir(spec.run_dir, {"SLURM_JOB_ID": job_id})
        sub = Submitted(job_id, run_dir, {"slurm": str(job.paths.stdout).replace("%t", "0"),
                                          "ranks": str(RunFolder(run_dir).logs)})
        if has_pattern(spec.run_dir):
            prepare_run_folder(spec, run_dir)
        on_id(sub)
        return sub

    def state(self, rec: JobRecord) -> tuple[JobState, str] | None:
        for source, ask in (("squeue", squeue_state), ("sacct", sacct_state)):
            state = ask(rec.job_id, self.run)
            if state is not None:
                return state, source
        return None

    def cancel(self, rec: JobRecord) -> str:
        out = self.run(["scancel", rec.job_id])
        if out.returncode != 0:
            raise RuntimeFailure(f"scancel {rec.job_id} failed: {(out.stderr or out.stdout).strip()}",
                                 "check that the job is yours and Slurm answers (`squeue --me`).")
        return f"job {rec.job_id} cancelled"

    def doctor(self, spec: JobSpec, probe_wait_s: float | None = None) -> list[Check]:
        from hpcjobs.backends.slurm_doctor import doctor
        from hpcjobs.backends.slurm_probe import run_probe

        checks = doctor(spec, render_sbatch(spec), self.run)
        return checks + run_probe(spec, probe_wait_s) if probe_wait_s else checks


def launcher_args(spec: JobSpec) -> list[str]:
    """The launcher's own arguments (what follows `-m trainers.launch`): submitit runs the launcher in-process."""
    from hpcjobs.render import LAUNCHER_MODULE, launcher_argv

    argv = launcher_argv(spec)
    return argv[argv.index(LAUNCHER_MODULE) + 1:]


BACKEND = SlurmBackend()
