"""A start its ranks refused (trainers.launch: a flag the node cannot use, a resume whose checkpoint was written
under other settings): exit code 2 and one line, and nothing in the run folder that says how the job ended.

Without this, such a job read FAILED ("its processes are gone, with no final word: killed?") locally and FAILED in
sacct, and goodput counted the start as a lost one (a fault, in its checkpoint-interval advice). A refusal is known
by two facts together: the job's exit code was 2 (the local backend's allocations.jsonl; sacct's ExitCode, or
submitit's "rank exited with code 2" in the job's output), and the last line of rank 0's log of the job's last start
(else of the job's own output) is the launcher's one-line refusal. Torch-free; reads only.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol.faultpolicy.recoverable import REFUSED_EXIT
from hpcjobs.protocol.runfolder import RunFolder, read_jsonl

PREFIX = "hpcjobs: "
"""How the launcher's lines begin; its refusal is `hpcjobs: WHAT ... HINT: ...`."""

NOT_A_REFUSAL = ("hpcjobs: rank ", "hpcjobs: job ", "hpcjobs: stopped by ")
"""The launcher's other lines: a rank's start-up banner or failure, the job's own line, a stop without a save."""

SUBMITIT_EXIT = f"hpcjobs rank exited with code {REFUSED_EXIT}"
"""What hpcjobs.protocol.nodecall.NodeEntry raises under submitit for a rank that exited 2 (the job's own exit code is
then submitit's)."""

Runner = Callable[[Sequence[str]], Any]


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


def local_exit(run: RunFolder, job_id: str) -> int | None:
    """The local backend's record of the job's exit code (its last run of the ranks)."""
    codes = [a["code"] for a in read_jsonl(run.allocations, {"code": (int,)}) if str(a.get("job_id")) == job_id]
    return codes[-1] if codes else None


def slurm_exit(rec: JobRecord, runner: Runner | None) -> int | None:
    """sacct's ExitCode of the job's allocation (`2:0`), or submitit's words for a rank that exited 2 in the job's
    output; None when neither says."""
    if runner is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            out = runner(["sacct", "-n", "-X", "-P", "-j", rec.job_id, "-o", "ExitCode"])
            lines = out.stdout.strip().splitlines() if getattr(out, "returncode", 1) == 0 else []
            if lines and int(lines[-1].split(":")[0]) == REFUSED_EXIT:
                return REFUSED_EXIT
    out = rec.logs.get("slurm")
    paths = [Path(out), Path(out).with_suffix(".err")] if out else []
    return REFUSED_EXIT if any(SUBMITIT_EXIT in ln for p in paths for ln in _tail(p)) else None


def refusal(rec: JobRecord, run: RunFolder, runner: Runner | None = None) -> str | None:
    """The refusal line of a job whose start its ranks refused (exit code 2 and the line), else None. `runner`:
    the Slurm backend's command runner (sacct, asked only when a refusal line was found: an ordinary failure costs
    no second sacct call)."""
    line = rank_line(run, rec.job_id) or output_line(rec)
    if line is None:
        return None
    code = local_exit(run, rec.job_id) if rec.scheduler == "local" else slurm_exit(rec, runner)
    return line if code == REFUSED_EXIT else None
