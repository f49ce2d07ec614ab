"""The submit side against the real cluster: submitit submission, rendered scripts under plain sbatch, the wheel."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs, slurm, wait_for_state

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def rank_hosts(run_dir: Path, restart: int = 0) -> dict[int, str]:
    """rank → host, from each rank's first log line."""
    hosts = {}
    for log in (run_dir / "logs" / f"restart-{restart}").glob("rank-*.log"):
        m = re.search(r"hpcjobs: rank (\d+)/(\d+) \(local \d+\) on (\S+),", log.read_text())
        assert m, log.read_text()[:500]
        hosts[int(m.group(1))] = m.group(3)
    return hosts


def test_literal_two_by_eight_submit_completes_across_both_nodes() -> None:
    """The README's command, as typed, with the shipped test-cluster profile."""
    out = hpcjobs("submit", "--profile", "testcluster", "--nodes", "2", "--gpus", "8", "--json",
                  "trainers.tasks.lm", "--size", "tiny", "--steps", "20", "--log-every", "5", cwd=REPO)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    run = Path(rec["run_dir"])
    try:
        assert rec["world"] == "2 nodes × 8 GPUs = 16 ranks" and rec["job_id"].isdigit()
        assert wait_for_state(rec["job_id"], DONE) == "COMPLETED"
        hosts = rank_hosts(run)
        assert sorted(hosts) == list(range(16))
        assert set(hosts.values()) == {"node1", "node2"}
        log0 = (run / "logs" / "restart-0" / "rank-0.log").read_text()
        assert "16 rank(s), ddp, gloo on cpu" in log0 and "finished at step 20" in log0
        assert json.loads((run / "final.json").read_text())["state"] == "finished"
        status = json.loads(hpcjobs("status", rec["job_id"], "--json").stdout)
        assert status["state"] == "COMPLETED" and status["last_step"] == 20
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_rendered_script_passes_test_only_and_runs_under_plain_sbatch(cluster_profile: Path,
                                                                        shared_tmp: Path) -> None:
    script = shared_tmp / "job.sbatch"
    out = hpcjobs("render", "--profile", str(cluster_profile), "--nodes", "2", "--gpus", "4", "-o", str(script),
                  "trainers.tasks.lm", "--size", "tiny", "--steps", "15", "--log-every", "5", cwd=REPO)
    assert out.returncode == 0, out.stderr
    subprocess.run(["bash", "-n", str(script)], check=True)
    test_only = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
    assert test_only.returncode == 0 and "to start at" in test_only.stderr, test_only.stderr
    job = slurm("sbatch", "--parsable", str(script)).strip()
    assert wait_for_state(job, DONE) == "COMPLETED"
    runs = [p for p in (shared_tmp / "runs").glob(f"lm-*-{job}")]
    assert len(runs) == 1, list((shared_tmp / "runs").iterdir())
    hosts = rank_hosts(runs[0])
    assert sorted(hosts) == list(range(8)) and set(hosts.values()) == {"node1", "node2"}
    assert "finished at step 15" in (runs[0] / "logs" / "restart-0" / "rank-0.log").read_text()
    slurm_log = shared_tmp / "runs" / "slurm-logs" / f"lm-{job}.out"
    assert f"hpcjobs: job {job} restart 0 on node[1-2], rendezvous node1:" in slurm_log.read_text()


def test_user_script_gets_the_same_environment(cluster_profile: Path, shared_tmp: Path) -> None:
    """Script mode: a plain torchrun-style script sees RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* and the NCCL vars."""
    script = shared_tmp / "train.py"
    script.write_text(
        "import os, sys, json\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'NCCL_DEBUG']\n"
        "print('ENV', json.dumps({k: os.environ.get(k) for k in keys}), 'ARGS', json.dumps(sys.argv[1:]))\n"
        "dist.destroy_process_group()\n")
    out = hpcjobs("submit", "--profile", str(cluster_profile), "--nodes", "2", "--gpus", "2", "--json",
                  str(script), "--config", "configs/x y.yaml", cwd=shared_tmp)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert wait_for_state(rec["job_id"], DONE) == "COMPLETED"
    seen = []
    for log in (Path(rec["run_dir"]) / "logs" / "restart-0").glob("rank-*.log"):
        line = next(ln for ln in log.read_text().splitlines() if ln.startswith("ENV "))
        env_json, args_json = line[4:].split(" ARGS ")
        seen.append(json.loads(env_json))
        assert json.loads(args_json) == ["--config", "configs/x y.yaml"]
    assert sorted(int(e["RANK"]) for e in seen) == [0, 1, 2, 3]
    assert {e["MASTER_ADDR"] for e in seen} == {"node1"} and {e["NCCL_DEBUG"] for e in seen} == {"WARN"}
    assert {e["WORLD_SIZE"] for e in seen} == {"4"} and {e["LOCAL_RANK"] for e in seen} == {"0", "1"}


def test_wheel_in_a_fresh_venv_outside_the_repo_renders_and_submits(shared_tmp: Path) -> None:
    """tests/run_all.sh builds the wheel and installs it (torch first) in a fresh venv outside the repo."""
    venv = Path(os.environ.get("HPCJOBS_WHEEL_VENV", "/nonexistent"))
    if not (venv / "bin" / "hpcjobs").exists():
        pytest.fail(f"no wheel venv at {venv}: run the tests through tests/run_all.sh, which builds it")
    work = shared_tmp / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HPCJOBS_RUNS": ""}
    env.pop("PYTHONPATH", None)
    cli = str(venv / "bin" / "hpcjobs")
    listing = subprocess.run([cli, "profiles"], capture_output=True, text=True, cwd=work, env=env).stdout
    assert re.search(r"testcluster\s+shipped\s+\S*site-packages/hpcjobs/_data/cluster_profiles", listing), listing
    script = work / "job.sbatch"
    r = subprocess.run([cli, "render", "--profile", "testcluster", "--nodes", "2", "--gpus", "1", "-o", str(script),
                        "--run-dir", str(work / "rendered-%j"), "trainers.tasks.classifier", "--steps", "5"],
                       capture_output=True, text=True, cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert str(venv / "bin" / "python") in script.read_text()
    s = subprocess.run([cli, "submit", "--profile", "testcluster", "--nodes", "2", "--gpus", "1", "--json",
                        "--run-dir", str(work / "submitted"), "trainers.tasks.classifier", "--steps", "5"],
                       capture_output=True, text=True, cwd=work, env=env)
    assert s.returncode == 0, s.stderr
    assert wait_for_state(json.loads(s.stdout)["job_id"], DONE) == "COMPLETED"
    assert "finished at step 5" in (work / "submitted" / "logs" / "restart-0" / "rank-0.log").read_text()
    imported = (work / "submitted" / "logs" / "restart-0" / "rank-0.log").read_text()
    assert "Traceback" not in imported


def test_pattern_run_dir_from_inside_an_allocation_is_followed_by_status_and_logs(cluster_profile: Path,
                                                                                   shared_tmp: Path) -> None:
    """`--run-dir 'runs/x-%j'` is the job's real folder (it used to be a literal `x-%j`), and an outer job's
    variables in the submitting shell (here, as inside an allocation; SBATCH_TIMELIMIT would even override the
    script's --time) reach neither sbatch nor the ranks."""
    outer = {"SLURM_JOB_ID": "999999", "SLURM_PROCID": "5", "SLURM_NTASKS": "9", "SLURM_NNODES": "3",
             "SBATCH_TIMELIMIT": "1", "SLURM_RESTART_COUNT": "7"}
    out = hpcjobs("submit", "--profile", str(cluster_profile), "--nodes", "2", "--gpus", "2", "--time", "20:00",
                  "--run-dir", str(shared_tmp / "runs" / "x-%j"), "--json", "trainers.tasks.lm", "--size", "tiny",
                  "--steps", "10", "--log-every", "5", cwd=REPO, env=outer)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["run_dir"] == str(shared_tmp / "runs" / f"x-{rec['job_id']}")
    assert wait_for_state(rec["job_id"], DONE) == "COMPLETED"
    assert not list(shared_tmp.rglob("*%j*"))
    fields = slurm("scontrol", "show", "job", "-o", rec["job_id"])
    assert "TimeLimit=00:20:00" in fields and "Restarts=0" in fields
    hosts = rank_hosts(Path(rec["run_dir"]))
    assert sorted(hosts) == [0, 1, 2, 3] and set(hosts.values()) == {"node1", "node2"}
    status = json.loads(hpcjobs("status", rec["job_id"], "--json").stdout)
    assert status["state"] == "COMPLETED" and status["run_dir"] == rec["run_dir"] and status["last_step"] == 10
    assert "finished at step 10" in hpcjobs("logs", rec["job_id"]).stdout
