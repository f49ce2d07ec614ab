"""Slurm's answers as fields: `scontrol show job -o`'s KEY=VALUE pairs and sacct's times (pure but for the runner).
The backend (hpcjobs.backends.slurm.slurm) and what it knows of faults (hpcjobs.backends.slurm.failed_nodes) both read
them."""

from __future__ import annotations

import datetime
import re

from hpcjobs.backends.common import Runner


def sacct_time(text: str) -> float | None:
    """sacct's local-time `2026-11-25T14:27:19`; None for Unknown/None (not started, still running)."""
    try:
        return datetime.datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def scontrol_fields(job_id: str, run: Runner) -> dict[str, str]:
    """`scontrol show job`'s KEY=VALUE fields (empty once Slurm forgot the job, after MinJobAge)."""
    out = run(["scontrol", "show", "job", "-o", job_id])
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}
