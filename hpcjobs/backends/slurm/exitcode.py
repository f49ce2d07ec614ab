"""A Slurm job's exit code, for `hpcjobs status` to tell a start its ranks refused (exit 2: hpcjobs.follow.refused)
from a failure: sacct's ExitCode of the allocation (`2:0`: a rendered script's srun passes the ranks' code on), else
submitit's words in the job's output, since under submitit the rank's code becomes a RuntimeError (see
hpcjobs.protocol.nodecall.NodeEntry) and the job's own exit code is submitit's."""

from __future__ import annotations

import contextlib
import re
import subprocess
from pathlib import Path

from hpcjobs.backends.common import Runner
from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol.faultpolicy.diagnosis import read_text

SUBMITIT_WORDS = re.compile(r"hpcjobs ranks? exited with code (\d+)")
"""What NodeEntry and SupervisedStep raise for ranks that exited non-zero."""


def sacct_exit_code(job_id: str, run: Runner) -> int | None:
    """The allocation's exit code as sacct keeps it (the newest allocation's); None without accounting."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "ExitCode"])
        lines = out.stdout.strip().splitlines() if getattr(out, "returncode", 1) == 0 else []
        code = lines[-1].split(":")[0].strip() if lines else ""
        return int(code) if code.isdigit() else None
    return None


def job_exit_code(rec: JobRecord, run: Runner) -> int | None:
    """The ranks' code as submitit's words name it in the job's output (its .err beside it): under submitit sacct
    holds submitit's own code (1); else sacct's ExitCode (None without accounting)."""
    out = rec.logs.get("slurm")
    paths = [Path(out), Path(out).with_suffix(".err")] if out else []
    said = [m for p in paths for m in SUBMITIT_WORDS.findall(read_text(p))]
    return int(said[-1]) if said else sacct_exit_code(rec.job_id, run)
