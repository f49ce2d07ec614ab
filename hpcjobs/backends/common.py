"""What every backend shares: commands run with a bounded wait, the run folder made at submission, logs by rank."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable, Sequence

from hpcjobs.errors import RuntimeFailure, UsageError
from hpcjobs.runfolder import RunFolder
from hpcjobs.spec import JobSpec
from hpcjobs.store import JobRecord

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run a scheduler command; a missing command or a hang becomes an exit code, never an exception."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"{argv[0]}: timed out")


def prepare_run_folder(spec: JobSpec, run_dir: str) -> bool:
    """Create the job's (resolved) run folder and write what was submitted; True if the folder is new."""
    run = RunFolder(run_dir)
    created = not run.path.exists()
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        run.spec.write_text(json.dumps(spec.as_dict(), indent=2, sort_keys=True))
    except OSError as e:
        raise RuntimeFailure(f"cannot write the run folder {run_dir} ({e.strerror}).",
                             "pick a writable --run-dir, or fix runs_dir in the profile.") from None
    return created


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
