"""The local backend: every rank a process on this machine, in the foreground (CPU + gloo without GPUs).

Ctrl-C (or SIGTERM) is forwarded to the ranks as the profile's stop signal, so they stop at a step boundary after a
checkpoint, as on a cluster; running the same command with the same --run-dir resumes.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcjobs.backends import Script, SubmitRequest, Submitted
from hpcjobs.backends.common import RunFolderLogs, check_run_folder, prepare_run_folder
from hpcjobs.backends.environment import clean
from hpcjobs.doctor import Check, Result
from hpcjobs.errors import UsageError
from hpcjobs.ports import free_port
from hpcjobs.render import launcher_argv
from hpcjobs.runfolder import RunFolder, resolve_run_dir, write_json_atomic
from hpcjobs.spec import JobSpec
from hpcjobs.states import JobState
from hpcjobs.store import JobRecord

JOB_ID_PLACEHOLDER = "local-<id>"
"""How a dry run names the job id that only a real run gets."""


def local_job_id() -> str:
    return f"local-{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}"


def rank_envs(spec: JobSpec, job_id: str, port: int, base: dict[str, str]) -> list[dict[str, str]]:
    """Each rank's environment: this shell's without any job's identity, the profile's, and the rendezvous."""
    common = {**clean(base), **spec.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(spec.ranks), "LOCAL_WORLD_SIZE": str(spec.ranks), "HPCJOBS_JOB_ID": job_id}
    return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(spec.ranks)]


def describe(spec: JobSpec, job_id: str) -> str:
    """The request as text: what each rank would run, with the variables hpcjobs sets for it."""
    argv = " ".join(shlex.quote(w) for w in launcher_argv(spec))
    lines = [f"# local: {spec.world()} on this machine, from {spec.workdir}"]
    lines += [f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())]
    for r in range(spec.ranks):
        lines.append(f"RANK={r} LOCAL_RANK={r} WORLD_SIZE={spec.ranks} MASTER_ADDR=127.0.0.1 MASTER_PORT=<free> "
                     f"HPCJOBS_JOB_ID={job_id} {argv}")
    return "\n".join(lines) + "\n"


def wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
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


class Stopper:
    """Ctrl-C (or SIGTERM, `hpcjobs cancel`) asks every rank to stop at the next step boundary after a checkpoint;
    a second one says that is under way; a third kills the ranks at once (the last checkpoint stays)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], stop_signal: int) -> None:
        self.procs, self.stop_signal, self.count = procs, stop_signal, 0

    def on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            self._send(self.stop_signal)
            note = "stopping: every rank commits a checkpoint at the next step, then exits"
        elif self.count == 2:
            note = "still stopping (saving a checkpoint); press Ctrl-C once more to kill the ranks now"
        else:
            self._send(signal.SIGKILL)
            note = "killed the ranks; the newest finished checkpoint is kept"
        os.write(2, f"\nhpcjobs: {note}\n".encode())  # os.write: no buffered I/O inside a signal handler

    def _send(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)


def _rank_preexec() -> None:
    """In each rank, before exec: a process group of its own (see LocalBackend._run), and if the launching process
    dies (SIGKILL), SIGTERM, so the rank stops at a checkpoint instead of training on as an orphan."""
    import ctypes

    os.setpgid(0, 0)
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class LocalBackend(RunFolderLogs):
    name = "local"
    multi_node = False
    queued = False
    requests_gpus = False
    runs_setup = False

    def lookup(self, job_id: str) -> JobRecord | None:
        return None  # a local job is known only to the job store of the shell that ran it

    def check(self, spec: JobSpec) -> None:
        if spec.nodes != 1:
            raise UsageError(f"--nodes {spec.nodes} with profile {spec.profile.name} (local): valid: 1.",
                             "use a Slurm profile for more than one node.")

    def doctor(self, spec: JobSpec, probe_wait_s: float | None = None) -> list[Check]:
        """Nothing queues here: the request was checked when the spec was built; what is left is the run folder."""
        checks = [Check("scheduler", Result.SKIP, f"profile {spec.profile.name} is local: nothing to ask a scheduler")]
        try:
            check_run_folder(spec.run_dir)
        except UsageError as e:
            return [*checks, Check("runs folder", Result.FAIL, e.one_line(), "another --run-dir or runs_dir")]
        return [*checks, Check("runs folder", Result.PASS, f"{spec.run_dir} can be made")]

    def script(self, spec: JobSpec) -> Script:
        raise UsageError(f"profile {spec.profile.name} is local: there is no sbatch script to render.",
                         "use a Slurm profile, or `hpcjobs submit` to run locally.")

    def dry_run(self, spec: JobSpec) -> SubmitRequest:
        return SubmitRequest(spec, describe(spec, JOB_ID_PLACEHOLDER))

    def submit(self, request: SubmitRequest, on_id: Callable[[Submitted], None]) -> Submitted:
        """Run every rank here and wait (recorded first, so status/list see the job while it runs)."""
        spec = request.spec
        job_id = local_job_id()
        run_dir = resolve_run_dir(spec.run_dir, {"HPCJOBS_JOB_ID": job_id})
        prepare_run_folder(spec, run_dir)
        run = RunFolder(run_dir)
        write_json_atomic(run.local_process, {"pid": os.getpid(), "host": socket.gethostname(), "job_id": job_id})
        sub = Submitted(job_id, run_dir, {"ranks": str(run.logs)})
        on_id(sub)
        print(f"hpcjobs: job {job_id}: running {spec.world()} locally; run folder {run_dir}", file=sys.stderr,
              flush=True)
        return replace(sub, returncode=self._run(spec, job_id, bool(request.params.get("stdout_to_stderr"))))

    def _run(self, spec: JobSpec, job_id: str, stdout_to_stderr: bool) -> int:
        envs = rank_envs(spec, job_id, free_port(), dict(os.environ))
        # Each rank in a process group of its own: the terminal's Ctrl-C reaches only this process, which turns it
        # into one stop request per rank (a rank hit by the terminal's signal as well would get two).
        procs = [subprocess.Popen(launcher_argv(spec), cwd=spec.workdir, env=env, preexec_fn=_rank_preexec,
                                  stdout=sys.stderr if stdout_to_stderr else None) for env in envs]
        stopper = Stopper(procs, getattr(signal, f"SIG{spec.profile.preemption.signal}"))
        old = {s: signal.signal(s, stopper.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return wait_all(procs)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def state(self, rec: JobRecord) -> tuple[JobState, str] | None:
        """No scheduler to ask: the run folder says how far it got, and its launching process whether it lives."""
        run = RunFolder(rec.run_dir)
        if run.final.exists():
            return None  # the run's own final word decides
        history = run.read_restarts()
        if history and "stopped" in history[-1]:
            return JobState.STOPPED, "run folder"  # checkpointed and stopped when asked: resumable
        alive = launcher_alive(run, rec.job_id)
        if alive is None:
            return None
        if alive:
            return JobState.RUNNING, "process"
        return JobState.FAILED, "run folder (its processes are gone, with no final word: killed?)"

    def cancel(self, rec: JobRecord) -> str:
        """Ask the launching process to stop, as Ctrl-C does: the ranks commit a checkpoint and stop."""
        run = RunFolder(rec.run_dir)
        if not launcher_alive(run, rec.job_id):
            return f"job {rec.job_id} is not running here; nothing to cancel"
        os.kill(int(run.read("local_process")["pid"]), signal.SIGTERM)
        return (f"job {rec.job_id} asked to stop: its ranks commit a checkpoint and stop (resume with the same "
                f"command and --run-dir {rec.run_dir})")


def launcher_alive(run: RunFolder, job_id: str) -> bool | None:
    """Whether the process that runs this local job is alive; None when that cannot be known here (another host,
    or a run folder from before this was recorded)."""
    proc = run.read("local_process")
    if not isinstance(proc, dict) or proc.get("host") != socket.gethostname() or proc.get("job_id") != job_id:
        return None
    try:
        cmdline = Path(f"/proc/{int(proc['pid'])}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"hpcjobs" in cmdline  # the pid may have been reused by an unrelated process


BACKEND = LocalBackend()
