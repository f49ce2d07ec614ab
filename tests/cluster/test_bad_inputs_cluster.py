"""Bad inputs only the cluster can tell (issue 38 item 4): one line, exit 2, nothing queued or written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, hpcjobs

pytestmark = pytest.mark.cluster


def queued_comments() -> str:
    """The comments (hpcjobs:run=FOLDER) of every job Slurm knows: the cluster is shared, so a test looks for its
    own folders there, not for an unchanged queue."""
    return subprocess.run(["squeue", "-h", "-t", "all", "-o", "%k"], capture_output=True, text=True,
                          timeout=60).stdout


@pytest.mark.parametrize("command", ["submit", "render"])
def test_a_partition_the_cluster_lacks_is_refused_before_anything_is_written(command: str, tmp_path: Path) -> None:
    """`--partition nosuch`: sbatch refused it (exit 1) after the code snapshot and the run folder were made, and
    `render` wrote the script, its log folder and the snapshot for a job that could never queue."""
    profile = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({**profile, "runs_dir": str(tmp_path / "runs")}))
    script = tmp_path / "job.sbatch"
    extra = ["-o", str(script)] if command == "render" else []
    out = hpcjobs(command, "--profile", str(prof), "--partition", "nosuch", *extra, "trainers.tasks.lm",
                  "--steps", "5", cwd=REPO)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--partition nosuch: the cluster has no partition 'nosuch'; valid: low, high" \
        in lines[0] and "HINT:" in lines[0], out.stderr
    assert not (tmp_path / "runs").exists() and not script.exists()
    assert hpcjobs("list", "--json").stdout.strip() == "[]"
    assert str(tmp_path) not in queued_comments()
    ok = hpcjobs(command, "--profile", str(prof), "--partition", "high", "--dry-run" if command == "submit"
                 else "--force", *extra, "trainers.tasks.lm", "--steps", "5", cwd=REPO)
    assert ok.returncode == 0, ok.stderr
