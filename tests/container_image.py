"""A container image built in the test, for ch-run: the host's /usr (hard links: seconds, no copy) without any Slurm
client, so a rank inside cannot run scontrol, and a marker file only the image has, which each rank copies out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

MARKER = "IMAGE_MARKER"
PREFIXES = (str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve()), str(REPO))
"""What the image mounts at their own paths: this venv and the Python it is made from (their real paths: a link to
a folder that is not mounted leads nowhere inside), and the project."""
SLURM_CLIENT = ("scontrol", "sbatch", "srun", "squeue", "scancel", "sinfo", "sacct", "salloc", "sacctmgr")


def build_rootfs(folder: Path, *mounted: str) -> Path:
    """An image folder for ch-run: the host's /usr (hard links where the filesystem allows: seconds, no copy) less
    every Slurm client, the usual top-level links, a marker only the image has, and a Python wrapper that copies it
    into the run folder for each rank before it runs the venv's Python (mounted at its own path); a folder for
    each path `mounted` (ch-run binds onto existing folders only)."""
    root = folder / "image"
    for path in (*mounted, str(folder), *PREFIXES):
        (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    if (root / MARKER).exists():
        return root
    if subprocess.run(["cp", "-al", "/usr", str(root / "usr")], capture_output=True).returncode != 0:
        shutil.rmtree(root / "usr", ignore_errors=True)
        subprocess.run(["cp", "-a", "/usr", str(root / "usr")], check=True)
    for name in ("bin", "sbin", "lib", "lib64"):
        if Path(f"/{name}").is_symlink():
            (root / name).symlink_to(os.readlink(f"/{name}"))
    for name in ("etc", "dev", "proc", "sys", "tmp", "run", "work", "home", "root", "var"):
        (root / name).mkdir(exist_ok=True)
    for etc in ("passwd", "group", "nsswitch.conf", "hosts"):
        shutil.copy(f"/etc/{etc}", root / "etc" / etc)
    for client in SLURM_CLIENT:
        for where in ("usr/bin", "usr/sbin", "usr/local/bin"):
            (root / where / client).unlink(missing_ok=True)
    (root / MARKER).write_text("inside the test image\n")
    wrapper = root / "hpcjobs-python"
    wrapper.write_text('#!/bin/sh\n[ -z "$HPCJOBS_PROOF" ] || cp /IMAGE_MARKER '
                       '"$HPCJOBS_PROOF/rank-${SLURM_PROCID:-x}-job-${SLURM_JOB_ID:-x}-$$"\n'
                       f'exec {PREFIXES[0]}/bin/python "$@"\n')
    wrapper.chmod(0o755)
    return root
