"""A job that ends for good removes its node-local tier's files (issue 40; hpcjobs.protocol.tierfiles): on Slurm the
batch step's recovery loop runs one `rm -rf` step on every node that is up (trainers.recover.remove_tier); a
recovery, a requeue, a job Slurm is ending, or the tier off runs nothing. The local backend removes the folder when
the job's ranks end for good (a task's own error here: 2 real ranks of the classifier)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_recover import Slurm, step

from conftest import REPO, hpcjobs
from hpcjobs.protocol.tierfiles import job_folder, tier_on
from trainers import recover


class Nodes(Slurm):
    """The fake Slurm, and an srun that runs its command here (every node is this machine)."""

    def __call__(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        if cmd[0] == "srun":
            self.asked.append(cmd)
            return subprocess.run(cmd[cmd.index("--kill-on-bad-exit=0") + 1:], capture_output=True, text=True)
        return super().__call__(cmd, **kw)


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("HPCJOBS_RESTART", raising=False)
    monkeypatch.setenv("HPCJOBS_LOCAL_CKPT_DIR", str(tmp_path / "shm"))
    monkeypatch.setattr(recover, "_ended", [])
    folder = job_folder("42")
    (folder / "abc").mkdir(parents=True)
    (folder / "abc" / "rank-0-of-2.step-5.pt").write_bytes(b"x" * 64)
    return folder


def srun_asked(slurm: Slurm) -> list[list[str]]:
    return [c for c in slurm.asked if c[0] == "srun"]


def test_a_job_that_ends_failed_removes_the_tier_on_every_node(tier: Path, tmp_path: Path) -> None:
    slurm = Nodes()
    assert recover.supervise([*step(tmp_path / "run", ["task"]), "--local-ckpt-every", "5"], slurm) == 1
    [cmd] = srun_asked(slurm)
    assert "--nodelist=node1,node2" in cmd and cmd[-4:] == ["rm", "-rf", "--", str(tier)], cmd
    assert not tier.exists()


def test_a_down_node_is_left_out_of_the_removal(tier: Path) -> None:
    slurm = Nodes(down=["node2"])
    recover.remove_tier(["x", "--local-ckpt-every=5"], recover.Allocation("42", ["node1", "node2"], 0), slurm)
    [cmd] = srun_asked(slurm)
    assert "--nodelist=node1" in cmd and "--nodes=1" in cmd and not tier.exists(), cmd


@pytest.mark.parametrize("case", ["tier off", "recovered", "scancelled"])
def test_nothing_is_removed_when_the_job_goes_on_or_the_tier_is_off(tier: Path, tmp_path: Path, case: str) -> None:
    plan = {"tier off": ["task"], "recovered": ["peer", "ok"], "scancelled": ["peer"]}[case]
    flags = ["--local-ckpt-every", "0" if case == "tier off" else "5"]
    slurm = Nodes(state="CANCELLED" if case == "scancelled" else "RUNNING")
    recover.supervise([*step(tmp_path / "run", plan), *flags], slurm)
    assert srun_asked(slurm) == [] and tier.exists()


def test_the_tier_is_on_only_with_a_positive_interval_or_auto() -> None:
    assert tier_on(["x", "--local-ckpt-every", "5"]) and tier_on(["--local-ckpt-every=1"])
    assert tier_on([]) and tier_on(["--ckpt-every", "5"]) and tier_on(["--local-ckpt-every", "auto"])  # the default
    assert not tier_on(["--local-ckpt-every", "0"]) and not tier_on(["--local-ckpt-every=0"])
    assert not tier_on(["--local-ckpt-every", "5", "--local-ckpt-every", "0"])


@pytest.mark.train
def test_a_local_job_that_fails_leaves_no_tier_files(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())))
    shm = tmp_path / "shm"
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--run-dir", str(tmp_path / "run"),
                  "trainers.tasks.classifier", "--steps", "40", "--ckpt-every", "200", "--local-ckpt-every", "5",
                  cwd=REPO, timeout=600,
                  env={"HPCJOBS_HOME": str(tmp_path / "home"), "HPCJOBS_LOCAL_CKPT_DIR": str(shm),
                       "HPCJOBS_FAULT_INJECT": "step@22:1", "HPCJOBS_FAULT_ACTION": "raise"})
    assert out.returncode != 0, out.stderr[-2000:]
    assert "InjectedFault: injected at step@22" in (tmp_path / "run" / "final.json").read_text()
    assert shm.is_dir() and list(shm.iterdir()) == [], list(shm.rglob("*"))
