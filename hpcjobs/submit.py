"""The side effects of submission, one function each: write a script, submit through submitit, run locally,
record the job. Everything they need was decided by the pure spec and renderers before they are called."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcjobs.errors import RuntimeFailure, UsageError
from hpcjobs.render import launcher_argv, slurm_log_dir, submitit_parameters, submitit_python
from hpcjobs.runfolder import RunFolder
from hpcjobs.spec import JobSpec
from hpcjobs.store import JobRecord, JobStore


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: str
    logs: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None
    """For local runs, which finish before returning."""

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "run_dir": self.run_dir, "logs": self.logs, "returncode": self.returncode}


def write_script(text: str, path: Path, spec: JobSpec, force: bool = False) -> Path:
    """Write the rendered script (never over an existing file unless forced) and the folder Slurm logs into."""
    if path.exists() and not force:
        raise UsageError(f"{path} already exists; nothing was written.", "pass --force to overwrite, or -o NEW_FILE.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    Path(slurm_log_dir(spec)).mkdir(parents=True, exist_ok=True)
    return path


def _prepare_run_dir(spec: JobSpec, job_id: str = "%j") -> tuple[RunFolder, bool]:
    run = RunFolder(spec.run_dir.replace("%j", job_id))
    created = not run.path.exists()
    run.path.mkdir(parents=True, exist_ok=True)
    run.spec.write_text(json.dumps(spec.as_dict(), indent=2, sort_keys=True))
    return run, created


def submit_slurm(spec: JobSpec) -> Submitted:
    """Submit through submitit's Slurm executor; returns as soon as Slurm gave a job id."""
    import submitit
    from submitit.core.utils import FailedJobError

    from trainers.launch import SubmititEntry

    run, created = _prepare_run_dir(spec)
    argv = launcher_argv(spec)
    executor = submitit.SlurmExecutor(folder=run.path / "submitit", python=submitit_python(spec),
                                      max_num_timeout=10**6)
    executor.update_parameters(**submitit_parameters(spec))
    try:
        job = executor.submit(SubmititEntry(argv[argv.index("trainers.launch") + 1:]))
    except (FailedJobError, subprocess.CalledProcessError, OSError) as e:
        if created:
            shutil.rmtree(run.path, ignore_errors=True)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "sbatch" in ln.lower()] or \
            [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise RuntimeFailure(f"sbatch refused the job: {lines[-1] if lines else e}",
                             "check the profile's partition/account/qos against `sinfo -s` and `sacctmgr show assoc`."
                             ) from None
    logs = {"slurm": str(job.paths.stdout).replace("%t", "0"), "ranks": str(run.logs)}
    return Submitted(str(job.job_id), str(run.path), logs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_job_id() -> str:
    return f"local-{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}"


def run_local(spec: JobSpec, job_id: str) -> int:
    """Run every rank on this machine (the `local` scheduler) and wait; Ctrl-C stops all ranks at a checkpoint."""
    _prepare_run_dir(spec, job_id)
    base = {**os.environ, **spec.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(spec.ranks), "LOCAL_WORLD_SIZE": str(spec.ranks), "HPCJOBS_JOB_ID": job_id}
    for var in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_RESTART_COUNT"):
        base.pop(var, None)  # a local run inside an allocation must not pick up that job's identity
    procs = [subprocess.Popen(launcher_argv(spec), cwd=spec.workdir,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(spec.ranks)]
    stop_sig = getattr(signal, f"SIG{spec.profile.preemption.signal}")

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(stop_sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = _wait_all(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every rank; if one fails, stop the rest (like srun --kill-on-bad-exit)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.time() + 10
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def record(spec: JobSpec, sub: Submitted, store: JobStore | None = None) -> None:
    (store or JobStore()).add(JobRecord(
        job_id=sub.job_id, name=spec.name, profile=spec.profile.name, scheduler=spec.profile.scheduler,
        nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, run_dir=sub.run_dir, logs=sub.logs,
        spec=spec.as_dict(), submitted=time.time()))


def submit(spec: JobSpec) -> Submitted:
    """Submit (Slurm) or run (local: recorded first, so status/list see it while it runs) the job."""
    if spec.profile.scheduler == "local":
        job_id = local_job_id()
        run_dir = spec.run_dir.replace("%j", job_id)
        record(spec, Submitted(job_id, run_dir, {"ranks": str(RunFolder(run_dir).logs)}))
        print(f"hpcjobs: job {job_id}: running {spec.world()} locally; run folder {run_dir}", file=sys.stderr,
              flush=True)
        rc = run_local(spec, job_id)
        return Submitted(job_id, run_dir, {"ranks": str(RunFolder(run_dir).logs)}, rc)
    sub = submit_slurm(spec)
    record(spec, sub)
    return sub
