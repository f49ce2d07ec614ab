"""What every backend shares: commands run with a bounded wait, the run folder made at submission, logs by rank."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from hpcjobs.backends import SchedulerFacts
from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol.access import restrict_made
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.faultpolicy.diagnosis import Failure
from hpcjobs.protocol.paths import RUN_DIR_HINT, existing_ancestor, run_folder_place
from hpcjobs.protocol.runfolder import RunFolder, write_json_atomic
from hpcjobs.request.credentials import group_id
from hpcjobs.request.spec import JobSpec

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run a scheduler command; a missing command or a hang becomes an exit code, never an exception."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"{argv[0]}: timed out")


def last_words(proc: subprocess.CompletedProcess[str]) -> str:
    """What a command that failed said last: its last non-empty line on stderr, else on stdout, else its exit code."""
    for text in (proc.stderr, proc.stdout):
        said = [line.strip() for line in (text or "").splitlines() if line.strip()]
        if said:
            return said[-1]
    return f"exit code {proc.returncode}"


CONTROLLER_HINT = "check that Slurm's controller is up (`scontrol ping`)"
"""The hint when a Slurm command could not answer (squeue for status, scontrol for doctor)."""


def check_run_folder(run_dir: str) -> None:
    """Refuse a run folder that cannot be made, before anything is queued: the folder itself (or, for a pattern,
    its fixed part) must be a folder or creatable under a writable folder."""
    probe = run_folder_place(run_dir)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"run folder {run_dir}: {probe} is not writable.", RUN_DIR_HINT)
    if not Path(run_dir).is_dir():  # a folder to be made (a pattern's, %j, always is)
        try_making_in(probe, run_dir)


def try_making_in(place: Path, run_dir: str) -> None:
    """Whether a folder can really be made in `place`, tried (and taken away at once): permission bits do not tell
    of /proc, a read-only mount or root on a root-squashed share, where making the run folder or its code snapshot
    failed later (exit 1, after the checks)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hpcjobs-probe-", dir=place))
    except OSError as e:
        raise UsageError(f"run folder {run_dir}: no folder can be made in {place} ({e.strerror}).",
                         RUN_DIR_HINT) from None


def prepare_run_folder(spec: JobSpec, run_dir: str, task: int | None = None) -> bool:
    """Create the job's (resolved) run folder and write what was submitted (an array task: with its point); True if
    the folder is new."""
    check_run_folder(run_dir)
    run = RunFolder(run_dir)
    created = not run.path.exists()
    try:
        there = existing_ancestor(run.path)
        run.path.mkdir(parents=True, exist_ok=True)
        restrict_made(run.path, there, group_id(spec.profile.group))
        record_spec(run, spec, task)
    except OSError as e:
        raise UsageError(f"cannot write the run folder {run_dir} ({e.strerror}).",
                         "pick a writable --run-dir, or fix runs_dir in the profile.") from None
    return created


def record_spec(run: RunFolder, spec: JobSpec, task: int | None = None) -> None:
    """spec.json says what was submitted last; specs/N.json keeps every submission to this folder (a resume with
    other settings must not rewrite what the first job was)."""
    recorded = spec.as_dict(task)
    text = json.dumps(recorded, indent=2, sort_keys=True)
    history = run.path / "specs"
    history.mkdir(exist_ok=True)
    taken = [int(p.stem) for p in history.glob("*.json") if p.stem.isdigit()]
    (history / f"{max(taken, default=0) + 1}.json").write_text(text)
    write_json_atomic(run.spec, recorded)


class RunFolderLogs:
    """Logs live in the run folder for every backend: RUN/logs/restart-N/rank-R.log."""

    def logs(self, rec: JobRecord, rank: int = 0, restart: int | None = None) -> Path:
        run = RunFolder(rec.run_dir)
        restarts = run.restart_dirs()
        if restart is None:
            if not restarts:
                raise UsageError(f"job {rec.job_id} has no logs yet in {run.logs} (it may still be pending).",
                                 f"`hpcjobs status {rec.job_id}` shows its state.")
            restart = restarts[-1]
        path = run.rank_log(restart, rank)
        if not path.exists():
            ranks = sorted(p.stem.split("-")[1] for p in path.parent.glob("rank-*.log"))
            raise UsageError(f"job {rec.job_id} has no log for rank {rank} restart {restart}; restarts: "
                             f"{restarts or 'none'}, ranks of that restart: {', '.join(ranks) or 'none'}.",
                             "pick one of those with --rank and --restart.")
        return path

    def reported_failures(self, rec: JobRecord) -> list[Failure]:
        """What the scheduler said about ranks that ended badly (nothing unless a backend reads it)."""
        return []

    def exit_code(self, rec: JobRecord) -> int | None:
        """The job's exit code (not known unless a backend records it)."""
        return None

    def scheduler_facts(self, rec: JobRecord) -> SchedulerFacts:
        """The scheduler's restart count and failed nodes (nothing unless a backend asks it)."""
        return SchedulerFacts()
