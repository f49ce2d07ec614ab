"""A start its ranks refused (trainers.launch: a flag the node cannot use, a resume whose checkpoint was written
under other settings): exit code 2 and one line, and nothing in the run folder that says how the job ended.

Without this, such a job read FAILED ("its processes are gone, with no final word: killed?") locally and FAILED in
sacct, and goodput counted the start as a lost one (a fault, in its checkpoint-interval advice). A refusal is known
by two facts together: the job's exit code was 2 (its backend's `exit_code`: the local backend's allocations.jsonl;
sacct's ExitCode, or submitit's "rank exited with code 2" in the job's output), and the last line of rank 0's log of
the job's last start (else of the job's own output) is the launcher's one-line refusal. Torch-free; reads only.
"""

from __future__ import annotations

from pathlib import Path

from hpcjobs.backends import Backend
from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol.faultpolicy.recoverable import REFUSED_EXIT
from hpcjobs.protocol.runfolder import RunFolder

PREFIX = "hpcjobs: "
"""How the launcher's lines begin; its refusal is `hpcjobs: WHAT ... HINT: ...`."""

NOT_A_REFUSAL = ("hpcjobs: rank ", "hpcjobs: job ", "hpcjobs: stopped by ")
"""The launcher's other lines: a rank's start-up banner or failure, the job's own line, a stop without a save."""


def _tail(path: Path, size: int = 65536) -> list[str]:
    """The non-empty lines at the end of a file; [] for one that cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def is_refusal(line: str) -> bool:
    return line.startswith(PREFIX) and not line.startswith(NOT_A_REFUSAL)


def last_start(run: RunFolder, job_id: str) -> int | None:
    """The restart number of the job's last start line; None when no rank of it recorded a start."""
    starts = [r for r in run.read_restarts() if "stopped" not in r and str(r.get("job_id")) == job_id]
    return int(starts[-1].get("restart", 0)) if starts else None


def rank_line(run: RunFolder, job_id: str, restart: int | None = None) -> str | None:
    """The refusal line rank 0 of the job's start (by default its last) logged as its last line, without the
    launcher's prefix; None when that start's log ends otherwise (or there is none)."""
    restart = last_start(run, job_id) if restart is None else restart
    if restart is None:
        return None
    tail = _tail(run.rank_log(restart, 0))
    return tail[-1][len(PREFIX):] if tail and is_refusal(tail[-1]) else None


def output_line(rec: JobRecord) -> str | None:
    """The last refusal line in the job's own output (Slurm's file; submitit's .err beside it): a start refused
    before its rank log was opened (a contract or job environment the node cannot read, a busy run folder)."""
    out = rec.logs.get("slurm")
    if not out:
        return None
    path = Path(out)
    lines = [ln for p in ([path, path.with_suffix(".err")] if path.suffix == ".out" else [path]) for ln in _tail(p)]
    found = [ln for ln in lines if is_refusal(ln)]
    return found[-1][len(PREFIX):] if found else None


def refusal(rec: JobRecord, run: RunFolder, backend: Backend) -> str | None:
    """The refusal line of a job whose start its ranks refused (the line, and exit code 2 as its backend knows it),
    else None. The backend is asked only when a line was found: an ordinary failure costs no second sacct call."""
    line = rank_line(run, rec.job_id) or output_line(rec)
    if line is None:
        return None
    return line if backend.exit_code(rec) == REFUSED_EXIT else None
