"""Gloo's interface resolved on the node from NCCL's prefix (issue 41, item 2): a profile that names only
NCCL_SOCKET_IFNAME=eth (the nodes have lo and eth0) gives every rank GLOO_SOCKET_IFNAME=eth0, and the job's gloo
collectives across both nodes run. Before, the ranks got GLOO_SOCKET_IFNAME=eth verbatim, no interface at all, and
every gloo group failed at its start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import hpcjobs, wait_for_state

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
REPORT = """\
import json, os, socket
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
gloo = os.environ.get("GLOO_SOCKET_IFNAME")
print("SEEN", json.dumps({"rank": dist.get_rank(), "host": socket.gethostname(), "gloo": gloo,
                          "exists": gloo in [name for _, name in socket.if_nameindex()], "sum": total.item()}))
dist.destroy_process_group()
"""


def nccl_prefix_only(cluster_profile: Path, shared_tmp: Path) -> Path:
    """The test cluster's profile naming NCCL's interface by its prefix and gloo's not at all."""
    data = yaml.safe_load(cluster_profile.read_text())
    data["env"].pop("GLOO_SOCKET_IFNAME")
    data["nccl"]["NCCL_SOCKET_IFNAME"] = "eth"
    path = shared_tmp / "nccl-prefix.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_nccl_prefix_gives_every_rank_an_existing_gloo_interface(cluster_profile: Path, shared_tmp: Path) -> None:
    profile = nccl_prefix_only(cluster_profile, shared_tmp)
    script = shared_tmp / "report.py"
    script.write_text(REPORT)
    out = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", "2", "--json", str(script),
                  cwd=shared_tmp)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    state = wait_for_state(rec["job_id"], DONE)
    logs = sorted((Path(rec["run_dir"]) / "logs" / "restart-0").glob("rank-*.log"))
    assert state == "COMPLETED", "\n".join(log.read_text()[-800:] for log in logs)
    seen = [json.loads(line[5:]) for log in logs for line in log.read_text().splitlines() if line.startswith("SEEN ")]
    assert sorted(s["rank"] for s in seen) == [0, 1, 2, 3] and {s["host"] for s in seen} == {"node1", "node2"}
    assert {s["gloo"] for s in seen} == {"eth0"} and all(s["exists"] for s in seen) and {s["sum"] for s in seen} == {4}


def test_the_shared_trainer_runs_on_an_nccl_prefix(cluster_profile: Path, shared_tmp: Path) -> None:
    """Its control and checkpoint groups are gloo beside the training group."""
    profile = nccl_prefix_only(cluster_profile, shared_tmp)
    out = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", "2", "--json",
                  "trainers.tasks.lm", "--size", "tiny", "--steps", "4", "--log-every", "2", cwd=shared_tmp)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert wait_for_state(rec["job_id"], DONE) == "COMPLETED"
    assert "finished at step 4" in (Path(rec["run_dir"]) / "logs" / "restart-0" / "rank-0.log").read_text()
