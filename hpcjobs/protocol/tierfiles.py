"""Where a job's node-local checkpoint tier keeps its files, and their removal when the job ends for good (issue 40):
the ranks remove their own files when they finish or stop at a shared checkpoint (trainers.localtier.LocalTier.close),
but a job that ends failed leaves each rank's own files and replicas, up to 4 copies of its whole training state, in
/dev/shm on every node, memory the node gets back only at a reboot. Whoever decides the job's end removes them: the
batch step's recovery loop on every node of the allocation (trainers.recover), the local backend on this machine
(hpcjobs.backends.local). A job killed as a whole reaches neither: the next start of one of the user's jobs on the
node sweeps what it left (hpcjobs.protocol.tiersweep). Torch-free: the same names as trainers.localtier.tier_root,
which this side cannot import.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

DIR_ENV = "HPCJOBS_LOCAL_CKPT_DIR"
"""The node-local folder the tier uses instead of /dev/shm (trainers.localtier.DIR_ENV)."""
FLAG = "--local-ckpt-every"
PREFIX = "hpcjobs-"
"""The start of every job's folder in the tier's base (hpcjobs.protocol.tiersweep finds them by it)."""


def tier_on(argv: Sequence[str]) -> bool:
    """The ranks' command line turns the tier on (`--local-ckpt-every N`, N > 0, or `auto`, the default; the last
    one given wins)."""
    value = "auto"
    for i, word in enumerate(argv):
        if word == FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(FLAG + "="):
            value = word.split("=", 1)[1]
    return value == "auto" or (value.isdigit() and int(value) > 0)


def tier_base(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(DIR_ENV) or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())


def job_folder_name(job_id: str) -> str:
    """The job's folder in the tier's base (trainers.localtier.tier_root's first part)."""
    return PREFIX + re.sub(r"[^\w.-]", "_", job_id or "nojob")


def job_folder(job_id: str, environ: Mapping[str, str] = os.environ) -> Path:
    return Path(tier_base(environ)) / job_folder_name(job_id)


def remove_job_folder(job_id: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Remove the job's tier folder on this machine; whether there was one."""
    folder = job_folder(job_id, environ)
    if not folder.is_dir():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True
