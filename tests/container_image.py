"""A container image built in the test, for ch-run: the host's /usr (hard links: seconds, no copy) without any Slurm
client, so a rank inside cannot run scontrol, and a marker file only the image has, which each rank copies out
(`rank-R-job-J-PID` in $HPCJOBS_PROOF), with the folder it started in (`cwd-R-job-J-PID`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

MARKER = "IMAGE_MARKER"
PREFIXES = tuple(p for p in dict.fromkeys((str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve()),
                                           str(REPO))) if not Path(p).is_relative_to("/usr"))
"""What the image mounts at their own paths: this venv and the Python it is made from (their real paths: a link to
a folder that is not mounted leads nowhere inside), and the project. Not a Python under /usr (Debian's python3, as
in CI): the image's /usr already holds it, and the host's /usr mounted over it would bring the Slurm client back."""
SLURM_CLIENT = ("scontrol", "sbatch", "srun", "squeue", "scancel", "sinfo", "sacct", "salloc", "sacctmgr")


def build_rootfs(folder: Path, *mounted: str) -> Path:
    """An image folder for ch-run: the host's /usr (hard links where the filesystem allows: seconds, no copy) less
    every Slurm client, the usual top-level links, a marker only the image has, and a Python wrapper that copies it
    into the run folder for each rank before it runs the venv's Python (mounted at its own path); a folder for
    each path `mounted` (ch-run binds onto existing folders only)."""
    root = folder / "rootfs"  # the name Slurm 22.05 takes in an OCI bundle (build_bundle): one tree for both
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
    proof = '"$HPCJOBS_PROOF/WHAT-${SLURM_PROCID:-x}-job-${SLURM_JOB_ID:-x}-$$"'
    wrapper.write_text(f'#!/bin/sh\n[ -z "$HPCJOBS_PROOF" ] || {{ cp /IMAGE_MARKER {proof.replace("WHAT", "rank")}; '
                       f'pwd > {proof.replace("WHAT", "cwd")}; }}\nexec {PREFIXES[0]}/bin/python "$@"\n')
    wrapper.chmod(0o755)
    return root


def build_bundle(folder: Path) -> Path:
    """An OCI bundle for Slurm's `srun --container` (runc) around the same image (`build_rootfs`): `folder` itself,
    with `runc spec`'s config.json with the test cluster's changes (measured: the shared containers doc): no
    terminal; the node's network and hostname kept (a rank finds its index by `uname -n`, and gloo reaches the other
    node); the folders `build_rootfs` makes mount points for bound at their own paths (the venv, the project, the
    test's folder with the runs and their code snapshots), read-write; a tmpfs /tmp (the image's root is read-only:
    its /usr is hard links to the host's). Slurm replaces process.args and process.env."""
    root, bundle = build_rootfs(folder), folder
    if not (bundle / "config.json").exists():
        subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True)
    config = json.loads((bundle / "config.json").read_text())
    config["root"]["path"] = root.name  # Slurm 22.05 takes <bundle>/rootfs whatever this says; runc refuses a link
    config["process"]["terminal"] = False
    config["process"].pop("rlimits", None)  # runc spec's 1024 open files: the node's own limit instead
    config.pop("hostname", None)
    linux = config["linux"]
    linux["namespaces"] = [n for n in linux["namespaces"] if n["type"] not in ("network", "uts")]
    binds = [{"destination": p, "type": "bind", "source": p, "options": ["rbind", "rw"]}
             for p in sorted({str(folder), *PREFIXES})]
    tmp = {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}
    ours = {"/tmp", *(b["destination"] for b in binds)}
    config["mounts"] = [m for m in config["mounts"] if m["destination"] not in ours] + [tmp, *binds]
    (bundle / "config.json").write_text(json.dumps(config, indent=2))
    return bundle
