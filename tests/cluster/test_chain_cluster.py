"""A chain on the real test cluster (issue 29 item 2): train → eval → export queued at once by `hpcjobs submit
--chain`; the training job is stopped by its signal twice, requeues itself each time, and its dependents wait in the
queue through both requeues; eval starts only once training COMPLETED, export once eval did. A step whose upstream
failed is never started (Slurm cancels it: --kill-on-invalid-dep) and `status` says why."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import hpcjobs, slurm, wait_for_state, wait_for_step

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEP = "import json, os, sys, time\n" \
       "if os.environ['RANK'] == '0':\n" \
       "    with open(sys.argv[1], 'a') as f:\n" \
       "        f.write(json.dumps({'step': sys.argv[2], 'time': time.time()}) + '\\n')\n" \
       "sys.exit(int(sys.argv[3]) if len(sys.argv) > 3 else 0)\n"


def restarts(job: str) -> int:
    fields = dict(f.split("=", 1) for f in slurm("scontrol", "show", "job", "-o", job).split() if "=" in f)
    return int(fields["Restarts"])


def squeue_state(job: str) -> str:
    return slurm("squeue", "-h", "-t", "all", "-j", job, "-o", "%T", check=False).strip()


def stop_and_wait_for_requeue(train: str, run: Path, eval_job: str, count: int) -> None:
    """The profile's signal to the training job; it saves, requeues itself and trains again. Its dependent stays
    PENDING all the while."""
    subprocess.run(["scancel", "--signal=USR2", train], check=True)
    deadline = time.time() + 240
    while restarts(train) < count:
        assert squeue_state(eval_job) == "PENDING", "the dependent started while its upstream was requeued"
        assert time.time() < deadline, "the training job did not requeue itself"
        time.sleep(0.5)
    log = run / "logs" / f"restart-{count}" / "rank-0.log"
    deadline = time.time() + 240
    while not (log.exists() and "step " in log.read_text()):
        assert squeue_state(eval_job) == "PENDING"
        assert time.time() < deadline, f"restart {count} never trained"
        time.sleep(0.5)


def test_a_chain_waits_through_two_requeues_and_never_starts_after_a_failure(cluster_profile: Path,
                                                                            shared_tmp: Path) -> None:
    (shared_tmp / "step.py").write_text(STEP)
    marks, runs, p = shared_tmp / "marks.jsonl", shared_tmp / "runs", str(cluster_profile)
    one = f"--profile {p} --nodes 1 --gpus 1 --time 10:00 --no-snapshot"
    (shared_tmp / "chain.yaml").write_text(
        f"train:\n  submit: --profile {p} --nodes 2 --gpus 1 --time 20:00 --run-dir {runs}/train trainers.tasks.lm "
        "--size tiny --steps 1000 --log-every 10 --ckpt-every 100\n"
        f"eval:\n  after: train\n  submit: {one} --run-dir {runs}/eval step.py {marks} eval\n"
        f"export:\n  after: eval\n  submit: {one} --run-dir {runs}/export step.py {marks} export\n"
        f"broken:\n  submit: {one} --run-dir {runs}/broken step.py {marks} broken 3\n"
        f"after_broken:\n  after: broken\n  submit: {one} --run-dir {runs}/after-broken step.py {marks} nope\n")
    out = hpcjobs("submit", "--chain", "chain.yaml", "--json", cwd=shared_tmp)
    assert out.returncode == 0, out.stderr
    ids = {s["step"]: s["job_id"] for s in json.loads(out.stdout)["steps"]}
    assert all(ids.values()) and len(set(ids.values())) == 5, ids
    assert f"Dependency=afterok:{ids['train']}" in slurm("scontrol", "show", "job", ids["eval"])

    train_run = runs / "train"
    wait_for_step(train_run, 30, timeout=300)
    stop_and_wait_for_requeue(ids["train"], train_run, ids["eval"], 1)
    stop_and_wait_for_requeue(ids["train"], train_run, ids["eval"], 2)
    for step in ("train", "eval", "export"):
        assert wait_for_state(ids[step], DONE, timeout=600) == "COMPLETED", step
    assert wait_for_state(ids["broken"], DONE, timeout=300) == "FAILED"

    done = [json.loads(ln) for ln in marks.read_text().splitlines()]
    assert [d["step"] for d in done] in (["broken", "eval", "export"], ["eval", "broken", "export"],
                                         ["eval", "export", "broken"]), done
    trained = json.loads((train_run / "final.json").read_text())
    by_step = {d["step"]: d["time"] for d in done}
    assert trained["state"] == "finished" and by_step["eval"] > trained["time"] and by_step["export"] > by_step["eval"]
    assert restarts(ids["train"]) == 2
    deadline = time.time() + 120  # Slurm cancels the dependent whose upstream failed (kill-on-invalid-dep)
    while squeue_state(ids["after_broken"]) not in ("", "CANCELLED"):
        assert time.time() < deadline, squeue_state(ids["after_broken"])
        time.sleep(1)
    assert not (runs / "after-broken" / "restarts.jsonl").exists() and "nope" not in marks.read_text()
    status = hpcjobs("status", ids["after_broken"], cwd=shared_tmp)
    assert status.returncode == 0, status.stderr
    assert f"after:       {ids['broken']} (ok): FAILED, " in status.stdout, status.stdout  # why it never ran
    status = hpcjobs("status", ids["export"], cwd=shared_tmp)
    assert f"after:       {ids['eval']} (ok): COMPLETED, met" in status.stdout, status.stdout
