"""The test cluster itself: two real hosts, cross-node rendezvous, accounting, count-only GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import accounted, slurm, wait_for_state

pytestmark = pytest.mark.cluster


def test_two_node_batch_job_runs_on_two_hosts(shared_tmp: Path) -> None:
    out = shared_tmp / "hosts.txt"
    job = slurm("sbatch", "--parsable", "-N2", "--ntasks-per-node=1", f"--output={out}",
                "--wrap", "srun hostname").strip()
    assert wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    hosts = sorted(out.read_text().split())
    assert hosts == ["node1", "node2"]


ALLREDUCE = """
import os, subprocess, torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
addr = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                      capture_output=True, text=True).stdout.split()[0]
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29511", rank=rank, world_size=world)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(f"{os.uname().nodename} rank={rank} master={addr} sum={t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def test_srun_gloo_allreduce_across_two_nodes(shared_tmp: Path) -> None:
    script = shared_tmp / "allreduce.py"
    script.write_text(ALLREDUCE)
    out = slurm("srun", "-N2", "--ntasks-per-node=2", "--export=ALL,GLOO_SOCKET_IFNAME=eth0", sys.executable,
                str(script))
    lines = sorted(out.strip().splitlines())
    assert len(lines) == 4, out
    assert {ln.split()[0] for ln in lines} == {"node1", "node2"}
    assert all("master=node1" in ln and "sum=10" in ln for ln in lines), out


def test_sacct_sees_a_finished_job() -> None:
    job = slurm("sbatch", "--parsable", "--wrap", "true", "--output=/dev/null").strip()
    wait_for_state(job, {"COMPLETED"})
    assert accounted(job, "JobID,State") == f"{job}|COMPLETED"


def test_eight_gpus_per_node_on_two_nodes_schedule(shared_tmp: Path) -> None:
    out = shared_tmp / "gpus.txt"
    job = slurm("sbatch", "--parsable", "-N2", "--gpus-per-node=8", "--ntasks-per-node=8", f"--output={out}",
                "--wrap", "srun bash -c 'echo $(hostname) $SLURM_PROCID'").strip()
    assert wait_for_state(job, {"COMPLETED", "FAILED"}) == "COMPLETED"
    lines = out.read_text().split("\n")
    ranks = [ln.split() for ln in lines if ln.strip()]
    assert sorted(int(r) for _, r in ranks) == list(range(16))
    assert {h for h, _ in ranks} == {"node1", "node2"}
    alloc = slurm("scontrol", "show", "job", job)
    assert "gres/gpu=16" in alloc.replace("gres:gpu", "gres/gpu") or "gpu:8" in alloc
