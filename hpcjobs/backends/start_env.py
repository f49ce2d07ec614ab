"""The environment a job starts from: this shell's, less the identity of any job this shell runs inside.

A local run started inside a Slurm allocation, or a submission made from one, would otherwise hand the outer job's
variables on (its job id, its task layout, srun's settings), and the new job's ranks would take them for their own
(the last release fixed a crash from one such variable; removing them by name always misses the next one).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from hpcjobs.protocol.rankvars import RENDEZVOUS

JOB_PREFIXES = ("SLURM_", "SRUN_", "SBATCH_", "SLURMD_", "SALLOC_", "TORCHELASTIC_")
"""Variables that describe a job or steer a scheduler's command: never inherited by a new job."""
KEEP = ("SLURM_CONF",)
"""Client configuration, not a job's identity: where the site keeps slurm.conf."""


def is_job_variable(name: str) -> bool:
    return name not in KEEP and (name.startswith(JOB_PREFIXES) or name in RENDEZVOUS)


def clean(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without any job's identity (see JOB_PREFIXES, RENDEZVOUS)."""
    return {k: v for k, v in env.items() if not is_job_variable(k)}


@contextlib.contextmanager
def cleaned_os_environ() -> Iterator[None]:
    """os.environ cleaned for the duration (submitit runs sbatch with this process's environment), then restored."""
    removed = {k: os.environ.pop(k) for k in [k for k in os.environ if is_job_variable(k)]}
    try:
        yield
    finally:
        os.environ.update(removed)
