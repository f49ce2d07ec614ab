"""A job's ranks really run inside a container image, here, without Slurm: the rendered script of a charliecloud
profile runs in bash with `srun` (two local tasks) and `scontrol` replaced, and `ch-run` real, on an image built
in the test with no Slurm client. Needs charliecloud's ch-run (skipped without it); marked `train`: it trains."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from container_image import PREFIXES, build_rootfs

from conftest import REPO, hpcjobs

# In CI the test cluster's setup installs charliecloud (tests/cluster/testcluster.sh): there a missing ch-run fails.
pytestmark = [pytest.mark.train,
              pytest.mark.skipif(shutil.which("ch-run") is None and os.environ.get("CI") != "true",
                                 reason="charliecloud (ch-run) is not installed")]

STUBS = """
srun() {  # the job's step: SLURM_NTASKS local tasks, srun's flags dropped
  local pids=() rc=0 i; while [ "${1#--}" != "$1" ]; do shift; done
  for i in $(seq 0 $((SLURM_NTASKS-1))); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" > "$T/rank-$i.out" 2>&1 &
    pids+=($!); echo $! >> "$T/pids"
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
scontrol() {
  case "$1 $2" in
    "show hostnames") echo localhost ;;
    "show job") echo "JobId=$SLURM_JOB_ID JobState=RUNNING PreemptTime=None" ;;
    "requeue "*) echo "$2" >> "$T/requeued" ;;
  esac
}
"""


def script(tmp_path: Path, steps: int) -> tuple[Path, Path]:
    image = build_rootfs(tmp_path, str(tmp_path / "runs"))
    mounts = sorted({f"{p}:{p}" for p in PREFIXES})
    profile = tmp_path / "ch.yaml"
    profile.write_text(yaml.safe_dump({
        "scheduler": "slurm", "gpus_per_node": 2, "gpu_request": "none", "runs_dir": str(tmp_path / "runs"),
        "python": "/hpcjobs-python", "container": {"runtime": "charliecloud", "image": str(image), "mounts": mounts},
        "env": {"USER": "root", "HPCJOBS_BACKEND": "gloo", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                "HPCJOBS_PROOF": str(tmp_path / "proof")}}))
    (tmp_path / "proof").mkdir()
    run, job = tmp_path / "runs" / "r", tmp_path / "job.sbatch"
    out = hpcjobs("render", "--profile", str(profile), "--gpus", "2", "--time", "10:00", "--run-dir", str(run),
                  "-o", str(job), "trainers.tasks.lm", "--size", "tiny", "--steps", str(steps), cwd=REPO)
    assert out.returncode == 0, out.stderr
    return job, run


def start(tmp_path: Path, job: Path, job_id: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYTHONPATH"))}
    env.update(T=str(tmp_path), SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="2", SLURM_STEP_NUM_TASKS="2")
    return subprocess.Popen(["bash", "-c", STUBS + f'. "{job}"'], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_every_rank_trains_inside_the_image(tmp_path: Path) -> None:
    job, run = script(tmp_path, 30)
    proc = start(tmp_path, job, "4242")
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, said
    assert '"state": "finished"' in (run / "final.json").read_text()
    proofs = sorted(p.name.split("-")[1] for p in (tmp_path / "proof").glob("rank-*"))
    assert proofs == ["0", "1", "x"], proofs  # both ranks, and the nodes' Python check (no SLURM_PROCID here)
    assert all(p.read_text() == "inside the test image\n" for p in (tmp_path / "proof").glob("rank-*"))


def test_a_stop_inside_the_image_is_requeued_by_the_batch_script(tmp_path: Path) -> None:
    job, run = script(tmp_path, 5000)
    proc = start(tmp_path, job, "4243")
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    for pid in (tmp_path / "pids").read_text().split():
        os.kill(int(pid), signal.SIGUSR2)  # the time-limit signal, to the ranks only, as Slurm sends it
    said, _ = proc.communicate(timeout=300)
    assert (tmp_path / "requeued").read_text() == "4243\n", said + (tmp_path / "rank-0.out").read_text()[-2000:]
    assert proc.returncode == 0, said
