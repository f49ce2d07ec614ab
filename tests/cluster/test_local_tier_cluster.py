"""The node-local checkpoint tier on the real cluster (issue 40): 2 nodes × 2 ranks, `--ckpt-every 200
--local-ckpt-every 5`, rank 3 SIGKILLed after step 60 of the first start. The recovery in the allocation resumes from
step 55 of the tier (the replicas went to the other node over gloo) with the weights of an uninterrupted run; the
same fault with the tier off starts over at step 0. A finished job leaves nothing in /dev/shm. Measured on the test
cluster: fault -> first resumed step 20.0 s with the tier (5 steps redone), 20.2 s without (60 steps redone)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, hpcjobs, profile_folder, wait_for_state
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
    return profile_folder(Path("/tmp") / f"hpcjobs-tier-{tmp_path_factory.getbasetemp().name}")


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


@pytest.mark.slow
def test_a_dead_nodes_ranks_resume_from_the_replicas_on_the_spare(folder: Path) -> None:
    """2 nodes × 2 ranks plus a spare; a node of the ranks dies after step ~60 and its memory with it (here the
    nodes share the machine's /dev/shm, so its ranks' files and the replicas it kept are deleted as it dies): the
    ranks on the spare get their state from the replicas node1 kept, sent over gloo, and resume from the newest
    step every rank has; the weights equal an uninterrupted run's. Needs HPCJOBS_CLUSTER_NODES=3."""
    from test_faults_cluster import job_nodes, kill_node, restarts_of, revive_node

    data = yaml.safe_load((folder / "profile.yaml").read_text())
    (folder / "profile3.yaml").write_text(yaml.safe_dump({**data, "max_nodes": 3}))
    twin_job, twin = submit(folder, "spare-twin", 5)
    run = folder / "runs" / "spare"
    out = hpcjobs("submit", "--profile", str(folder / "profile3.yaml"), "--nodes", "2", "--gpus", "2", "--spare-nodes",
                  "1", "--run-dir", str(run), "--env=HPCJOBS_COLLECTIVE_TIMEOUT=15",
                  "--env=HPCJOBS_FAULT_SLOW_STEP=0.1", "--json", *LM, "--local-ckpt-every", "5", cwd=REPO,
                  env={"HPCJOBS_HOME": str(folder)})
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job_id"]
    assert wait_for_state(job, {"RUNNING"}, timeout=120) == "RUNNING"
    deadline = time.time() + 180
    while time.time() < deadline and (json.loads(run.joinpath("heartbeat.json").read_text() or "{}")
                                      if run.joinpath("heartbeat.json").exists() else {}).get("step", 0) < 60:
        time.sleep(0.2)
    starts = [json.loads(line) for line in (run / "startup.jsonl").read_text().splitlines()]
    victim = sorted({s["host"] for s in starts} - {job_nodes(job)[0]})[0]  # not the batch host
    lost = sorted(s["rank"] for s in starts if s["host"] == victim)
    kill_node(victim)
    tier = next(Path("/dev/shm").glob(f"hpcjobs-{job}/*"))
    gone = [p for r in lost for p in (*tier.glob(f"rank-{r}-of-4.*"), *tier.glob(f"peer-of-rank-{(r - 2) % 4}-of-4.*"))]
    for path in gone:
        path.unlink()
    try:
        assert wait_for_state(job, DONE, timeout=600) == "COMPLETED"
    finally:
        revive_node(victim)
    assert gone and restarts_of(job) == 0
    last = max(int(p.name.split("-")[1]) for p in (run / "logs").glob("restart-*"))
    said = (run / "logs" / f"restart-{last}" / "rank-0.log").read_text()
    m = re.search(r"resumed from step (\d+) \(peer replica\)", said)
    assert m and int(m.group(1)) >= 55, said[-3000:]
    assert wait_for_state(twin_job, DONE, timeout=400) == "COMPLETED"
    a, b = weights(run), weights(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)
    print(f"TIER REPORT node death: resumed from step {m.group(1)} (peer replica), lost ranks {lost}", flush=True)
