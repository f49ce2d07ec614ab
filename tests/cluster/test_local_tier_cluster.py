"""The node-local checkpoint tier on the real cluster (issue 40): 2 nodes × 2 ranks, `--ckpt-every 200
--local-ckpt-every 5`, rank 3 SIGKILLed after step 60 of the first start. The recovery in the allocation resumes from
step 55 of the tier (the replicas went to the other node over gloo) with the weights of an uninterrupted run; the
same fault with the tier off starts over at step 0. A finished job leaves nothing in /dev/shm. Measured on the test
cluster: fault -> first resumed step 20.0 s with the tier (5 steps redone), 20.2 s without (60 steps redone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, hpcjobs, wait_for_state
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
LM = ["trainers.tasks.lm", "--size", "tiny", "--steps", "100", "--log-every", "5", "--ckpt-every", "200"]
KILL = ["HPCJOBS_FAULT_INJECT=step@60:3", "HPCJOBS_FAULT_RESTART=0", "HPCJOBS_COLLECTIVE_TIMEOUT=15"]


def submit(folder: Path, name: str, tier: int, *env: str) -> tuple[str, Path]:
    run = folder / "runs" / name
    out = hpcjobs("submit", "--profile", str(folder / "profile.yaml"), "--nodes", "2", "--gpus", "2",
                  "--run-dir", str(run), *(f"--env={e}" for e in env), "--json", *LM, "--local-ckpt-every", str(tier),
                  cwd=REPO, env={"HPCJOBS_HOME": str(folder)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["job_id"], run


def weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == 100, ref
    return model_weights(ref)


@pytest.fixture
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path("/tmp") / f"hpcjobs-tier-{tmp_path_factory.getbasetemp().name}"
    path.mkdir(exist_ok=True)
    path.chmod(0o755)
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(path / "runs")
    (path / "profile.yaml").write_text(yaml.safe_dump(data))
    return path


def test_a_killed_rank_resumes_from_the_local_tier_in_the_allocation(folder: Path) -> None:
    twin_job, twin = submit(folder, "twin", 5)
    job, run = submit(folder, "killed", 5, *KILL)
    off_job, off = submit(folder, "killed-tier-off", 0, *KILL)
    for j in (job, twin_job, off_job):
        assert wait_for_state(j, DONE, timeout=600) == "COMPLETED", j
    resumed = (run / "logs" / "restart-1" / "rank-0.log").read_text()
    assert "resumed from step 55 (local tier)" in resumed, resumed[-2000:]
    assert "starting at step 0" in (off / "logs" / "restart-1" / "rank-0.log").read_text()
    a, b = weights(run), weights(twin)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    starts = [json.loads(line) for line in (run / "startup.jsonl").read_text().splitlines()]
    assert {s["resumed_tier"] for s in starts if s["start_step"] == 55} == {"local tier"}, starts
    assert not list(Path("/dev/shm").glob(f"hpcjobs-{job}/*/*.pt")), "a finished job leaves no tier files"
