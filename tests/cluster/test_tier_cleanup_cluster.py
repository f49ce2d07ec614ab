"""A failed job's node-local tier is removed on every node (issue 40; trainers/recover.py's remove_tier), on the real
cluster: 2 nodes × 2 ranks, `--local-ckpt-every 5`, rank 3's task raising after step 30 (its own error: never
recovered, the job ends failed). Its ranks are killed by srun before they could remove their files; the batch step's
`srun --overlap … rm -rf` step removes /dev/shm/hpcjobs-JOB on both nodes (the test nodes share this machine's
/dev/shm, so the folder's absence is checked here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs, profile_folder, wait_for_state

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
LM = ["trainers.tasks.lm", "--size", "tiny", "--steps", "100", "--log-every", "5", "--ckpt-every", "200",
      "--local-ckpt-every", "5"]


def test_a_failed_jobs_tier_files_are_removed_on_every_node(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = profile_folder(Path("/tmp") / f"hpcjobs-tierclean-{tmp_path_factory.getbasetemp().name}")
    run = folder / "runs" / "failed"
    out = hpcjobs("submit", "--profile", str(folder / "profile.yaml"), "--nodes", "2", "--gpus", "2", "--run-dir",
                  str(run), "--env=HPCJOBS_FAULT_INJECT=step@30:3", "--env=HPCJOBS_FAULT_ACTION=raise", "--json", *LM,
                  cwd=REPO, env={"HPCJOBS_HOME": str(folder)})
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job_id"]
    assert wait_for_state(job, DONE, timeout=600) == "FAILED", job
    final = json.loads((run / "final.json").read_text())
    assert final["state"] == "failed" and "InjectedFault" in final["reason"], final
    assert not Path(f"/dev/shm/hpcjobs-{job}").exists(), list(Path(f"/dev/shm/hpcjobs-{job}").rglob("*"))
