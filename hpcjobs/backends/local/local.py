"""The local backend: every rank a process on this machine, in the foreground (CPU + gloo without GPUs).

Ctrl-C (or SIGTERM, `hpcjobs cancel`) is passed on to the ranks: to the shared trainer's as it came, so they stop at a
step boundary after a checkpoint and restarts.jsonl says which it was; to a user's script as the profile's signal,
so a script with a StopGuard stops after its checkpoint too and any other script at once (KeyboardInterrupt, see
trainers.standby), as Ctrl-C stops it anywhere. The job then exits as an interrupted command does (130 for Ctrl-C,
143 for SIGTERM). Running the same command with the same --run-dir resumes.
"""

from __future__ import annotations

import itertools
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

from hpcjobs.backends import Script, SubmitRequest, Submitted, Times
from hpcjobs.backends.common import RunFolderLogs, check_run_folder, prepare_run_folder
from hpcjobs.backends.local import tiers
from hpcjobs.backends.local.queue import LocalQueue, ignored, ranks_argv
from hpcjobs.backends.start_env import clean
from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol import userstop
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.folderlock import in_use
from hpcjobs.protocol.nodecall import LAUNCHER_MODULE
from hpcjobs.protocol.runfolder import RunFolder, array_ids, lines_of, read_jsonl, resolve_run_dir, write_json_atomic
from hpcjobs.protocol.states import JobState, StopReason
from hpcjobs.protocol.tierfiles import tier_base
from hpcjobs.protocol.versions import CHECK as TORCH_CHECK
from hpcjobs.protocol.versions import FLOOR_TEXT
from hpcjobs.request.checks import Check, Result
from hpcjobs.request.credentials import states
from hpcjobs.request.gpu_fit import check_tier
from hpcjobs.request.spec import JobSpec
from hpcjobs.request.sweep import tasks_args

JOB_ID_PLACEHOLDER = "local-<id>"
"""How a dry run names the job id that only a real run gets."""


_ids = itertools.count()


def local_job_id() -> str:
    """The time, the submitting process and its count of jobs: one process submits several in the same second (a
    chain's steps), and each must be a job of its own in the store."""
    n = next(_ids)
    return f"local-{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}" + (f"-{n}" if n else "")


def check_python(spec: JobSpec) -> None:
    """A profile's `python:` that cannot start the ranks (no torch at the floor, no hpcjobs) is one line before
    anything is written, as the Slurm job script says it (hpcjobs.backends.slurm.sbatch.python_lines); each rank would
    otherwise print its own ModuleNotFoundError traceback. The Python hpcjobs runs from is not asked: it imported
    hpcjobs."""
    if spec.python == sys.executable:
        return
    try:
        out = subprocess.run([spec.python, "-c", f"{TORCH_CHECK}; import {LAUNCHER_MODULE}"], cwd=spec.workdir,
                             env=clean(dict(os.environ)), capture_output=True, text=True, timeout=60)
        said = [ln.strip() for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
        why = None if out.returncode == 0 else said[-1] if said else f"exit code {out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        raise UsageError(f"profile {spec.profile.name}'s python {spec.python} cannot start the ranks ({why}); valid: "
                         f"a Python with torch >= {FLOOR_TEXT} and hpcjobs installed.",
                         "set python: in the profile to such a Python, or leave it out to use this one.")


def check_tier_memory(spec: JobSpec) -> None:
    """The node-local tier's copies against the size of its folder here (/dev/shm, or HPCJOBS_LOCAL_CKPT_DIR from the
    profile's env or this shell's: what the ranks will get), refused in one line (hpcjobs.request.gpu_fit)."""
    if spec.entry.kind != "task":
        return
    folder = tier_base({**os.environ, **spec.env})
    for args in tasks_args(spec.entry.args, spec.points):
        check_tier(spec.profile, spec.entry.target, args, 1, spec.ranks, folder)


def describe(spec: JobSpec, job_id: str) -> str:
    """The request as text: what each rank would run, with the variables hpcjobs sets for it."""
    argv = " ".join(shlex.quote(w) for w in ranks_argv(spec))
    lines = [f"# local: {spec.world()} on this machine, from {spec.workdir}", *(f"# {x}" for x in ignored(spec))]
    lines += [f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())]
    lines += [f"# {k}: {s}, from this shell (its value is never written)" for k, s in states(spec.secrets).items()]
    for r in range(spec.ranks):
        lines.append(f"RANK={r} LOCAL_RANK={r} WORLD_SIZE={spec.ranks} MASTER_ADDR=127.0.0.1 MASTER_PORT=<free> "
                     f"HPCJOBS_JOB_ID={job_id} {argv}")
    return "\n".join(lines) + "\n"


class LocalBackend(RunFolderLogs):
    name = "local"
    multi_node = False
    queued = False
    requests_gpus = False
    runs_setup = False

    def allocations(self, rec: JobRecord, run: Any = None) -> list[Times]:
        return []  # a local job's are the run folder's own record (RUN/allocations.jsonl)

    def lookup(self, job_id: str) -> JobRecord | None:
        return None  # a local job is known only to the job store of the shell that ran it

    def check(self, spec: JobSpec) -> None:
        if spec.container is not None:  # a choice: hpcjobs starts local ranks itself, in this machine's Python
            raise UsageError(f"container runtime {spec.container.runtime} with profile {spec.profile.name} (local): "
                             "valid: no container (local ranks run in this machine's Python).", "run it on Slurm "
                             "(a profile with scheduler: slurm), or start the image yourself and run hpcjobs in it.")
        if spec.nodes != 1:
            raise UsageError(f"--nodes {spec.nodes} with profile {spec.profile.name} (local): valid: 1.",
                             "use a Slurm profile for more than one node.")
        check_tier_memory(spec)
        slots = spec.profile.gpus_per_node
        if spec.max_parallel and spec.max_parallel * spec.ranks > slots:
            raise UsageError(f"--max-parallel {spec.max_parallel} × {spec.ranks} ranks with profile "
                             f"{spec.profile.name} (local): valid: at most {slots} ranks at once (its "
                             "gpus_per_node).", f"e.g. --max-parallel {max(1, slots // spec.ranks)}")

    def check_site(self, spec: JobSpec) -> None:
        """Nothing to ask: the profile's facts are this machine's."""

    def doctor(self, spec: JobSpec, probe_wait_s: float | None = None) -> list[Check]:
        """Nothing queues here: the request was checked when the spec was built; what is left is the run folder."""
        checks = [Check("scheduler", Result.SKIP, f"profile {spec.profile.name} is local: nothing to ask a scheduler")]
        try:
            check_run_folder(spec.run_dir)
        except UsageError as e:
            return [*checks, Check("runs folder", Result.FAIL, e.one_line(), "another --run-dir or runs_dir")]
        return [*checks, Check("runs folder", Result.PASS, f"{spec.run_dir} can be made"),
                tiers.doctor_check({**os.environ, **spec.env})]

    def script(self, spec: JobSpec) -> Script:
        raise UsageError(f"profile {spec.profile.name} is local: there is no sbatch script to render.",
                         "use a Slurm profile, or `hpcjobs submit` to run locally.")

    def dry_run(self, spec: JobSpec) -> SubmitRequest:
        return SubmitRequest(spec, describe(spec, JOB_ID_PLACEHOLDER))

    def submit(self, request: SubmitRequest, on_id: Callable[[Submitted], None]) -> Submitted:
        """Run every rank here and wait (recorded first, so status/list see the job while it runs). A sweep's
        points run one after another, or `max_parallel` at once, each a job `ID_N` with its own run folder."""
        spec = request.spec
        check_python(spec)
        job_id = local_job_id()
        tasks = [(f"{job_id}_{i}", i) for i in range(len(spec.points))] if spec.array else [(job_id, None)]
        run_dirs = [resolve_run_dir(spec.run_dir, array_ids(task_id)) for task_id, _ in tasks]
        for run_dir in run_dirs:  # a start its rank 0 would refuse writes nothing, here either
            if (busy := in_use(RunFolder(run_dir))) is not None:
                message, _, hint = busy.partition(" HINT: ")
                raise UsageError(message, hint or None)
        subs = []
        for (task_id, index), run_dir in zip(tasks, run_dirs, strict=True):
            prepare_run_folder(spec, run_dir, index)
            run = RunFolder(run_dir)
            write_json_atomic(run.local_process, {"pid": os.getpid(), "host": socket.gethostname(),
                                                  "job_id": task_id})
            subs.append(Submitted(task_id, run_dir, {"ranks": str(run.logs)}, task=index))
            on_id(subs[-1])
        codes = LocalQueue(spec, subs, bool(request.params.get("stdout_to_stderr"))).run()
        done = [replace(sub, returncode=code) for sub, code in zip(subs, codes, strict=True)]
        if not spec.array:
            return done[0]
        return Submitted(job_id, spec.run_dir, returncode=max(codes, key=abs), tasks=tuple(done))

    def state(self, rec: JobRecord) -> tuple[JobState, str] | None:
        """No scheduler to ask: the run folder says how far it got, and its launching process whether it lives."""
        run = RunFolder(rec.run_dir)
        if isinstance(run.final_of(rec.job_id), dict):
            return None  # the job's own final word decides
        # This job's own lines: a later job on the same folder (a resume) must not make it UNKNOWN, nor lend it
        # its ending.
        mine = lines_of(run.read_restarts(), rec.job_id)
        if mine and "stopped" in mine[-1] and mine[-1]["stopped"] != StopReason.FAULT:
            return JobState.STOPPED, "run folder"  # stopped when asked (at a checkpoint, or by you): resumable
        alive = launcher_alive(run, rec.job_id)
        if alive is None:
            return None
        if alive:
            return JobState.RUNNING, "process"
        return JobState.FAILED, "run folder (its processes are gone, with no final word: killed?)"

    def exit_code(self, rec: JobRecord) -> int | None:
        """The code the job's ranks exited with, as this backend recorded it (RUN/allocations.jsonl, its last run)."""
        codes = [a["code"] for a in read_jsonl(RunFolder(rec.run_dir).allocations, {"code": (int,)})
                 if str(a.get("job_id")) == rec.job_id]
        return codes[-1] if codes else None

    def cancel(self, rec: JobRecord) -> str:
        """Ask the launching process to stop, as Ctrl-C does (`Stopper`)."""
        run = RunFolder(rec.run_dir)
        if not launcher_alive(run, rec.job_id):
            return f"job {rec.job_id} is not running here; nothing to cancel"
        userstop.cancel(run, rec.job_id)  # the launcher names the stop `hpcjobs cancel`, not SIGTERM
        os.kill(int(run.read("local_process")["pid"]), signal.SIGTERM)
        kind = str((rec.spec.get("entry") or {}).get("kind", "task"))
        joined = kind == "task" or userstop.joined(run, rec.job_id)
        return (f"job {rec.job_id} asked to stop: {userstop.case(kind, joined)} (resume with the same command and "
                f"--run-dir {rec.run_dir})")


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
