"""Sweeps as Slurm job arrays and code snapshots, on the real test cluster (issue 14).

- A 6-point sweep (`--sweep lr=... --sweep log-every=...`, `--max-parallel 2`) through `hpcjobs submit`: every task
  COMPLETED in its own run folder with its own point and metrics; one task is stopped mid-run by the profile's signal
  (sent to that task alone), requeues itself (that task only: the others start once each) and ends bit-identical to
  its twin that differs only in how often it logs. `hpcjobs status/compare --plot` read the sweep's results.
- A rendered array script run with plain sbatch: each task trains its own point.
- Snapshots on both paths: the code is edited after submitting, the job is stopped and requeued, and every start ran
  the submitted code.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, hpcjobs, slurm, wait_for_state, wait_for_step
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEPS = 600
TASK = ["trainers.tasks.lm", "--size", "tiny", "--seed", "5", "--steps", str(STEPS), "--ckpt-every", "100"]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == STEPS, (run, ref)
    return model_weights(ref)


def starts(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines()]


def signal_task(task: str) -> None:
    """The profile's stop signal to one array task. Slurm 22.05 delivers `scancel --signal=USR2 A_N` at once, then
    answers "Job can not be altered now, try again later" (slurmctld.log), and scancel retries for as long as the
    task runs (it sends the signal again each time): let it send once, then stop it."""
    proc = subprocess.Popen(["scancel", "--signal=USR2", task])
    try:
        proc.wait(timeout=4)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_array(array_id: str, tasks: int, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while True:
        out = hpcjobs("status", array_id, "--json")
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        if len(status["tasks"]) == tasks and all(t["state"] in DONE for t in status["tasks"]):
            return status
        assert time.time() < deadline, status
        time.sleep(2)


def test_sweep_of_six_points_two_at_once_one_task_stopped(cluster_profile: Path, shared_tmp: Path) -> None:
    out = hpcjobs("submit", "--profile", str(cluster_profile), "--gpus", "1", "--time", "20:00", "--json",
                  "--sweep", "lr=1e-3,3e-4,1e-4", "--sweep", "log-every=10,20", "--max-parallel", "2", *TASK,
                  cwd=REPO)
    assert out.returncode == 0, out.stderr
    sub = json.loads(out.stdout)
    array = sub["job_id"]
    tasks = {t["task"]: Path(t["run_dir"]) for t in sub["tasks"]}
    assert sorted(tasks) == list(range(6)) and len(set(tasks.values())) == 6
    assert "ArrayTaskThrottle=2" in slurm("scontrol", "show", "job", array)
    wait_for_step(tasks[0], 150, timeout=300)
    signal_task(f"{array}_0")  # task 0 only: lr=1e-3, log every 10
    status = wait_array(array, 6)
    assert [t["state"] for t in status["tasks"]] == ["COMPLETED"] * 6, status
    for i, (lr, every) in enumerate((lr, e) for lr in ("1e-3", "3e-4", "1e-4") for e in ("10", "20")):
        run = tasks[i]
        assert json.loads((run / "spec.json").read_text())["point"] == {"lr": lr, "log-every": every}
        assert starts(run)[0]["point"] == {"lr": lr, "log-every": every}
        assert f"lr {float(lr):g} ×" in (run / "logs" / "restart-0" / "rank-0.log").read_text()
        logged = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
        stops = {r["step"] for r in starts(run) if "stopped" in r}  # a stop logs the steps since the last log too
        assert logged and all(s % int(every) == 0 or s in stops for s in logged) and max(logged) == STEPS
        if i:  # untouched by task 0's stop: one start each
            assert [r for r in starts(run) if "stopped" in r] == [] and len(starts(run)) == 1, (i, starts(run))
    ports = [starts(tasks[i])[0]["master"].rsplit(":", 1)[1] for i in range(6)]
    assert len(set(ports)) == 6, ports  # each task its own rendezvous port (two share a node at once)
    stopped = starts(tasks[0])
    assert [r.get("stopped") for r in stopped if "stopped" in r] and len(stopped) >= 3, stopped
    stopped_w, twin_w, other_w = (final_weights(tasks[i]) for i in (0, 1, 2))
    for name, value in stopped_w.items():  # the stopped task resumed exactly: as its twin trained
        assert torch.equal(value, twin_w[name]), name
    assert any(not torch.equal(v, other_w[k]) for k, v in stopped_w.items())  # another lr trains otherwise
    plot = shared_tmp / "loss.png"
    compared = hpcjobs("compare", array, "--plot", str(plot))
    assert compared.returncode == 0, compared.stderr
    assert compared.stdout.count("COMPLETED") == 6 and "1e-4" in compared.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    one = hpcjobs("status", f"{array}_0")
    assert one.returncode == 0 and "restarts:    1" in one.stdout, one.stdout


def test_rendered_array_with_plain_sbatch(cluster_profile: Path, shared_tmp: Path) -> None:
    script = shared_tmp / "sweep.sbatch"
    out = hpcjobs("render", "--profile", str(cluster_profile), "--gpus", "1", "--time", "10:00", "-o", str(script),
                  "--sweep", "seed=1,2", "trainers.tasks.classifier", "--steps", "20", "--log-every", "5", cwd=REPO)
    assert out.returncode == 0, out.stderr
    array = slurm("sbatch", "--parsable", str(script)).strip()
    for i in range(2):
        assert wait_for_state(f"{array}_{i}", DONE, timeout=300) == "COMPLETED"
    runs = sorted(shared_tmp.glob(f"runs/*-{array}_[01]"))
    assert [r.name[-len(array) - 2:] for r in runs] == [f"{array}_0", f"{array}_1"]
    assert [starts(r)[0]["point"] for r in runs] == [{"seed": "1"}, {"seed": "2"}]
    assert runs[0].joinpath("metrics.jsonl").read_text() != runs[1].joinpath("metrics.jsonl").read_text()
    found = hpcjobs("status", f"{array}_1", "--json")  # not in the job store: found by its comment
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["run_dir"] == str(runs[1])


PROJECT_TASK = """import marker
from trainers.tasks.lm import make_task as lm_task


def make_task(args):
    print(f"SNAPSHOT-CODE {marker.VERSION}", flush=True)
    return lm_task(args)
"""


@pytest.mark.parametrize("path", ["submit", "sbatch"])
def test_a_restart_runs_the_submitted_code(path: str, cluster_profile: Path, shared_tmp: Path) -> None:
    project = shared_tmp / "project"
    project.mkdir()
    (project / "mytask.py").write_text(PROJECT_TASK)
    (project / "marker.py").write_text("VERSION = 'A'\n")
    for argv in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a"]):
        subprocess.run(["git", *argv], cwd=project, check=True)
    run = shared_tmp / "runs" / "snap"
    common = ["--profile", str(cluster_profile), "--gpus", "1", "--time", "10:00", "--run-dir", str(run)]
    args = ["mytask", "--size", "tiny", "--steps", str(STEPS), "--ckpt-every", "100"]
    if path == "submit":
        out = hpcjobs("submit", *common, "--json", *args, cwd=project)
        assert out.returncode == 0, out.stderr
        job = json.loads(out.stdout)["job_id"]
    else:
        script = shared_tmp / "snap.sbatch"
        out = hpcjobs("render", *common, "-o", str(script), *args, cwd=project)
        assert out.returncode == 0, out.stderr
        job = slurm("sbatch", "--parsable", str(script)).strip()
    (project / "marker.py").write_text("VERSION = 'B'\n")  # edited after submitting: must never run
    wait_for_step(run, 150, timeout=300)
    slurm("scancel", "--signal=USR2", job)
    assert wait_for_state(job, DONE, timeout=300) == "COMPLETED"
    logs = sorted(run.glob("logs/restart-*/rank-0.log"))
    assert len(logs) >= 2, logs
    for log in logs:
        text = log.read_text()
        assert "SNAPSHOT-CODE A" in text and "SNAPSHOT-CODE B" not in text, log
    if path == "submit":
        snap = json.loads((run / "spec.json").read_text())["snapshot"]
        assert snap["git_commit"] and not snap["git_dirty"] and snap["folder"].startswith(str(shared_tmp))
