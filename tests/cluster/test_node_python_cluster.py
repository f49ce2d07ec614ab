"""The nodes' Python on the real cluster, both paths: the one the profile's setup puts first on PATH runs the ranks,
and one that cannot import torch ends the job with one line before any rank starts."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, accounted, hpcjobs, slurm, wait_for_state

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
LM = ["trainers.tasks.lm", "--size", "tiny", "--steps", "4", "--log-every", "2"]


def profile_with_setup(cluster_profile: Path, setup: list[str]) -> Path:
    data = yaml.safe_load(cluster_profile.read_text())
    data["setup"] = setup
    path = cluster_profile.with_name("with-setup.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def start(path: str, profile: Path, shared_tmp: Path) -> tuple[str, Path]:
    """Submit (submitit) or render + sbatch 2 nodes × 2 ranks; returns the job id and its run folder."""
    run = shared_tmp / "runs" / f"{path}-run"
    args = ["--profile", str(profile), "--nodes", "2", "--gpus", "2", "--run-dir", str(run)]
    if path == "submit":
        out = hpcjobs("submit", *args, "--json", *LM, cwd=REPO)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["job_id"], run
    script = shared_tmp / "job.sbatch"
    out = hpcjobs("render", *args, "-o", str(script), *LM, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return slurm("sbatch", "--parsable", str(script)).strip(), run


@pytest.mark.parametrize("path", ["submit", "sbatch"])
def test_the_ranks_run_the_python_the_setup_puts_first(path: str, cluster_profile: Path, shared_tmp: Path) -> None:
    env_bin = shared_tmp / "env" / "bin"
    env_bin.mkdir(parents=True)
    used = shared_tmp / "used"
    (env_bin / "python3").write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(used))}\n'
                                     f'exec {shlex.quote(sys.executable)} "$@"\n')
    (env_bin / "python3").chmod(0o755)
    profile = profile_with_setup(cluster_profile, [f"export PATH={env_bin}:$PATH"])
    job, run = start(path, profile, shared_tmp)
    assert wait_for_state(job, DONE) == "COMPLETED"
    calls = used.read_text().splitlines()
    assert "from trainers.versions import torch_problem" in calls[0]  # the check, once, before srun
    assert sum(1 for c in calls if c.startswith("-u -m trainers.launch")) == 4, calls  # every rank
    # and, in the batch script, the recovery that runs their srun step (the rendered script's, or submitit's runner)
    assert sum(1 for c in calls if c.startswith(("-u -m trainers.recover", "-u -m submitit"))) == 1, calls
    assert "finished at step 4" in (run / "logs" / "restart-0" / "rank-0.log").read_text()


@pytest.mark.parametrize("path", ["submit", "sbatch"])
def test_a_python_without_torch_ends_the_job_before_any_rank(path: str, cluster_profile: Path,
                                                             shared_tmp: Path) -> None:
    base = Path(sys.base_prefix) / "bin" / "python3"  # this venv's own interpreter, without the venv: no torch
    assert subprocess.run([str(base), "-c", "import torch"], capture_output=True).returncode != 0
    data = yaml.safe_load(cluster_profile.read_text())
    data["python"] = str(base)
    profile = cluster_profile.with_name("no-torch.yaml")
    profile.write_text(yaml.safe_dump(data))
    job, run = start(path, profile, shared_tmp)
    assert wait_for_state(job, DONE) == "FAILED"
    assert accounted(job, "ExitCode") == "2:0"
    assert not (run / "logs").exists()  # no rank started
    said = job_log(job, run, shared_tmp)
    lines = [line for line in said.splitlines() if line.startswith("hpcjobs: the nodes' Python")]
    assert len(lines) == 1 and lines[0].startswith("hpcjobs: the nodes' Python on node1 cannot start the ranks (")
    assert f"{base} -> {base}: torch is not installed for this Python" in lines[0], said


def test_a_setup_that_only_loads_modules_falls_back_to_the_submitting_python(cluster_profile: Path,
                                                                            shared_tmp: Path) -> None:
    base = Path(sys.base_prefix) / "bin"
    profile = profile_with_setup(cluster_profile, [f"export PATH={base}:$PATH"])  # python3: no torch
    job, run = start("sbatch", profile, shared_tmp)
    assert wait_for_state(job, DONE) == "COMPLETED"
    assert f"the ranks run {sys.executable} instead (the Python hpcjobs ran from)" in job_log(job, run, shared_tmp)


def job_log(job: str, run: Path, shared_tmp: Path) -> str:
    """Slurm's own output of the job (the batch script's lines), on either path."""
    logs = [*(shared_tmp / "runs" / "slurm-logs").glob(f"*{job}*"), *(run / "submitit").glob(f"{job}*.out")]
    return "".join(p.read_text() for p in logs)


def test_a_rank_without_cuda_where_slurm_allocated_gpus_ends_the_job_naming_it(cluster_profile: Path,
                                                                               shared_tmp: Path) -> None:
    """The test cluster's GPUs are placeholders: without HPCJOBS_BACKEND=gloo every rank is such a rank. The job
    fails at once (it used to train on gloo here, and hang against NCCL ranks on a real cluster)."""
    data = yaml.safe_load(cluster_profile.read_text())
    del data["env"]["HPCJOBS_BACKEND"]
    profile = cluster_profile.with_name("no-forced-backend.yaml")
    profile.write_text(yaml.safe_dump(data))
    job, run = start("submit", profile, shared_tmp)
    assert wait_for_state(job, DONE, timeout=120) == "FAILED"
    status = hpcjobs("status", job).stdout
    assert "Slurm allocated GPUs (SLURM_GPUS_ON_NODE=2) but CUDA is unavailable" in status, status
    assert any(f"on {host}:" in status for host in ("node1", "node2")), status


def test_torch_threads_follow_slurms_cpus_per_task_within_the_ranks_cpus(cluster_profile: Path,
                                                                         shared_tmp: Path) -> None:
    """srun is given --cpus-per-task itself (Slurm 22.05, this cluster, does not pass sbatch's on), and a rank runs
    Slurm's CPUs per task as torch threads, never more than the CPUs it may run on (this host has few)."""
    import os

    data = yaml.safe_load(cluster_profile.read_text())
    data["cpus_per_gpu"] = 4
    del data["env"]["OMP_NUM_THREADS"]
    profile = cluster_profile.with_name("four-cpus.yaml")
    profile.write_text(yaml.safe_dump(data))
    job, run = start("sbatch", profile, shared_tmp)
    assert wait_for_state(job, DONE) == "COMPLETED"
    steps = slurm("sacct", "-n", "-P", "-j", job, "-o", "JobID,AllocCPUS").split()
    assert f"{job}.0|16" in steps, steps  # the srun step: 2 nodes × 2 ranks × 4 CPUs
    expected = min(4, len(os.sched_getaffinity(0)))  # the nodes are namespaces of this host
    log = (run / "logs" / "restart-0" / "rank-0.log").read_text()
    assert f"gloo on cpu, {expected} thread{'s' * (expected != 1)} per rank" in log, log
