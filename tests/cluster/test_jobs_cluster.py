"""Following jobs after submit (issue 6) on the real cluster, once with accounting (sacct) and once with the cluster
restarted without it: status, list, logs and cancel for running, completed, failed, cancelled and requeued jobs;
concurrent submits from two shells; the restart cap and crashing jobs (issue 5)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TESTCLUSTER, hpcjobs, wait_for_state

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def restart_cluster(accounting: bool) -> None:
    env = {**os.environ, "HPCJOBS_CLUSTER_ACCOUNTING": "1" if accounting else "0"}
    subprocess.run([str(TESTCLUSTER), "restart"], check=True, env=env, capture_output=True)


@pytest.fixture(scope="module", params=["with-sacct", "without-sacct"])
def accounting(request: pytest.FixtureRequest) -> Iterator[bool]:
    on = request.param == "with-sacct"
    if not on:
        request.addfinalizer(lambda: restart_cluster(True))  # also when the switch itself fails
        restart_cluster(False)
    sacct = subprocess.run(["sacct", "-n", "-X"], capture_output=True, text=True)
    assert (sacct.returncode == 0) == on, sacct.stderr
    yield on


@pytest.fixture(scope="module")
def jobs(accounting: bool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    folder = Path(f"/tmp/hpcjobs-jobs-{os.getpid()}-{int(accounting)}")
    folder.mkdir(exist_ok=True)
    folder.chmod(0o755)
    home = folder / "home"  # this module's own job store
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(folder / "runs")
    profile = folder / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    crash = folder / "crash.py"
    crash.write_text("import os\nprint('about to fail on rank', os.environ['RANK'], flush=True)\n"
                     "raise SystemExit('deliberate failure')\n")

    def submit(*entry: str, nodes: str = "1", gpus: str = "1") -> str:
        out = hpcjobs("submit", "--profile", str(profile), "--nodes", nodes, "--gpus", gpus, "--json", *entry,
                      cwd=REPO, env={"HPCJOBS_HOME": str(home)})
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["job_id"]

    # ~60 steps/s here: the requeue lands a few hundred steps in, and the restart's ~30 s are all the fixture waits.
    requeued = 2000
    long = ("trainers.tasks.classifier", "--steps", "1000000", "--log-every", "20", "--ckpt-every", "0")
    ids = {
        "completed": submit("trainers.tasks.classifier", "--steps", "30", "--log-every", "10"),
        "failed": submit(str(crash)),
        "running": submit(*long),
        "cancelled": submit(*long),
        "requeued": submit("trainers.tasks.classifier", "--steps", str(requeued), "--log-every", "20",
                           nodes="2"),
    }
    for key in ("completed", "failed"):
        wait_for_state(ids[key], DONE)
    for key in ("running", "cancelled", "requeued"):
        wait_for_state(ids[key], {"RUNNING"})
        wait_for_heartbeat(home, ids[key])
    subprocess.run(["scontrol", "requeue", ids["requeued"]], check=True)
    out = hpcjobs("cancel", ids["cancelled"], env={"HPCJOBS_HOME": str(home)})
    assert out.returncode == 0 and "cancelled" in out.stdout, out.stderr
    wait_for_hpcjobs_state(home, ids["cancelled"], "CANCELLED")
    wait_for_hpcjobs_state(home, ids["requeued"], "COMPLETED", timeout=300)
    yield {**ids, "home": str(home), "requeued_steps": str(requeued)}
    subprocess.run(["scancel", ids["running"]], capture_output=True)


def wait_for_hpcjobs_state(home: Path, job: str, state: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    seen = ""
    while time.time() < deadline:
        seen = json.loads(hpcjobs("status", job, "--json", env={"HPCJOBS_HOME": str(home)}).stdout)["state"]
        if seen == state:
            return
        time.sleep(1)
    raise AssertionError(f"job {job} is {seen}, not {state}, after {timeout} s")


def wait_for_heartbeat(home: Path, job: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = json.loads(hpcjobs("status", job, "--json", env={"HPCJOBS_HOME": str(home)}).stdout)
        if st["last_step"]:
            return
        time.sleep(1)
    raise AssertionError(f"job {job} never wrote a heartbeat")


def status(jobs: dict[str, str], key: str) -> dict:
    out = hpcjobs("status", jobs[key], "--json", env={"HPCJOBS_HOME": jobs["home"]})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_completed(jobs: dict[str, str], accounting: bool) -> None:
    st = status(jobs, "completed")
    assert st["state"] == "COMPLETED" and st["last_step"] == 30 and st["restarts"] == 0
    # squeue keeps finished jobs for MinJobAge; after that sacct, or without accounting the run folder, answers.
    assert st["state_source"] in ("squeue", "sacct" if accounting else "run folder")


def test_failed_job_is_failed_with_its_reason_and_not_requeued(jobs: dict[str, str]) -> None:
    st = status(jobs, "failed")
    assert st["state"] == "FAILED" and st["restarts"] == 0
    assert "exited with code 1" in (st["final_reason"] or "") or "deliberate" in (st["final_reason"] or "")
    out = hpcjobs("logs", jobs["failed"], env={"HPCJOBS_HOME": jobs["home"]})
    assert "deliberate failure" in out.stdout


def test_running(jobs: dict[str, str]) -> None:
    first = status(jobs, "running")
    assert first["state"] == "RUNNING" and first["state_source"] == "squeue" and first["last_step"] > 0
    assert first["last_step_age_s"] < 60
    out = hpcjobs("logs", jobs["running"], "--rank", "0", env={"HPCJOBS_HOME": jobs["home"]})
    assert "[hpcjobs rank 0] step" in out.stdout


def test_cancelled_and_cancel_again_is_a_no_op(jobs: dict[str, str]) -> None:
    assert status(jobs, "cancelled")["state"] == "CANCELLED"
    out = hpcjobs("cancel", jobs["cancelled"], env={"HPCJOBS_HOME": jobs["home"]})
    assert out.returncode == 0 and "already ended (CANCELLED); nothing to cancel" in out.stdout


def test_requeued_job_shows_its_restart_and_keeps_each_restarts_logs(jobs: dict[str, str]) -> None:
    st = status(jobs, "requeued")
    assert st["state"] == "COMPLETED" and st["restarts"] == 1 and st["last_step"] == int(jobs["requeued_steps"])
    home = {"HPCJOBS_HOME": jobs["home"]}
    first = hpcjobs("logs", jobs["requeued"], "--restart", "0", "--rank", "1", env=home).stdout
    second = hpcjobs("logs", jobs["requeued"], "--restart", "1", "--rank", "1", env=home).stdout
    assert "restart 0" in first and "restart 1" in second and first != second
    latest = hpcjobs("logs", jobs["requeued"], env=home).stdout
    assert "resumed from" in latest and f"finished at step {jobs['requeued_steps']}" in latest


def test_list_table_filters_and_json(jobs: dict[str, str]) -> None:
    home = {"HPCJOBS_HOME": jobs["home"]}
    rows = json.loads(hpcjobs("list", "--json", env=home).stdout)
    states = {r["job_id"]: r["state"] for r in rows}
    assert states[jobs["completed"]] == "COMPLETED" and states[jobs["failed"]] == "FAILED"
    assert states[jobs["running"]] == "RUNNING" and states[jobs["cancelled"]] == "CANCELLED"
    running = json.loads(hpcjobs("list", "--json", "--state", "running", env=home).stdout)
    assert [r["job_id"] for r in running] == [jobs["running"]]
    assert json.loads(hpcjobs("list", "--json", "--profile", "nope", env=home).stdout) == []
    table = hpcjobs("list", env=home).stdout
    assert table.splitlines()[0].split() == ["job", "name", "profile", "nodes×gpus", "state", "restarts", "step",
                                             "age"]
    assert len(table.splitlines()) == 1 + len(rows)


def test_unknown_job_is_a_one_line_error(jobs: dict[str, str]) -> None:
    for cmd in (["status", "999999"], ["logs", "999999"], ["cancel", "999999"]):
        out = hpcjobs(*cmd, env={"HPCJOBS_HOME": jobs["home"]})
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
        assert "no job '999999'" in out.stderr and "HINT:" in out.stderr


def test_logs_of_a_missing_rank_says_what_exists(jobs: dict[str, str]) -> None:
    out = hpcjobs("logs", jobs["completed"], "--rank", "7", env={"HPCJOBS_HOME": jobs["home"]})
    assert out.returncode == 2 and "ranks of that restart: 0" in out.stderr


def test_two_shells_submitting_at_once_lose_no_record(shared_tmp: Path, cluster_profile: Path) -> None:
    script = shared_tmp / "noop.py"
    script.write_text("print('ok')\n")
    home = {"HPCJOBS_HOME": str(shared_tmp / "home")}

    def shell(n: int) -> list[str]:
        ids = []
        for _ in range(n):
            out = hpcjobs("submit", "--profile", str(cluster_profile), "--gpus", "1", "--json", str(script),
                          cwd=shared_tmp, env=home)
            assert out.returncode == 0, out.stderr
            ids.append(json.loads(out.stdout)["job_id"])
        return ids

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(shell, [4, 4])
    listed = {r["job_id"] for r in json.loads(hpcjobs("list", "--json", "--limit", "100", env=home).stdout)}
    assert listed == set(a) | set(b) and len(listed) == 8


def test_restart_cap_ends_the_job_failed(shared_tmp: Path) -> None:
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(shared_tmp / "runs")
    data["preemption"]["max_restarts"] = 1
    profile = shared_tmp / "cap.yaml"
    profile.write_text(yaml.safe_dump(data))
    run = shared_tmp / "run"
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--json", "--run-dir", str(run),
                  "trainers.tasks.classifier", "--steps", "1000000", "--log-every", "10", cwd=REPO)
    job = json.loads(out.stdout)["job_id"]
    for restart in (0, 1):
        wait_for_state(job, {"RUNNING"})
        deadline = time.time() + 120
        log = run / "logs" / f"restart-{restart}" / "rank-0.log"
        while not log.exists() or "| loss" not in log.read_text():  # training, not just starting
            assert time.time() < deadline
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        if restart == 0:
            deadline = time.time() + 120
            while not (run / "logs" / "restart-1").exists():
                assert time.time() < deadline, "not requeued"
                time.sleep(0.5)
    assert wait_for_state(job, DONE) == "FAILED"
    last = (run / "logs" / "restart-1" / "rank-0.log").read_text().strip().splitlines()
    assert any("restart cap 1 reached, not requeuing. The job ends failed." in ln for ln in last[-3:]), last[-3:]
    assert json.loads((run / "final.json").read_text())["state"] == "failed"
